"""Accuracy with partial labels: bulk cells with stress and slabs without, trained together.

    python scripts/partial_labels_accuracy.py --out runs/partial_labels [--frames 1200]

Makes EMT fcc alloy frames (``scripts/make_emt_bulk.py``: bulk and vacancy cells with
stress, slabs with ``--no-slab-stress``: energies and forces only), then trains two models
side by side (two processes of ``train.py`` on ``configs/emt_bulk.yaml``, one thread each):

* mixed: every frame, energy + force + stress loss (``optim.stress_weight=1``): the stress
  term counts the bulk frames only;
* slabs alone: the same slab frames, energy + force loss, for ``--slab-epochs`` (by default
  3x the epochs: about the same optimiser steps on a third of the frames).

Then both models are scored on held-out frames made with another seed: stress MAE of the
mixed model on held-out bulk cells against the training bulk frames' mean stress (the
target: at most 0.4x), and energy per atom and force MAE of both models on held-out slabs
(the target: the mixed model as good as the slab model). Prints a table and writes it, with
the runs' own final test records, to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ase.io
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_emt_bulk  # noqa: E402

from schnet_ipu.training.log import read_records  # noqa: E402


def is_slab(atoms) -> bool:
    return not atoms.pbc[2]


def train_runs(runs: dict[str, list[str]], out: Path) -> None:
    """Train each run (name -> config overrides) in its own process, all at once."""
    processes = {}
    for name, overrides in runs.items():
        command = [
            sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/emt_bulk.yaml"),
            "--fresh", "logging.progress=false", "logging.plot=false",
            f"logging.run_dir={out / name}", *overrides,
        ]  # fmt: skip
        log = (out / f"{name}.log").open("w")
        processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    for name, process in processes.items():
        if process.wait() != 0:
            raise SystemExit(f"training {name} failed; see {out / name}.log")


def held_out_errors(run: Path, frames: list) -> dict[str, float]:
    """MAEs of a trained model on labelled frames: energy per atom, force component and,
    where the frames carry it, stress component."""
    import torch

    from schnet_ipu.inference.calculator import SchNetCalculator

    calc = SchNetCalculator(run, dtype=torch.float32)
    energy, forces, stress = [], [], []
    for atoms in frames:
        truth = atoms.calc.results
        atoms = atoms.copy()
        atoms.calc = calc
        energy.append(abs(atoms.get_potential_energy() - truth["energy"]) / len(atoms))
        forces.append(np.abs(atoms.get_forces() - truth["forces"]).ravel())
        if "stress" in truth:
            stress.append(np.abs(atoms.get_stress() - truth["stress"]))
    errors = {
        "energy_mae_per_atom": float(np.mean(energy)),
        "force_mae": float(np.mean(np.concatenate(forces))),
    }
    if stress:
        errors["stress_mae"] = float(np.mean(np.concatenate(stress)))
    return errors


def row(label: str, value: float, reference: float) -> str:
    return f"{label:40s} {value:10.5f} {reference:12.5f} {value / reference:7.3f}"


def table(result: dict) -> str:
    """The masked-label accuracy table of a result."""
    final, bulk = result["mixed_final"], result["mixed_on_held_out_bulk"]
    slabs, alone = result["mixed_on_held_out_slabs"], result["slabs_alone_on_held_out_slabs"]
    lines = [
        f"{'mixed model, bulk stress (eV/A^3)':40s} {'model':>10s} {'mean stress':>12s} ratio",
        row("held-out bulk cells", bulk["stress_mae"], result["baseline_held_out_stress_mae"]),
        row("the run's test split", final["test_stress_mae"], final["baseline_stress_mae"]),
        f"  (test frames with stress: {final['test_stress_frames']} of "
        f"{final['test_molecules']}; with forces: {final['test_force_frames']})",
        f"{'held-out slabs':40s} {'mixed':>10s} {'slabs alone':>12s} ratio",
        row("energy MAE (eV/atom)", slabs["energy_mae_per_atom"], alone["energy_mae_per_atom"]),
        row("force MAE (eV/A)", slabs["force_mae"], alone["force_mae"]),
        f"both runs at once: {result['train_seconds_both_at_once']:.0f} s, load average "
        "{:.2f} -> {:.2f}".format(*result["load_average_before_after"]),
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs/partial_labels")
    parser.add_argument("--frames", type=int, default=1200, help="training file frames")
    parser.add_argument("--held-out", type=int, default=150, help="held-out frames")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--slab-epochs", type=int, help="default: 3x --epochs")
    parser.add_argument("--json", type=Path, default=ROOT / "docs/benchmarks/partial-labels.json")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    frames = make_emt_bulk.make_frames(args.frames, 0.03, 0.05, seed=0, slab_stress=False)
    held_out = make_emt_bulk.make_frames(args.held_out, 0.03, 0.05, seed=1)
    mixed, slabs = out / "mixed.extxyz", out / "slabs.extxyz"
    ase.io.write(mixed, frames, format="extxyz")
    ase.io.write(slabs, [f for f in frames if is_slab(f)], format="extxyz")
    load_before = os.getloadavg()
    start = time.perf_counter()
    train_runs(
        {
            "mixed": [f"data.files=[{mixed}]", f"data.path={out / 'mixed.h5'}",
                      f"optim.epochs={args.epochs}", "optim.stress_weight=1.0"],
            "slabs": [f"data.files=[{slabs}]", f"data.path={out / 'slabs.h5'}",
                      f"optim.epochs={args.slab_epochs or 3 * args.epochs}"],
        },
        out,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    bulk_held = [f for f in held_out if not is_slab(f)]
    slab_held = [f for f in held_out if is_slab(f)]
    train_bulk = [f for f in frames if "stress" in f.calc.results]
    mean_stress = np.mean([f.calc.results["stress"] for f in train_bulk], axis=0)
    baseline = float(np.mean([np.abs(f.calc.results["stress"] - mean_stress) for f in bulk_held]))
    result = {
        "frames": {
            "bulk_with_stress": len(train_bulk),
            "slabs_without": len(frames) - len(train_bulk),
        },
        "held_out": {"bulk": len(bulk_held), "slabs": len(slab_held)},
        "mixed_on_held_out_bulk": held_out_errors(out / "mixed", bulk_held),
        "baseline_held_out_stress_mae": baseline,
        "mixed_on_held_out_slabs": held_out_errors(out / "mixed", slab_held),
        "slabs_alone_on_held_out_slabs": held_out_errors(out / "slabs", slab_held),
        "mixed_final": read_records(out / "mixed/metrics.jsonl", "final")[-1],
        "slabs_final": read_records(out / "slabs/metrics.jsonl", "final")[-1],
        "train_seconds_both_at_once": seconds,
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "epochs": {"mixed": args.epochs, "slabs": args.slab_epochs or 3 * args.epochs},
    }
    print(table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
