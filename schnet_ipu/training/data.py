"""From a config to ready data: store, split, targets, packing plans, baseline, loaders.

Everything here runs before the first step and checks what needs the data: a molecule
larger than the pack limits, or more replicas than the epoch has batches to feed.

With ``loader.shard`` each replica's loaders hold its share of every split
(:mod:`schnet_ipu.packing.shards`, :func:`hold_share`) and its feed reads only those
molecules' atoms from the store; what every replica still holds whole is per molecule
(offsets, targets, split, element counts, packing plans) or, for radius graphs, the pairs
file's pairs until the feed keeps its share of them.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from schnet_ipu.config import Config, ConfigError
from schnet_ipu.data import (
    MoleculeStore,
    RadiusPairs,
    StoreError,
    ensure_store,
    load_or_make_split,
    radius_pairs,
)
from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.feed.chunk import OutputBuffers
from schnet_ipu.feed.dataset import PackedDataset
from schnet_ipu.feed.layout import Layout
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.packing import PackingError, PackPlan, plan_packing
from schnet_ipu.packing.shards import Shard, shard_plan
from schnet_ipu.training.dressed_atoms import (
    ElementCounts,
    element_counts,
    fit_dressed_atoms,
    predict_dressed_atoms,
)

log = logging.getLogger("schnet_ipu")

SPLITS = ("train", "val", "test")


@contextmanager
def stage(name: str, timings: dict[str, float]):
    """Log a preparation stage and how long it took."""
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
    log.info("%s: %.2f s", name, timings[name])


@dataclass
class PreparedData:
    """The data side of a run, shared by training, evaluation and prediction."""

    store: MoleculeStore
    split: dict[str, np.ndarray]  # split name -> int64 store indices
    targets: np.ndarray  # float64 [M]: the target, minus atom references when enabled
    unit: str
    pairs: RadiusPairs | None  # radius graphs: every molecule's pairs within the cutoff
    plans: dict[str, PackPlan]  # split name -> plan with the run's shared limits
    counts: ElementCounts  # element counts of every store molecule
    dressed_atoms: np.ndarray  # float64 [119] baseline energy per element (train fit)
    timings: dict[str, float]
    feeds: dict[str, FeedArrays] = field(default_factory=dict)  # device -> the loaders' arrays
    # radius graphs: the store's (z [A], pos [A, 3]) as prepare_data read them, kept only
    # until the CPU feed is built from them (one read of the atoms per run)
    atoms: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    # memory the loaders assemble CPU chunks into, shared: the splits' loaders take turns
    chunk_memory: OutputBuffers = field(default_factory=OutputBuffers, repr=False)
    # loader.shard (hold_share): replica r of R's share of each split, and the store indices
    # of those molecules (ascending), the only ones its feed reads; None: the whole store
    share: tuple[int, int, dict[str, Shard]] | None = None
    held: np.ndarray | None = None

    @property
    def edge_counts(self) -> np.ndarray | None:
        """int64 [M] directed edges within the cutoff (radius graphs), else None."""
        return None if self.pairs is None else 2 * self.pairs.counts

    @property
    def train_plan(self) -> PackPlan:
        return self.plans["train"]

    def baseline_errors(self, split: str) -> np.ndarray:
        """[M_split] dressed-atom prediction minus target."""
        index = self.split[split]
        prediction = predict_dressed_atoms(self.counts[index], self.dressed_atoms)
        return prediction - self.targets[index]

    @functools.cached_property
    def residual_std(self) -> float:
        """Spread of the training targets around the dressed-atom baseline (loss scale)."""
        return float(np.std(self.baseline_errors("train"))) or 1.0

    def mean_atoms(self) -> float:
        return float(self.store.num_atoms[self.split["train"]].mean())

    def feed_arrays(self, device: str) -> FeedArrays:
        """The store's flat arrays for the loaders, once per device (see schnet_ipu.feed.arrays)."""
        if device not in self.feeds:
            cpu = self.feeds.get("cpu") or self._cpu_feed()
            self.feeds[device] = cpu.to(device)
        return self.feeds[device]

    def _cpu_feed(self) -> FeedArrays:
        """The CPU feed, from the atoms prepare_data read (then dropped) if it kept any."""
        atoms, self.atoms = self.atoms, None
        return FeedArrays.from_store(
            self.store, self.targets, self.pairs, atoms=atoms, molecules=self.held
        )


