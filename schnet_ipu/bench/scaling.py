"""Data-parallel scaling: 1, 2 and 4 replicas (processes on CPU) with each gradient
reduction (one gloo all-reduce per parameter, one merged gloo all-reduce, the merged buffer
summed through shared memory), with the collectives each optimiser step makes.

Two measurements per row: training through the real pipeline on QM9 (loader shares,
``train_call``), and :func:`schnet_ipu.bench.replication.measure_replication` on
synthetic packed batches, which also times the gradient all-reduce on its own.
"""

from __future__ import annotations

from pathlib import Path

from schnet_ipu.bench.common import QM9_STORE, Timing, new_report, ratio
from schnet_ipu.bench.replicas import TrainJob, train_rates
from schnet_ipu.bench.replication import REDUCTIONS, measure_replication
from schnet_ipu.config import ModelConfig

COLUMNS = ["name", "replicas", "reduction", "molecules_per_s", "step_ms",
           "collectives_per_step", "speedup_vs_1", "synthetic_step_ms", "allreduce_ms"]  # fmt: skip
PLOT = ("name", "molecules_per_s", "training molecules/s (all replicas)")


def run_scaling(
    store: str | Path = QM9_STORE,
    sample: int = 6000,
    size: ModelConfig | None = None,
    timing: Timing | None = None,
    replicas: tuple[int, ...] = (1, 2, 4),
    batch_molecules: int = 32,
    synthetic_packs: int = 8,
) -> dict:
    """Rows per (replicas, reduction); one replica has nothing to reduce, so it runs once."""
    size = size or ModelConfig()
    timing = timing or Timing(warmup=3, steps=10, repeats=3)
    overrides = ["model.graph=radius", "packing.algorithm=tuple", "loader.workers=0"]
    results = []
    for count in replicas:
        reductions = list(REDUCTIONS) if count > 1 else ["none"]
        jobs = []
        for reduction in reductions:
            merge, shared = REDUCTIONS.get(reduction, (True, True))
            flags = [
                f"backend.merge_allreduce={merge}",
                f"backend.shared_memory_allreduce={shared}",
            ]
            jobs.append(TrainJob(str(store), sample, size, timing, [*overrides, *flags],
                                 batch_molecules))  # fmt: skip
        for reduction, row in zip(reductions, train_rates(jobs, count), strict=True):
            name = f"{count} replica(s)" + ("" if count == 1 else f" {reduction}")
            results.append({"name": name, "replicas": count, "reduction": reduction, **row})
    synthetic = measure_replication(
        replicas, tuple(REDUCTIONS), timing.steps, timing.warmup, synthetic_packs
    )
    for row in results:
        match = next(
            r for r in synthetic
            if (r["replicas"], r["reduction"]) == (row["replicas"], row["reduction"])
        )  # fmt: skip
        row["synthetic_step_ms"] = match["step_ms_median"]
        row["allreduce_ms"] = match["allreduce_ms"]
    single = results[0]["molecules_per_s"]
    for row in results:
        row["speedup_vs_1"] = ratio(row["molecules_per_s"], single)
    ratios = {}
    for count in replicas[1:]:
        rate = {r["reduction"]: r["molecules_per_s"] for r in results if r["replicas"] == count}
        ratios[f"scaling_{count}"] = ratio(rate["shared memory"], single)
        ratios[f"merged_vs_per_parameter_{count}"] = ratio(rate["merged"], rate["per-parameter"])
        ratios[f"shared_memory_vs_gloo_{count}"] = ratio(rate["shared memory"], rate["merged"])
    notes = [
        f"Radius graph + tuple packing, about {batch_molecules} molecules per replica and step, "
        f"{sample} sampled QM9 training molecules; loader in-process (0 workers).",
        "Replicas are processes sharing this host's cores (each gets 1/R of the torch "
        "threads), so on a 2-core CPU more replicas cannot add compute: this measures the "
        "overhead of replication and of the collectives, not multi-device speed-up.",
        f"Timing per replica: {timing.warmup} warm-up steps, then {timing.repeats} rounds of "
        f"{timing.steps}-step windows (one per reduction, in turn); medians over the "
        "rounds; molecules/s summed over replicas.",
        "synthetic_step_ms / allreduce_ms: schnet_ipu.bench.replication.measure_replication "
        f"(paper-size SchNet, {synthetic_packs} synthetic packs per replica; the reduction "
        "timed alone, empty for one replica).",
        "scaling_R: R replicas with the default reduction (shared memory) over one replica; "
        "merged_vs_per_parameter_R and shared_memory_vs_gloo_R compare reductions at R.",
        "No GPUs here; on CUDA machines the same backend uses nccl with one GPU per replica.",
    ]
    return new_report("scaling", results, ratios, notes)


def run(quick: bool, store: str | Path) -> dict:
    if quick:
        return run_scaling(store, sample=2000, timing=Timing(2, 4, 2))
    return run_scaling(store)
