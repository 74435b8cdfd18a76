"""Packs -> fixed-shape batches, loaded asynchronously by worker processes.

One epoch is a list of packs (from :func:`schnet_ipu.packing.assign_packs`, re-drawn per
epoch), cut into micro-batches of B packs. A host call takes ``device_iterations x
gradient_accumulation`` micro-batches per replica, and replica r of R reads its own
share: global micro-batch ``(call * R + r) * calls_micro + j``. The epoch is padded at
its tail with empty packs so every replica gets the same number of host calls; those
packs are all padding and contribute nothing.

Workers are torch DataLoader workers. Each opens the HDF5 store lazily and keeps its own
molecule cache; the sampler hands out ``(epoch, index)`` keys, so a batch depends only on
the seed, the epoch and its index, never on which worker built it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from schnet_ipu.batch import Batch
from schnet_ipu.data import MoleculeStore
from schnet_ipu.data.graphs import within_cutoff
from schnet_ipu.packing import PackPlan, assign_packs

PADDING_SPACING = 100.0  # Angstrom between padding atoms; far beyond any cutoff
PADDING_ORIGIN = 1000.0  # Angstrom; padding atoms sit on a line starting here


class LoaderError(RuntimeError):
    """A batch could not be built or changed shape mid-run."""


@dataclass(frozen=True)
class Layout:
    """How micro-batches are shaped and shared out.

    Shapes of every batch: N = packs_per_batch * max_nodes atoms, G = packs_per_batch *
    max_graphs slots, E = packs_per_batch * max_edges edges (radius graphs only, whose
    pairs within ``cutoff`` the collate finds).
    """

    packs_per_batch: int
    max_nodes: int
    max_graphs: int
    max_edges: int | None = None  # directed edges per pack; None for knn graphs
    cutoff: float | None = None  # Angstrom; radius graphs (with max_edges) only
    micro_per_call: int = 1  # device_iterations x gradient_accumulation
    replicas: int = 1
    replica: int = 0

    def __post_init__(self) -> None:
        if (self.max_edges is None) != (self.cutoff is None):
            raise ValueError("a radius-graph layout needs both max_edges and cutoff, knn neither")

    @classmethod
    def from_plan(
        cls, plan: PackPlan, packs_per_batch: int, cutoff: float | None, **share
    ) -> Layout:
        """Shapes of ``plan``; ``cutoff`` for radius graphs, None for knn graphs."""
        return cls(
            packs_per_batch=packs_per_batch,
            max_nodes=plan.max_nodes,
            max_graphs=plan.max_graphs,
            max_edges=None if cutoff is None else plan.max_edges,
            cutoff=cutoff,
            **share,
        )


class PackedDataset(Dataset):
    """Map-style dataset: key ``(epoch, i)`` -> this replica's i-th micro-batch of that epoch.

    Args:
        store: the molecule store (pickled into workers without its file handle).
        indices: int64 [M] store indices of the molecules of this split.
        targets: float64 [len(store)] regression target of every store molecule.
        plan: the packing plan for this split (from the node/edge counts of ``indices``).
        layout: batch shapes (and radius cutoff) and this replica's share.
        seed: the run seed; packs are re-drawn from (seed, epoch).
        edge_counts: int64 [M] directed edges per molecule of ``indices`` (radius graphs).
        shuffle: re-draw pack contents per epoch (False: the same packs every epoch).
    """

    def __init__(
        self,
        store: MoleculeStore,
        indices: np.ndarray,
        targets: np.ndarray,
        plan: PackPlan,
        layout: Layout,
        seed: int,
        edge_counts: np.ndarray | None = None,
        shuffle: bool = True,
    ) -> None:
        self.store = store
        self.indices = np.asarray(indices, dtype=np.int64)
        self.node_counts = store.num_atoms[self.indices]
        self.edge_counts = edge_counts
        self.targets = targets
        self.plan = plan
        self.layout = layout
        self.seed = seed
        self.shuffle = shuffle
        self._packs_epoch: int | None = None
        self._packs: list[np.ndarray] = []
        self._all_forces: np.ndarray | None = None  # float32 [A, 3], read on first use

    # --- sizes -----------------------------------------------------------------------------

    @property
    def calls_per_epoch(self) -> int:
        """Host calls per replica per epoch (equal on every replica)."""
        lay = self.layout
        micro = math.ceil(self.plan.num_packs / lay.packs_per_batch)
        return math.ceil(micro / (lay.micro_per_call * lay.replicas))

    def __len__(self) -> int:
        """Micro-batches this replica reads per epoch."""
        return self.calls_per_epoch * self.layout.micro_per_call

    # --- items -----------------------------------------------------------------------------

    def packs(self, epoch: int) -> list[np.ndarray]:
        """Store indices of the molecules of every pack of the epoch (cached per epoch)."""
        if self._packs_epoch != epoch:
            draw = epoch if self.shuffle else 0
            local = assign_packs(self.plan, self.node_counts, self.edge_counts, self.seed, draw)
            self._packs = [self.indices[p] for p in local]
            self._packs_epoch = epoch
        return self._packs

    def global_micro_batch(self, i: int) -> int:
        lay = self.layout
        call, j = divmod(i, lay.micro_per_call)
        return (call * lay.replicas + lay.replica) * lay.micro_per_call + j

    def __getitem__(self, key: tuple[int, int]) -> Batch:
        epoch, i = key
        packs = self.packs(epoch)
        first = self.global_micro_batch(i) * self.layout.packs_per_batch
        chosen = packs[first : first + self.layout.packs_per_batch]
        return self.collate(chosen)

    def collate(self, packs: list[np.ndarray]) -> Batch:
        """B packs of store indices (fewer at the epoch's tail) -> one fixed-shape Batch."""
        molecules = []
        for pack in packs:
            members = []
            for index in pack.tolist():
                z, pos = self._read(index)
                forces = self._forces(index)
                members.append(PackMolecule(z, pos, float(self.targets[index]), index, forces))
            molecules.append(members)
        return collate(molecules, self.layout, with_forces=self.store.has_forces)

    def _forces(self, index: int) -> np.ndarray | None:
        """Forces [n, 3] of one molecule when the store holds forces (read once per process)."""
        if not self.store.has_forces:
            return None
        if self._all_forces is None:
            self._all_forces = self.store.forces()
        return self._all_forces[self.store.offsets[index] : self.store.offsets[index + 1]]

    def _read(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        try:
            return self.store.molecule(index)
        except Exception as err:
            raise LoaderError(
                f"cannot read molecule {index} from {self.store.path}: {err}"
            ) from err


class PackMolecule(NamedTuple):
    """One molecule as the collate needs it."""

    z: np.ndarray  # [n] atomic numbers
    pos: np.ndarray  # [n, 3] float32 positions in Angstrom
    y: float  # target
    index: int  # index in the store (-1 allowed for molecules from elsewhere)
    forces: np.ndarray | None = None  # [n, 3] float32 target forces, when known


def collate(
    packs: Sequence[Sequence[PackMolecule]], layout: Layout, with_forces: bool | None = None
) -> Batch:
    """Packs of molecules -> one Batch with the shapes of ``layout`` (see schnet_ipu.batch).

    Fewer packs than ``layout.packs_per_batch`` leave the rest empty (all padding). Raises
    LoaderError when a pack holds more atoms, molecules or edges than the layout allows.
    ``with_forces``: give the batch target forces (zeros on padding); None: when any
    molecule has them. Say so for batches that may hold no molecule (an epoch's tail).
    """
    lay = layout
    n_total = lay.packs_per_batch * lay.max_nodes
    g_total = lay.packs_per_batch * lay.max_graphs
    z = np.zeros(n_total, dtype=np.int64)
    pos = np.zeros((n_total, 3), dtype=np.float32)
    graph = np.full(n_total, g_total, dtype=np.int64)
    y = np.zeros(g_total, dtype=np.float32)
    molecule_index = np.full(g_total, -1, dtype=np.int64)
    graph_mask = np.zeros(g_total, dtype=bool)
    if with_forces is None:
        with_forces = any(m.forces is not None for pack in packs for m in pack)
    forces = np.zeros((n_total, 3), dtype=np.float32) if with_forces else None
    if len(packs) > lay.packs_per_batch:
        raise LoaderError(f"{len(packs)} packs for a batch of {lay.packs_per_batch}")
    for p, pack in enumerate(packs):
        node = p * lay.max_nodes
        if len(pack) > lay.max_graphs:
            raise LoaderError(f"pack {p} holds {len(pack)} molecules > {lay.max_graphs}")
        for slot, molecule in enumerate(pack):
            n = len(molecule.z)
            if node + n > (p + 1) * lay.max_nodes:
                raise LoaderError(f"pack {p} overflows {lay.max_nodes} atoms")
            g = p * lay.max_graphs + slot
            z[node : node + n] = molecule.z
            pos[node : node + n] = molecule.pos
            graph[node : node + n] = g
            y[g] = molecule.y
            molecule_index[g] = molecule.index
            graph_mask[g] = True
            if forces is not None:
                if molecule.forces is None:
                    raise LoaderError(f"molecule {molecule.index} has no forces, others do")
                forces[node : node + n] = molecule.forces
            node += n

    node_mask = graph < g_total
    padding = np.flatnonzero(~node_mask)
    pos[padding, 0] = PADDING_ORIGIN + PADDING_SPACING * np.arange(len(padding))
    batch = Batch(
        z=torch.from_numpy(z),
        pos=torch.from_numpy(pos),
        graph=torch.from_numpy(graph),
        node_mask=torch.from_numpy(node_mask),
        y=torch.from_numpy(y),
        graph_mask=torch.from_numpy(graph_mask),
        molecule_index=torch.from_numpy(molecule_index),
        forces=None if forces is None else torch.from_numpy(forces),
    )
    if lay.max_edges is not None:
        filler = int(padding[0]) if len(padding) else 0
        batch.edge_index, batch.edge_mask = radius_pair_edges(batch, lay, filler)
    return batch


def radius_pair_edges(batch: Batch, layout: Layout, filler: int) -> tuple[Tensor, Tensor]:
    """The radius graph of a collated batch, searched pack by pack in one vectorised pass.

    Pairs i < j of the same molecule within ``layout.cutoff`` come from each pack's [M, M]
    distance block, with the arithmetic of :func:`~schnet_ipu.data.graphs.edge_counts` (so
    they match the counts the packer planned with), in row-major order: pack, then i, then j.
    Returns edge_index int64 [2, E] (forward pairs padded to E / 2 with ``(filler, filler)``,
    then the same pairs reversed) and edge_mask bool [E]. Raises LoaderError when a pack holds
    more than ``layout.max_edges`` directed edges.
    """
    packs, size = layout.packs_per_batch, layout.max_nodes
    graph = batch.graph.view(packs, size)
    real = batch.node_mask.view(packs, size)
    keep = within_cutoff(batch.pos.view(packs, size, 3), layout.cutoff).triu_(1)
    keep &= graph.unsqueeze(2) == graph.unsqueeze(1)  # same molecule, hence j real if i is
    keep &= real.unsqueeze(2)
    pack, i, j = keep.nonzero(as_tuple=True)
    per_pack = 2 * torch.bincount(pack, minlength=packs)
    if (per_pack > layout.max_edges).any():
        p = int(per_pack.argmax())
        raise LoaderError(f"pack {p} holds {int(per_pack[p])} edges > {layout.max_edges}")
    half = packs * layout.max_edges // 2
    forward = torch.full((2, half), filler, dtype=torch.int64)
    forward[0, : len(i)] = pack * size + i
    forward[1, : len(i)] = pack * size + j
    mask = torch.zeros(half, dtype=torch.bool)
    mask[: len(i)] = True
    return torch.cat([forward, forward.flip(0)], dim=1), torch.cat([mask, mask])


class EpochSampler(Sampler):
    """Yields ``(epoch, i)`` keys for i in [start, length); the loader sets both."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.epoch = 0
        self.start = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, i) for i in range(self.start, self.length))

    def __len__(self) -> int:
        return self.length - self.start


def _keep(batch: Batch) -> Batch:
    return batch


class PackedLoader:
    """Iterates host calls (lists of ``micro_per_call`` Batches) over an epoch.

    ``workers = 0`` builds batches synchronously in this process (same batches, for
    debugging); otherwise persistent worker processes build them with ``prefetch`` batches
    buffered per worker. Every batch is checked against the first batch's shapes.
    """

    def __init__(
        self, dataset: PackedDataset, workers: int = 0, prefetch: int = 2, pin_memory: bool = False
    ) -> None:
        self.dataset = dataset
        self.sampler = EpochSampler(len(dataset))
        self.signature: tuple | None = None
        self.loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=self.sampler,
            collate_fn=_keep,
            num_workers=workers,
            prefetch_factor=prefetch if workers else None,
            persistent_workers=workers > 0,
            pin_memory=pin_memory,
        )

    def __len__(self) -> int:
        """Host calls per epoch."""
        return self.dataset.calls_per_epoch

    def epoch(self, epoch: int, start_call: int = 0) -> Iterator[list[Batch]]:
        """Host calls of an epoch, from ``start_call`` on (a resumed epoch skips the rest)."""
        self.sampler.epoch = epoch
        self.sampler.start = start_call * self.dataset.layout.micro_per_call
        call: list[Batch] = []
        for batch in self._batches():
            self.check_shape(batch)
            call.append(batch)
            if len(call) == self.dataset.layout.micro_per_call:
                yield call
                call = []

    def _batches(self) -> Iterator[Batch]:
        """The DataLoader's batches; a worker that dies becomes a LoaderError, not a hang."""
        try:
            yield from self.loader
        except LoaderError:
            raise
        except (RuntimeError, ConnectionError, EOFError) as err:
            raise LoaderError(
                f"a data-loading worker died ({type(err).__name__}: {err}); the run stops. "
                "Out of memory? Try fewer loader.workers."
            ) from err

    def check_shape(self, batch: Batch) -> None:
        signature = batch.signature()
        if self.signature is None:
            self.signature = signature
        elif signature != self.signature:
            raise LoaderError(
                f"batch shapes changed mid-run: {signature} != {self.signature}; "
                "fixed-shape batches are a contract of the loader"
            )
