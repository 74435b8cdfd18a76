"""The ablation, after Graphcore's SchNet paper: start from padded batches and add one
optimisation at a time, measuring training molecules/s after each.

Every step runs with the same replicas (2 gloo processes by default, so the merged
all-reduce has something to merge) on the same QM9 sample, about the same molecules per
optimiser step. Steps are cumulative: each keeps everything above it.
"""

from __future__ import annotations

from pathlib import Path

from schnet_ipu.bench.common import QM9_STORE, Timing, new_report, ratio
from schnet_ipu.bench.replicas import TrainJob, train_rates
from schnet_ipu.config import ModelConfig

START = [
    "packing.algorithm=pad_to_max",
    "model.graph=knn",
    "loader.workers=0",
    "loader.prefetch=1",
    "model.stable_softplus=false",
    "backend.merge_allreduce=false",
    "backend.shared_memory_allreduce=false",
]
# (step, overrides added, knn over the whole batch?)
STEPS: list[tuple[str, list[str], bool]] = [
    ("padded (start)", [], True),
    ("+ packing (LPFHP)", ["packing.algorithm=lpfhp"], True),
    ("+ asynchronous loading (1 worker)", ["loader.workers=1"], True),
    ("+ stable softplus", ["model.stable_softplus=true"], True),
    ("+ merged all-reduce", ["backend.merge_allreduce=true"], True),
    ("+ prefetch (4 batches)", ["loader.prefetch=4"], True),
    ("+ block-diagonal knn", [], False),
    ("+ radius graph, tuple packing", ["model.graph=radius", "packing.algorithm=tuple",
                                       "model.pair_symmetric=false"], False),
    ("+ pair-symmetric filters", ["model.pair_symmetric=true"], False),
    ("+ shared-memory all-reduce", ["backend.shared_memory_allreduce=true"], False),
    ("+ torch.compile", ["backend.compile=true"], False),
]  # fmt: skip

COLUMNS = ["step", "molecules_per_s", "step_ms", "molecules_per_step", "collectives_per_step",
           "vs_previous", "vs_start"]  # fmt: skip
PLOT = ("step", "molecules_per_s", "training molecules/s (all replicas)")


def run_ablation(
    store: str | Path = QM9_STORE,
    sample: int = 6000,
    size: ModelConfig | None = None,
    timing: Timing | None = None,
    replicas: int = 2,
    batch_molecules: int = 32,
    compile: bool = True,
) -> dict:
    """Molecules/s after each cumulative step, with speed-ups over the previous and the start."""
    size = size or ModelConfig()
    timing = timing or Timing(warmup=3, steps=10, repeats=3)
    steps = [s for s in STEPS if compile or "backend.compile=true" not in s[1]]
    jobs, overrides = [], list(START)
    for _, added, batch_knn in steps:
        overrides = [*overrides, *added]
        jobs.append(
            TrainJob(str(store), sample, size, timing, overrides, batch_molecules, batch_knn)
        )
    results = []
    for (name, _, _), row in zip(steps, train_rates(jobs, replicas), strict=True):
        previous = results[-1]["molecules_per_s"] if results else row["molecules_per_s"]
        start = results[0]["molecules_per_s"] if results else row["molecules_per_s"]
        results.append(
            {
                "step": name,
                **row,
                "vs_previous": ratio(row["molecules_per_s"], previous),
                "vs_start": ratio(row["molecules_per_s"], start),
            }
        )
    ratios = {r["step"]: r["vs_start"] for r in results}
    notes = [
        f"{replicas} replica(s) (gloo processes sharing this host's cores), about "
        f"{batch_molecules} molecules per replica and optimiser step, {sample} sampled QM9 "
        f"training molecules; SchNet {size.hidden_channels} features, "
        f"{size.num_interactions} interactions.",
        "Start: pad-to-max batches, knn searched over the whole batch, loading in the "
        "training process, naive softplus, one gloo all-reduce per parameter, 1 batch prefetched.",
        "Block-diagonal knn searches each pack on its own instead of the whole batch; the "
        "radius-graph step switches to precomputed radius edges with tuple packing.",
        f"Timing: {timing.warmup} warm-up steps per configuration (including compilation) "
        f"excluded, then {timing.repeats} rounds in which every configuration runs a window of "
        f"{timing.steps} steps in turn; medians over the rounds.",
        "ratios: speed-up of each step over the start.",
    ]
    return new_report("ablation", results, ratios, notes)


def run(quick: bool, store: str | Path) -> dict:
    if quick:
        return run_ablation(store, sample=2000, timing=Timing(2, 4, 2))
    return run_ablation(store)
