"""Step time of force training against energy-only training, side by side.

    python -m schnet_ipu.bench force_step [--config configs/emt_forces.yaml] [--set key=value]

The run's trainer on the same batches for every ``VARIANTS`` entry, interleaved. Measured
(``forces-step-cpu``, one thread): forces with the table over exact 0.66-0.71 on the EMT
clusters (K = 128), 0.436 on the xTB molecules."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import torch

from schnet_ipu.backends.distributed import ReplicaInfo
from schnet_ipu.bench import common
from schnet_ipu.components import make_trainer
from schnet_ipu.config import load_config
from schnet_ipu.pipeline import make_loader, prepare_data

DEFAULT_CONFIG = common.ROOT / "configs/emt_forces.yaml"
# name -> (forces_weight, op flavour, model.filter, backend.compile); force steps are not
# compiled (AOTAutograd refuses a double backward)
VARIANTS = {
    "energy": (0.0, "torch", "exact", False),
    "forces": (1.0, "torch", "exact", False),
    "forces_plain_ops": (1.0, "ipu", "exact", False),
    "energy_table": (0.0, "torch", "table", False),
    "forces_table": (1.0, "torch", "table", False),
    "energy_table_compiled": (0.0, "torch", "table", True),
}
COLUMNS = ["name", "step_ms", "ratio_to_energy"]
PLOT = ("name", "step_ms", "ms per training step")
QUICK = {"rounds": 3, "steps": 3}


def run(
    config: str | Path = DEFAULT_CONFIG, overrides: list[str] = (), rounds: int = 5, steps: int = 5
) -> dict:
    """Every variant on ``config``'s first ``steps`` host calls, ``rounds`` rounds."""
    cfg = load_config(config, [*overrides, "loader.workers=0"])
    if cfg.backend.threads:
        torch.set_num_threads(cfg.backend.threads)
    data = prepare_data(cfg)
    calls = make_loader(cfg, data, "train").epoch(0)
    batches = [next(calls) for _ in range(steps)]
    timer_steps = {}
    for name, (weight, ops, filter_, compiled) in VARIANTS.items():
        variant = dataclasses.replace(
            cfg, optim=dataclasses.replace(cfg.optim, forces_weight=weight),
            model=dataclasses.replace(cfg.model, ops=ops, filter=filter_),
            backend=dataclasses.replace(cfg.backend, compile=compiled))  # fmt: skip
        backend = make_trainer(variant, data, ReplicaInfo(), "cpu")[2]
        calls = itertools.cycle(batches)
        timer_steps[name] = lambda b=backend, calls=calls: len(b.train_call(next(calls)))
    timing = common.Timing(warmup=1, steps=steps, repeats=rounds)
    rates = common.measure_side_by_side(timer_steps, timing)
    median = {name: 1000 * rate.step_seconds for name, rate in rates.items()}
    to_energy = {name: median[name] / median["energy"] for name in VARIANTS}
    table_speedup = {kind: median[kind] / median[f"{kind}_table"] for kind in ("energy", "forces")}
    rows = [{"name": n, "step_ms": median[n], "ratio_to_energy": to_energy[n]} for n in VARIANTS]
    ratios = {f"table_speedup_{kind}": value for kind, value in table_speedup.items()}
    notes = [
        f"{config} {' '.join(overrides)}; {torch.get_num_threads()} torch thread(s); the "
        f"first {steps} host calls of the training loader, a warm-up call, then {rounds} "
        "rounds of every variant in turn; medians.",
    ]
    return common.new_report(  # and the keys of docs/benchmarks/forces-step-cpu.json
        "force_step", rows, ratios, notes, threads=torch.get_num_threads(), step_ms=median,
        ratio_to_energy=to_energy, table_speedup=table_speedup,
        atoms_per_batch=int(batches[0][0].node_mask.sum()), config=str(config),
        forces_table_over_exact=median["forces_table"] / median["forces"],
    )  # fmt: skip
