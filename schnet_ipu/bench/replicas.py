"""Training rate of a config with R data-parallel replicas (gloo processes on CPU).

Each replica prepares the data, reads its share of the packed batches and trains through
``TorchBackend.train_call``; the rates of the replicas are summed.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from schnet_ipu.backends import init_replica, launch_replicas
from schnet_ipu.backends.distributed import shutdown_replica
from schnet_ipu.bench.common import (
    ModelSize,
    Timing,
    bench_config,
    make_trainer,
    measure,
    packs_for,
    training_step,
)
from schnet_ipu.pipeline import make_loader, prepare_data


@dataclass
class TrainJob:
    """One configuration to time: the sample, model size, timing and config overrides."""

    store: str
    sample: int
    size: ModelSize
    timing: Timing
    overrides: list[str] = field(default_factory=list)
    batch_molecules: int = 32  # per replica and optimiser step, about
    batch_knn: bool = False  # knn searched over the whole batch, not block-diagonally per pack
    result_dir: str = ""


def train_rate(job: TrainJob, replicas: int) -> dict:
    """Summed molecules/s, slowest replica's step time and collectives per step."""
    with tempfile.TemporaryDirectory() as tmp:
        job = dataclasses.replace(
            job, overrides=[*job.overrides, f"backend.replicas={replicas}"], result_dir=tmp
        )
        launch_replicas(_replica, replicas, job)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    if len(ranks) != replicas:
        raise RuntimeError(f"{len(ranks)} of {replicas} replicas reported a rate")
    return {
        "molecules_per_s": sum(r["molecules_per_s"] for r in ranks),
        "step_ms": max(r["step_ms"] for r in ranks),
        "molecules_per_step": sum(r["molecules_per_step"] for r in ranks),
        "collectives_per_step": ranks[0]["collectives_per_step"],
        "packs_per_batch": ranks[0]["packs_per_batch"],
    }


def _replica(rank: int, job: TrainJob) -> None:
    cfg = bench_config(job.store, job.sample, job.size, job.overrides)
    replica = init_replica(cfg.backend, "cpu")
    try:
        data = prepare_data(cfg)
        cfg.packing.packs_per_batch = packs_for(data, job.batch_molecules)
        loader = make_loader(cfg, data, "train", replica.rank, replica.world_size)
        backend = make_trainer(cfg, data, replica)
        if job.batch_knn:
            backend.model.max_nodes_per_pack = (
                cfg.packing.packs_per_batch * data.train_plan.max_nodes
            )
        rate = measure(training_step(loader, backend), job.timing)
        record = {
            "molecules_per_s": rate.molecules_per_s,
            "step_ms": 1000 * rate.step_seconds,
            "molecules_per_step": rate.molecules_per_step,
            "collectives_per_step": backend.collectives_per_step,
            "packs_per_batch": cfg.packing.packs_per_batch,
        }
        Path(job.result_dir, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        shutdown_replica()
