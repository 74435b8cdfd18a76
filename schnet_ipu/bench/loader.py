"""Loader-only molecules/s of ``configs/qm9.yaml``'s training loader, cold and warm, for
every feed mode (in-process, threads, the torch program instead of numba's loop,
device-resident), side by side with stock PyG's DataLoader over the same molecules (radius
edges as a transform). The committed reports: docs/benchmarks/loader/; their figures:
docs/benchmarks/README.md."""

from __future__ import annotations

import itertools
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from schnet_ipu.bench import common, pyg
from schnet_ipu.config import load_config
from schnet_ipu.data import MoleculeStore, radius_edges
from schnet_ipu.feed import compiled as compiled_feed
from schnet_ipu.feed.chunk import OutputBuffers
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.training.data import PreparedData, make_loader, prepare_data

COLUMNS = ["name", "workers", "device", "cold_molecules_per_s", "warm_molecules_per_s",
           "vs_pyg_cold", "vs_pyg_warm", "molecules", "feed_state_mb", "rss_mb"]  # fmt: skip
PLOT = ("name", "warm_molecules_per_s", "molecules/s (warm)")
NO_GPU = " (no GPU here: the in-process program on the same CPU tensors)"
CONFIG = common.PAPER_CONFIG
WARM_EPOCHS = 5  # warm = the median epoch of these rounds (a shared machine is noisy)
PYG = "stock PyG DataLoader"
QUICK = {"extra": ("data.subset=20000", "data.val=1000", "data.test=1000"), "workers": (0, 1)}


def rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def run_epoch(loader: PackedLoader, epoch: int) -> int:
    """The loader's whole ``epoch`` until its device is done (CUDA is asynchronous): molecules."""
    molecules = sum(b.num_molecules for call in loader.epoch(epoch) for b in call)
    if loader.dataset.arrays.device.type == "cuda":
        torch.cuda.synchronize(loader.dataset.arrays.device)
    return molecules


def ours(
    cfg, data: PreparedData, name: str, workers: int, device: str, pairs_s: float, compiled: bool
) -> tuple[dict, PackedLoader, Callable[[], int]]:
    """A mode's row (its cold rate and facts), its loader and its warm timer step (an epoch)."""
    cfg.loader.workers = workers
    cfg.loader.device_resident = "true" if device != "cpu" else "false"
    data.feeds.clear()  # read the store again: cold
    data.atoms = None  # (what prepare_data read is not reused: every mode reads it)
    data.chunk_memory = OutputBuffers()  # nor the memory an earlier mode's chunks used
    start = time.perf_counter()
    loader = make_loader(cfg, data, "train", device=device)
    loader.dataset.compiled = compiled
    molecules = run_epoch(loader, 0)
    cold = time.perf_counter() - start
    arrays = loader.dataset.arrays
    chunk = loader.chunk_batches * loader.dataset.layout.batch_bytes(arrays.forces is not None)
    # chunk memory: the buffers the loader keeps for reuse, else the chunks in flight at most
    in_flight = loader.buffers.nbytes() if loader.buffers else chunk * (loader.ahead + 1)
    row = {"name": name, "workers": workers, "device": str(arrays.device),
           "cold_molecules_per_s": molecules / (pairs_s + cold), "molecules": molecules,
           "feed_state_mb": (arrays.nbytes() + in_flight) / 2**20, "rss_mb": rss_mb()}  # fmt: skip
    rounds = itertools.count(1)
    return row, loader, lambda: run_epoch(loader, next(rounds))