def prepare_data(cfg: Config) -> PreparedData:
    timings: dict[str, float] = {}
    with stage("store", timings):
        store = MoleculeStore(ensure_store(cfg.data, cfg.logging.progress))
        log.info("store %s: %d molecules, %s", store.path, len(store), store.attrs.get("source"))
        if cfg.model.graph == "knn" and store.periodic:
            raise ConfigError(
                f"model.graph=knn ignores cells, but {store.path} holds periodic frames; set "
                "model.graph=radius (periodic images need the radius graph's cell shifts)"
            )
    with stage("split", timings):
        try:
            split_seed = cfg.seed if cfg.data.split_seed < 0 else cfg.data.split_seed
            split = load_or_make_split(
                store.path, len(store), cfg.data.val, cfg.data.test, split_seed, cfg.data.subset
            )
        except StoreError:
            raise  # a damaged split file: its message names the file
        except ValueError as err:
            raise ConfigError(f"{err}; change data.subset, data.val or data.test") from err
        for name in SPLITS:
            if len(split[name]) == 0:
                raise ConfigError(f"the {name} split is empty; change data.val/data.test/subset")
        log.info("split: %s", ", ".join(f"{k} {len(v)}" for k, v in split.items()))
    with stage("targets", timings):
        targets = store.target(cfg.data.target).astype(np.float64)
        # radius graphs: read the atoms once, for the counts, a pairs build and the feed
        # (shards: the feed reads its own molecules, the pairs come from the pairs file)
        whole = cfg.model.graph == "radius" and not cfg.loader.shard
        atoms = store.concatenated() if whole else None
        z = store.atomic_numbers() if atoms is None else atoms[0]
        counts = element_counts(z, store.offsets)
        atomref = store.atomref(cfg.data.target)
        if cfg.data.atomrefs and atomref is not None:
            targets = targets - counts.dot(atomref)
        dressed = fit_dressed_atoms(counts[split["train"]], targets[split["train"]])
    pairs = None
    if cfg.model.graph == "radius":
        with stage("edge_counts", timings):
            pairs = radius_pairs(  # the feed's pairs too
                store,
                cfg.model.cutoff,
                positions=None if atoms is None else atoms[1],
                progress=cfg.logging.progress,
            )
    with stage("packing", timings):
        plans = plan_splits(cfg, store, split, None if pairs is None else 2 * pairs.counts)
        p = plans["train"]
        log.info(
            "packing %s: %d atoms, %s edges, %d molecules per pack; %d packs, node efficiency "
            "%.2f%%",
            p.algorithm,
            p.max_nodes,
            p.max_edges,
            p.max_graphs,
            p.num_packs,
            100 * p.node_efficiency,
        )
    return PreparedData(
        store=store,
        split=split,
        targets=targets,
        unit=store.unit(cfg.data.target),
        pairs=pairs,
        plans=plans,
        counts=counts,
        dressed_atoms=dressed,
        timings=timings,
        atoms=atoms,
    )


def plan_splits(
    cfg: Config, store: MoleculeStore, split: dict[str, np.ndarray], edges: np.ndarray | None
) -> dict[str, PackPlan]:
    """Plan the training split, then every split with the same limits (one batch shape).

    The limits must hold the largest molecule of any split, so the automatic search on the
    training histogram is redone with that floor when a val/test molecule is larger.
    """
    pc = cfg.packing
    radius = cfg.model.graph == "radius"
    algorithm = pc.algorithm

    def plan(name: str, max_nodes: int, max_edges: int, max_graphs: int) -> PackPlan:
        index = split[name]
        limits = (
            (store.num_atoms, max_nodes, "atoms", "max_nodes"),
            (edges, max_edges, "edges", "max_edges"),
        )
        for sizes, limit, what, option in limits:
            too_big = index[sizes[index] > limit] if limit and sizes is not None else index[:0]
            if len(too_big):  # named by store index and record id, not position in the split
                i = int(too_big[0])
                raise ConfigError(
                    f"{store.record_name(i)} ({name} split) has {sizes[i]} {what}, more than "
                    f"packing.{option}={limit} ({len(too_big)} molecule(s) too large); raise "
                    f"packing.{option} to at least {sizes[index].max()}"
                )
        try:
            return plan_packing(
                store.num_atoms[index],
                edges[index] if radius else None,
                algorithm=algorithm,
                max_nodes=max_nodes,
                max_edges=max_edges,
                max_graphs=max_graphs,
                target_efficiency=pc.target_efficiency,
                heuristic=pc.heuristic,
            )
        except PackingError as err:
            raise ConfigError(
                f"{name} split: {err} (packing.max_nodes / packing.max_edges)"
            ) from err

    everything = np.concatenate([split[s] for s in SPLITS])
    floor_nodes = int(store.num_atoms[everything].max())
    floor_edges = int(edges[everything].max()) if radius else 0
    max_edges = pc.max_edges if radius else 0
    train = plan("train", pc.max_nodes, max_edges, pc.max_graphs)
    too_small = train.max_nodes < floor_nodes or (radius and train.max_edges < floor_edges)
    if too_small and not pc.max_nodes and not pc.max_edges:
        train = plan(
            "train", max(train.max_nodes, floor_nodes), max(train.max_edges or 0, floor_edges), 0
        )
    if cfg.model.graph == "knn" and cfg.model.k >= train.max_nodes:
        raise ConfigError(
            f"model.k={cfg.model.k} needs packs of more than k atoms, but packs hold "
            f"{train.max_nodes}; lower model.k or raise packing.max_nodes"
        )
    plans = {"train": train}
    for name in ("val", "test"):
        plans[name] = plan(name, train.max_nodes, train.max_edges or 0, train.max_graphs)
    return plans


