"""Peak memory per host when H hosts train on one store, each holding its share
(``loader.shard=true``), against one host holding the whole store.

Each simulated host is a fresh process of rank r of world size H (one replica per host, as
one GPU per node) that does what a training process does before its first step: prepare the
data (store metadata, split, targets, element counts, packing plans), build its train,
validation and test loaders (which read its share of the atoms) and assemble its first host
call of epoch 0. Its peak resident memory is the kernel's high-water mark (``VmHWM`` of
/proc/self/status) at the end. One process runs at a time; every rank of every H is measured.
The first row is one host with ``loader.shard=false`` (every replica reads the whole store,
the path without shards). The model and its optimiser are not built (a SchNet is a few MB).
Measured on the 4.46M-cluster water store (``hosts/water4m5``, 2 cores): 8.74 GB for one host,
4.81 GB per host for 2, 2.86 GB per host for 4 (0.33x one host); 8.50 GB without shards.

    python -m schnet_ipu.bench hosts --config configs/water_4m5.yaml \\
        --set data.path=data/water_4m5.h5 --out-dir docs/benchmarks/hosts/water4m5
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

from schnet_ipu.bench import common

COLUMNS = ["name", "hosts", "rank", "peak_rss_gb", "held_molecules", "held_atoms", "feed_gb",
           "seconds"]  # fmt: skip
PLOT = ("name", "peak_rss_gb", "peak resident memory per host process (GB)")
HOSTS = (1, 2, 4)
QUICK = {"overrides": ["data.path=data/water_quick.h5", "data.water_clusters=50000"]}
GB = 1e9


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def one_host(config: str, overrides: list[str], rank: int, hosts: int, shard: bool) -> dict:
    """Rank ``rank`` of ``hosts``: data, its loaders and its first host call; its memory."""
    from schnet_ipu.config import load_config
    from schnet_ipu.training.data import make_loader, prepare_data

    start = time.perf_counter()
    settings = [*overrides, f"loader.shard={str(shard).lower()}", "logging.progress=false"]
    cfg = load_config(config, settings)
    data = prepare_data(cfg)
    loaders = {s: make_loader(cfg, data, s, rank, hosts) for s in ("train", "val", "test")}
    first_call = next(iter(loaders["train"].epoch(0)))
    feed = data.feed_arrays("cpu")
    return {
        "name": f"{hosts} host(s)" + ("" if shard else ", whole store (loader.shard=false)"),
        "hosts": hosts,
        "rank": rank,
        "peak_rss_gb": peak_rss_bytes() / GB,
        "held_molecules": len(feed.num_atoms),
        "held_atoms": int(feed.num_atoms.sum()),
        "feed_gb": feed.nbytes() / GB,
        "first_call_molecules": sum(b.num_molecules for b in first_call),
        "seconds": time.perf_counter() - start,
    }


def _child(queue, *args: Any) -> None:
    queue.put(one_host(*args))


def measure(config: str, overrides: list[str], rank: int, hosts: int, shard: bool) -> dict:
    """:func:`one_host` in a fresh process (spawned: nothing of this one shared)."""
    context = multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    process = context.Process(target=_child, args=(queue, config, overrides, rank, hosts, shard))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"host {rank} of {hosts} failed (exit code {process.exitcode})")
    return queue.get()


def run(
    config: str = "configs/water_4m5.yaml",
    overrides: list[str] | None = None,
    host_counts: tuple[int, ...] = HOSTS,
) -> dict:
    """Every rank of 1 and each of ``host_counts`` (sharded), and 1 host unsharded."""
    overrides = list(overrides or [])
    measure(config, overrides, 0, 1, True)  # prepares the store, split and caches once
    results = [measure(config, overrides, 0, 1, False)]
    counts = sorted({1, *host_counts})
    for hosts in counts:
        results += [measure(config, overrides, rank, hosts, True) for rank in range(hosts)]
    peak = {h: max(r["peak_rss_gb"] for r in results[1:] if r["hosts"] == h) for h in counts}
    ratios = {f"{h} hosts / 1 host, peak per host": peak[h] / peak[1] for h in counts[1:]}
    ratios["1 host with shards / without"] = peak[1] / results[0]["peak_rss_gb"]
    notes = [
        f"config {config} with {' '.join(overrides) or 'no overrides'}; one replica per host "
        "(world size = hosts); every rank of every host count measured, one process at a "
        "time; peak = VmHWM after data, three loaders and the first host call of epoch 0.",
        "Every host also reads the store's atomic numbers once (1 of the 13 bytes an atom "
        "takes) for the element counts of the dressed-atom fit all replicas share, and holds "
        "per-molecule metadata of the whole store (offsets, ids, targets, split, counts).",
    ]
    return common.new_report("hosts", results, ratios, notes)
