"""HydroNet-scale check: prepare a config's data (generating the store on first use), then
time one training epoch through the loader, and print every number issue 21 asks for.

    python scripts/water_scale.py --config configs/water_4m5.yaml \\
        data.path=/work/scratch/water/water_4m5.h5 [--batches N] [--json PATH]

Prints wall time per stage (store = generation or import, split, targets, packing), the
size histogram (clusters per water count), the store size on disk, clusters/s of the epoch
(``pipeline.make_loader(cfg, data, "train").epoch(0)``; ``--batches N`` stops after N host
calls when the loader is too slow for a whole epoch) and the peak memory of this process plus
its loader workers (sum of PSS, sampled every 0.5 s; the largest single RSS beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from schnet_ipu.config import load_config  # noqa: E402
from schnet_ipu.training.data import make_loader, prepare_data  # noqa: E402


class PeakMemory:
    """Largest memory of this process and all its children, sampled in a thread: the sum of
    their proportional set sizes (PSS: pages shared by forked loader workers counted once)
    and, separately, the largest single resident set (RSS)."""

    def __init__(self, every: float = 0.5) -> None:
        self.peak = 0
        self.peak_single_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every,), daemon=True)
        self._thread.start()

    def _watch(self, every: float) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for proc in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    info = proc.memory_full_info()
                    total += info.pss
                    self.peak_single_rss = max(self.peak_single_rss, info.rss)
            self.peak = max(self.peak, total)
            time.sleep(every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/water_4m5.yaml")
    parser.add_argument("--batches", type=int, default=0, help="host calls to time; 0 = all")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="a.b=value config overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    memory = PeakMemory()

    start = time.perf_counter()
    data = prepare_data(cfg)
    prepare = time.perf_counter() - start
    store = data.store
    waters, clusters = np.unique(store.num_atoms // 3, return_counts=True)  # equal lengths
    report = {
        "config": args.config,
        "store": str(store.path),
        "clusters": len(store),
        "atoms": int(store.num_atoms.sum()),
        "store_bytes": store.path.stat().st_size,
        "stage_seconds": {**data.timings, "prepare_total": prepare},
        "histogram": {int(w): int(c) for w, c in zip(waters, clusters)},
        "plan": {
            "max_nodes": data.train_plan.max_nodes,
            "max_graphs": data.train_plan.max_graphs,
            "packs": data.train_plan.num_packs,
            "node_efficiency": data.train_plan.node_efficiency,
        },
    }
    print(f"store {store.path}: {len(store)} clusters, {report['atoms']} atoms, "
          f"{report['store_bytes'] / 1e9:.2f} GB on disk")  # fmt: skip
    for name, seconds in report["stage_seconds"].items():
        print(f"  {name:<14} {seconds:9.1f} s")
    print("clusters per size (waters: count):")
    for w, c in report["histogram"].items():
        print(f"  W{w:<3} {c:9d}")

    loader = make_loader(cfg, data, "train")
    calls = len(loader) if args.batches <= 0 else min(args.batches, len(loader))
    molecules, batches = 0, 0
    start = time.perf_counter()
    for call in loader.epoch(0):
        molecules += sum(b.num_molecules for b in call)
        batches += 1
        if batches == calls:
            break
    seconds = time.perf_counter() - start
    report["epoch"] = {
        "host_calls": batches,
        "host_calls_per_epoch": len(loader),
        "clusters": molecules,
        "train_clusters": len(data.split["train"]),
        "seconds": seconds,
        "clusters_per_s": molecules / seconds,
        "workers": cfg.loader.workers,
    }
    report["peak_pss_bytes"] = memory.stop()
    report["peak_single_rss_bytes"] = memory.peak_single_rss
    whole = "whole epoch" if batches == len(loader) else f"{batches} of {len(loader)} calls"
    print(f"epoch 0 ({whole}): {molecules} clusters in {seconds:.1f} s = "
          f"{molecules / seconds:,.0f} clusters/s")  # fmt: skip
    print(
        f"peak memory: {report['peak_pss_bytes'] / 2**30:.2f} GiB PSS of the process and its "
        f"loader workers; largest single RSS {memory.peak_single_rss / 2**30:.2f} GiB"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
