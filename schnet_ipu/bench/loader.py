"""Loader-only throughput (0, 1, 2 workers; cold and warm cache) against training consumption.

Cold: a fresh store handle and loader, so every molecule is read from HDF5 (and worker
start-up is paid); warm: the next epoch through the same loader, molecules cached. The
training rate is the default config's step rate measured in the same run.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

from schnet_ipu.bench.common import (
    QM9_STORE,
    Timing,
    bench_config,
    make_trainer,
    measure,
    new_report,
    ratio,
    training_step,
)
from schnet_ipu.config import ModelConfig
from schnet_ipu.data import MoleculeStore
from schnet_ipu.loader import PackedLoader
from schnet_ipu.pipeline import PreparedData, make_loader, prepare_data

COLUMNS = ["name", "workers", "cache", "batches_per_s", "molecules_per_s", "batches",
           "loader_vs_training"]  # fmt: skip
PLOT = ("name", "batches_per_s", "micro-batches/s")


def epoch_rate(loader: PackedLoader, epoch: int, max_calls: int) -> tuple[float, float, int]:
    """Iterate up to ``max_calls`` host calls of an epoch; (batches/s, molecules/s, batches)."""
    batches = molecules = 0
    start = time.perf_counter()
    for call in loader.epoch(epoch):
        batches += len(call)
        molecules += sum(b.num_molecules for b in call)
        if batches >= max_calls:
            break
    seconds = time.perf_counter() - start
    return batches / seconds, molecules / seconds, batches


def fresh(data: PreparedData) -> PreparedData:
    """The same data with a new store handle whose molecule cache is empty."""
    return dataclasses.replace(data, store=MoleculeStore(data.store.path, cache=True))


def run_loader(
    store: str | Path = QM9_STORE,
    sample: int = 10000,
    size: ModelConfig | None = None,
    timing: Timing | None = None,
    workers: tuple[int, ...] = (0, 1, 2),
    max_batches: int = 400,
) -> dict:
    """Loader batches/s for each worker count, cold then warm, beside the training step rate."""
    size = size or ModelConfig()
    timing = timing or Timing(warmup=3, steps=10, repeats=3)
    cfg = bench_config(store, sample, size, [])
    data = prepare_data(cfg)

    trainer_loader = make_loader(cfg, data, "train")
    train = measure(training_step(trainer_loader, make_trainer(cfg, data)), timing)
    del trainer_loader
    gc.collect()
    default = cfg.loader.workers
    training_rate = 1 / train.step_seconds  # one micro-batch per host call by default
    results = [
        {
            "name": f"training ({default} workers)",
            "workers": default,
            "cache": "-",
            "batches_per_s": training_rate,
            "molecules_per_s": train.molecules_per_s,
        }
    ]
    for count in workers:
        cfg.loader.workers = count
        loader = make_loader(cfg, fresh(data), "train")
        for cache, epoch in (("cold", 0), ("warm", 1)):
            batches_per_s, molecules_per_s, batches = epoch_rate(loader, epoch, max_batches)
            results.append(
                {
                    "name": f"loader {count} workers {cache}",
                    "workers": count,
                    "cache": cache,
                    "batches_per_s": batches_per_s,
                    "molecules_per_s": molecules_per_s,
                    "batches": batches,
                    "loader_vs_training": ratio(batches_per_s, training_rate),
                }
            )
        del loader
        gc.collect()
    reference = default if default in workers else max(workers)
    warm = next(r for r in results[1:] if r["workers"] == reference and r["cache"] == "warm")
    ratios = {
        "loader_vs_training": warm["loader_vs_training"],
        **{
            f"loader_{r['workers']}w_{r['cache']}_vs_training": r["loader_vs_training"]
            for r in results[1:]
        },
    }
    notes = [
        f"Default config (graph {cfg.model.graph}, packing {cfg.packing.algorithm}, "
        f"{cfg.packing.packs_per_batch} packs per batch) on {len(data.split['train'])} QM9 "
        "training molecules.",
        f"Training: median of {timing.repeats} windows of {timing.steps} steps after "
        f"{timing.warmup} warm-up steps, loading included.",
        f"Loader: up to {max_batches} micro-batches per epoch; cold = fresh store handle and "
        "loader (includes worker start-up), warm = the next epoch (molecules cached).",
        "loader_vs_training = loader micro-batches/s / training micro-batches/s "
        f"({reference} workers, warm); above 1 the loader keeps up.",
    ]
    return new_report("loader", results, ratios, notes)


def run(quick: bool, store: str | Path) -> dict:
    if quick:
        return run_loader(store, sample=2000, timing=Timing(2, 5, 3), max_batches=100)
    return run_loader(store)
