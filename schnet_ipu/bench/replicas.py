"""Training rates of configs with R data-parallel replicas (gloo processes on CPU).

One launch of R processes times a list of jobs in turn (the data of each graph and packing
is prepared once per process); each replica reads its share of the packed batches and
trains through ``TorchBackend.train_call``, and the replicas' rates are summed.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from schnet_ipu.backends import init_replica, launch_replicas
from schnet_ipu.backends.distributed import shutdown_replica
from schnet_ipu.bench.common import (
    Timing,
    bench_config,
    make_trainer,
    measure_side_by_side,
    packs_for,
    training_step,
)
from schnet_ipu.config import ModelConfig
from schnet_ipu.pipeline import PreparedData, make_loader, prepare_data


@dataclass
class TrainJob:
    """One configuration to time: the sample, model size, timing and config overrides."""

    store: str
    sample: int
    size: ModelConfig
    timing: Timing  # the first job's timing applies to every job of a launch
    overrides: list[str] = field(default_factory=list)
    batch_molecules: int = 32  # per replica and optimiser step, about
    batch_knn: bool = False  # knn searched over the whole batch, not block-diagonally per pack


def train_rates(jobs: list[TrainJob], replicas: int) -> list[dict]:
    """Per job: summed molecules/s, slowest replica's step time, collectives per step."""
    with tempfile.TemporaryDirectory() as tmp:
        launch_replicas(_replica, replicas, jobs, replicas, tmp)
        rows = []
        for i in range(len(jobs)):
            files = [Path(tmp, f"job{i}_rank{r}.json") for r in range(replicas)]
            ranks = [json.loads(f.read_text()) for f in files]
            rows.append(
                {
                    "molecules_per_s": sum(r["molecules_per_s"] for r in ranks),
                    "step_ms": max(r["step_ms"] for r in ranks),
                    "molecules_per_step": sum(r["molecules_per_step"] for r in ranks),
                    "collectives_per_step": ranks[0]["collectives_per_step"],
                    "packs_per_batch": ranks[0]["packs_per_batch"],
                }
            )
    return rows


def _replica(rank: int, jobs: list[TrainJob], replicas: int, out_dir: str) -> None:
    """Set every job up, then time them side by side (every rank in the same order)."""
    prepared: dict[tuple, PreparedData] = {}
    steps, backends, packs = {}, [], []
    try:
        for i, job in enumerate(jobs):
            cfg = bench_config(
                job.store, job.sample, job.size, [*job.overrides, f"backend.replicas={replicas}"]
            )
            replica = init_replica(cfg.backend, "cpu")
            key = (cfg.model.graph, cfg.packing.algorithm)
            if key not in prepared:
                prepared[key] = prepare_data(cfg)
            data = prepared[key]
            cfg.packing.packs_per_batch = packs_for(data, job.batch_molecules)
            loader = make_loader(cfg, data, "train", replica.rank, replica.world_size)
            backend = make_trainer(cfg, data, replica)
            if job.batch_knn:  # one knn block spanning every pack of the batch
                backend.model.max_nodes_per_pack = (
                    cfg.packing.packs_per_batch * data.train_plan.max_nodes
                )
            steps[i] = training_step(loader, backend)
            backends.append(backend)
            packs.append(cfg.packing.packs_per_batch)
        timing = jobs[0].timing
        for i, rate in measure_side_by_side(steps, timing).items():
            record = {
                "molecules_per_s": rate.molecules_per_s,
                "step_ms": 1000 * rate.step_seconds,
                "molecules_per_step": rate.molecules_per_step,
                "collectives_per_step": backends[i].collectives_per_step,
                "packs_per_batch": packs[i],
            }
            Path(out_dir, f"job{i}_rank{rank}.json").write_text(json.dumps(record))
    finally:
        shutdown_replica()