def make_loader(
    cfg: Config,
    data: PreparedData,
    split: str,
    replica: int = 0,
    replicas: int = 1,
    pin_memory: bool = False,
    replicas_in_call: int = 1,
    device: str = "cpu",
) -> PackedLoader:
    """The loader of one split for one process.

    Training reads D x A micro-batches per host call, times ``replicas_in_call`` when one
    process feeds several replicas (PopTorch); every other split reads one per call. Batches
    are assembled on ``device`` when the data is device-resident (``loader.device_resident``).
    With ``loader.shard`` the loader holds this replica's share of the split (its epoch
    padded to the largest share's packs), else the whole split, whose packs it deals over
    the replicas each epoch.
    """
    training = split == "train"
    micro = 1
    if training:
        micro = cfg.backend.device_iterations * cfg.backend.gradient_accumulation * replicas_in_call
    if cfg.loader.shard:
        shard = hold_share(data, replica, replicas)[split]
        plan, epoch_packs = shard.plan, shard.most_packs
        index = data.split[split][shard.positions]  # store indices
        rows = np.searchsorted(data.held, index)  # rows of the feed, which holds data.held
        share = {"replicas": 1, "replica": 0, "replica_balance": "none"}
    else:
        plan, epoch_packs = data.plans[split], None
        index = rows = data.split[split]
        balance = cfg.packing.replica_balance if training else "none"
        share = {"replicas": replicas, "replica": replica, "replica_balance": balance}
    layout = Layout.from_plan(
        data.train_plan,
        cfg.packing.packs_per_batch,
        cutoff=cfg.model.cutoff if cfg.model.graph == "radius" else None,
        micro_per_call=micro,
        **share,
    )
    feed = data.feed_arrays("cpu")
    if resident_device(cfg.loader.device_resident, device, feed.nbytes()) != "cpu":
        feed = data.feed_arrays(device)
    dataset = PackedDataset(
        data.store,
        rows,
        data.targets,
        plan,
        layout,
        seed=cfg.seed,
        edge_counts=None if data.pairs is None else 2 * data.pairs.counts[index],
        shuffle=training,
        arrays=feed,
        epoch_packs=epoch_packs,
    )
    if training:
        needed = micro * replicas * cfg.packing.packs_per_batch
        if data.plans[split].num_packs < needed:
            raise ConfigError(
                f"the training split fills {data.plans[split].num_packs} packs, but one step "
                f"of {replicas} replica(s) x {micro} micro-batch(es) x "
                f"{cfg.packing.packs_per_batch} packs needs {needed}; lower backend.replicas, "
                "backend.device_iterations, backend.gradient_accumulation or "
                "packing.packs_per_batch, or use more data"
            )
    pin = pin_memory and feed.device.type == "cpu"
    return PackedLoader(
        dataset, cfg.loader.workers, cfg.loader.prefetch, pin_memory=pin, buffers=data.chunk_memory
    )


def hold_share(data: PreparedData, replica: int, replicas: int) -> dict[str, Shard]:
    """``loader.shard``: replica ``replica`` of ``replicas``' share of every split, worked
    out on first use (:func:`~schnet_ipu.packing.shards.shard_plan`), which also makes the
    feed hold only those molecules (``data.held``). One process holds one replica's share."""
    if data.share is not None:
        held_by = data.share[:2]
        if held_by != (replica, replicas):
            raise ValueError(f"this data holds replica {held_by[0]} of {held_by[1]}'s share")
        return data.share[2]
    shards = {}
    for name in SPLITS:
        plan, index = data.plans[name], data.split[name]
        if plan.num_packs < replicas:
            raise ConfigError(
                f"the {name} split fills {plan.num_packs} pack(s), fewer than the {replicas} "
                "replicas that each hold a share of it (loader.shard=true); use more data "
                "(data.val, data.test), fewer replicas, or loader.shard=false"
            )
        edges = None if data.pairs is None else 2 * data.pairs.counts[index]
        shards[name] = shard_plan(plan, data.store.num_atoms[index], edges, replica, replicas)
    data.held = np.unique(np.concatenate([data.split[n][s.positions] for n, s in shards.items()]))
    data.share = (replica, replicas, shards)
    log.info(
        "shard: replica %d of %d holds %d of %d molecules (%s)",
        replica,
        replicas,
        len(data.held),
        sum(len(v) for v in data.split.values()),
        ", ".join(f"{n} {len(s.positions)}" for n, s in shards.items()),
    )
    return shards


def resident_device(setting: str, device: str, nbytes: int) -> str:
    """Where the loader keeps a split's arrays: ``device`` when ``loader.device_resident`` is
    true, or auto on CUDA with ``nbytes`` under half the free device memory; else cpu."""
    if setting == "false" or not device.startswith("cuda"):
        return "cpu"
    if setting == "true":
        return device
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return device if nbytes < free // 2 else "cpu"