def stock(data: PreparedData, cutoff: float, batch_size: int, limit: int):
    """Stock PyG DataLoader over (up to ``limit`` of) our molecules: cold row, epoch step."""
    from torch_geometric.loader import DataLoader

    class Molecules(list):
        """The items with ``RadiusGraph``'s edges made on access, without torch-cluster."""

        def __getitem__(self, i: int):
            item = super().__getitem__(i).clone()
            item.edge_index = radius_edges(item.pos, cutoff)
            return item

    start = time.perf_counter()
    loader = DataLoader(Molecules(pyg.items(data, "train", limit)), batch_size, shuffle=True)
    molecules = sum(batch.num_graphs for batch in loader)
    row = {"name": PYG, "workers": 0, "device": "cpu",
           "cold_molecules_per_s": molecules / (time.perf_counter() - start),
           "molecules": molecules, "rss_mb": rss_mb()}  # fmt: skip
    return row, lambda: sum(batch.num_graphs for batch in loader)


def run(
    store: str | Path = common.QM9_STORE, extra: tuple[str, ...] = (),
    workers: tuple[int, ...] = (0, 1, 2), pyg_molecules: int = 10000,
) -> dict:  # fmt: skip
    """Every mode on ``configs/qm9.yaml`` (plus ``extra`` overrides) over ``store``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    MoleculeStore(store)  # a bad store is refused under its own name, not the copy's
    with tempfile.TemporaryDirectory() as fresh:
        copy = shutil.copy(store, fresh)  # no pairs file beside it yet: cold builds it
        base = [f"data.path={copy}", "backend.device=cpu", "backend.replicas=1"]
        cfg = load_config(CONFIG, [*base, *extra])
        data = prepare_data(cfg)
        pairs_s = data.timings.get("edge_counts", 0.0)
        loop = compiled_feed.AVAILABLE  # numba's compiled loop fills CPU batches
        modes = [(f"ours {w} workers", w, "cpu", loop) for w in workers]
        modes += [("ours 0 workers, torch program", 0, "cpu", False)] if loop else []
        rows, steps = [], {}
        for name, count, where, compiled in [*modes, ("ours device-resident", 0, device, loop)]:
            row, loader, steps[name] = ours(cfg, data, name, count, where, pairs_s, compiled)
            rows.append(row)
            print(f"{name}: cold {row['cold_molecules_per_s']:.0f} molecules/s", file=sys.stderr)
        per_batch = max(1, round(rows[0]["molecules"] / (len(loader) or 1)))
        reference, steps[PYG] = stock(data, cfg.model.cutoff, per_batch, pyg_molecules)
        print(f"{PYG}: cold {reference['cold_molecules_per_s']:.0f} molecules/s", file=sys.stderr)
        warm = common.measure_side_by_side(steps, common.Timing(0, steps=1, repeats=WARM_EPOCHS))
        for row in [*rows, reference]:
            row["warm_molecules_per_s"] = warm[row["name"]].molecules_per_s
        del steps, loader
    for row, kind in itertools.product(rows, ("cold", "warm")):
        rate = f"{kind}_molecules_per_s"
        row[f"vs_pyg_{kind}"] = common.ratio(row[rate], reference[rate])
    default = next((r for r in rows if r["workers"] == load_config(CONFIG).loader.workers), rows[0])
    keys = ("warm_molecules_per_s", "cold_molecules_per_s", "vs_pyg_warm", "vs_pyg_cold")
    ratios = {f"default_{key}": default[key] for key in keys}
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ratios.update(pairs_build_seconds=pairs_s, peak_rss_mb=peak_rss_mb)
    no_numba = "" if compiled_feed.AVAILABLE else " (numba missing: all rows the torch program)"
    notes = [
        f"configs/qm9.yaml's training loader on {len(data.split['train'])} molecules of "
        f"{store}; cold = pair build ({pairs_s:.1f} s, once per store) + feed arrays + first "
        f"epoch; warm = median of {WARM_EPOCHS} interleaved epochs; workers = threads{no_numba}.",
        f"device-resident ran on {device}{NO_GPU if device == 'cpu' else ''}; PyG: "
        f"{reference['molecules']} molecules, {per_batch} per batch, radius "
        "edges as a transform; feed_state_mb: feed arrays + chunk memory.",
    ]
    return common.new_report("loader", [*rows, reference], ratios, notes)
