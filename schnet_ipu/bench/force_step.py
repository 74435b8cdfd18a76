"""Step time of force training against energy-only training, side by side: every
``VARIANTS`` entry's trainer on the same batches, interleaved (on CUDA inside its CUDA graph;
``--device cuda`` adds the Triton flavour's variants, ``--variant NAME`` times that one beside
``energy``). The committed reports: docs/benchmarks/force_step/; their figures:
docs/benchmarks/README.md."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator
from pathlib import Path

import torch

from schnet_ipu.backends.distributed import ReplicaInfo
from schnet_ipu.bench import common
from schnet_ipu.config import load_config
from schnet_ipu.errors import UserError
from schnet_ipu.training.data import make_loader, prepare_data
from schnet_ipu.training.setup import make_trainer

# name -> (forces_weight, op flavour, model.filter, backend.compile); force steps are not
# compiled (AOTAutograd refuses a double backward)
VARIANTS = {
    "energy": (0.0, "torch", "exact", False),
    "forces": (1.0, "torch", "exact", False),
    "forces_plain_ops": (1.0, "ipu", "exact", False),
    "energy_table": (0.0, "torch", "table", False),
    "forces_table": (1.0, "torch", "table", False),
    "energy_table_compiled": (0.0, "torch", "table", True),
    "energy_fused": (0.0, "triton", "exact", False),
    "forces_fused": (1.0, "triton", "exact", False),
    "energy_table_fused": (0.0, "triton", "table", False),
    "forces_table_fused": (1.0, "triton", "table", False),
}
CUDA_ONLY = tuple(name for name, (_, ops, _, _) in VARIANTS.items() if ops == "triton")
COLUMNS = ["name", "step_ms", "ratio_to_energy"]
PLOT = ("name", "step_ms", "ms per training step")
QUICK = {"rounds": 3, "steps": 3}


def run(
    config: str | Path = common.FORCE_CONFIG, overrides: list[str] = (), rounds: int = 5,
    steps: int = 5, device: str = "cpu", variants: list[str] | None = None,
) -> dict:  # fmt: skip
    """Every variant (``variants``: those and ``energy``; Triton's on CUDA only), interleaved."""
    unknown = ", ".join(sorted(set(variants or ()) - set(VARIANTS)))
    if unknown:
        raise UserError(f"bench force_step: no variant {unknown} (one of {', '.join(VARIANTS)})")
    cuda = device.startswith("cuda")
    cfg = load_config(config, [*overrides, "loader.workers=0", f"backend.device={device}"])
    if cfg.backend.threads:
        torch.set_num_threads(cfg.backend.threads)
    data = prepare_data(cfg)
    calls = make_loader(cfg, data, "train", pin_memory=cuda, device=device).epoch(0)
    batches = [next(calls) for _ in range(steps)]
    chosen = {"energy", *variants} if variants else set(VARIANTS)
    names = [name for name in VARIANTS if name in chosen and (cuda or name not in CUDA_ONLY)]
    timer_steps = {}
    for name in names:
        weight, ops, filter_, compiled = VARIANTS[name]
        variant = dataclasses.replace(
            cfg, optim=dataclasses.replace(cfg.optim, forces_weight=weight),
            model=dataclasses.replace(cfg.model, ops=ops, filter=filter_),
            backend=dataclasses.replace(cfg.backend, compile=compiled))  # fmt: skip
        backend = make_trainer(variant, data, ReplicaInfo(), device)[2]
        timer_steps[name] = functools.partial(timed_call, backend, itertools.cycle(batches), cuda)
    rates = common.measure_side_by_side(timer_steps, common.Timing(1, steps, rounds))
    median = {name: 1000 * rate.step_seconds for name, rate in rates.items()}
    to_energy = {name: median[name] / median["energy"] for name in names}

    def over(a: str, b: str) -> float | None:  # step time of a over b, where both ran
        return median[a] / median[b] if {a, b} <= set(names) else None

    table_speedup = {kind: over(kind, f"{kind}_table") for kind in ("energy", "forces")}
    rows = [{"name": n, "step_ms": median[n], "ratio_to_energy": to_energy[n]} for n in names]
    ratios = {f"table_speedup_{kind}": value for kind, value in table_speedup.items()}
    if cuda:
        ratios.update({f"fused_speedup_{n}": over(n, f"{n}_fused")
                       for n in ("energy", "forces", "energy_table", "forces_table")})  # fmt: skip
    where = torch.cuda.get_device_name(device) if cuda else f"{torch.get_num_threads()} thread(s)"
    notes = [
        f"{config} {' '.join(overrides)} on {device} ({where}); the first {steps} host calls "
        f"of the training loader, a warm-up call, then {rounds} rounds of every variant in "
        "turn; medians." + ("" if cuda else f" Skipped (CUDA only): {', '.join(CUDA_ONLY)}."),
    ]
    return common.new_report(  # and the keys of docs/benchmarks/force_step/cpu/force_step.json
        "force_step", rows, ratios, notes, threads=torch.get_num_threads(), step_ms=median,
        ratio_to_energy=to_energy, table_speedup=table_speedup,
        atoms_per_batch=int(batches[0][0].node_mask.sum()), config=str(config),
        forces_table_over_exact=over("forces_table", "forces"),
    )  # fmt: skip


def timed_call(backend, batches: Iterator, cuda: bool) -> int:
    """One host call of ``backend`` on the next batch; on CUDA, waits for the GPU."""
    steps = len(backend.train_call(next(batches)))
    if cuda:
        torch.cuda.synchronize()
    return steps
