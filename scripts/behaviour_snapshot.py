"""Prove that a change to the code's layout left its behaviour alone.

    python scripts/behaviour_snapshot.py make  OUT   # train, export, predict: OUT/snapshot.json
    python scripts/behaviour_snapshot.py check OUT   # the same again; compare with OUT's

``make`` trains two short runs through ``train.py`` alone (the QM9 quickstart at seed 0 on one
thread and one replica for two epochs, with the table filter and with the exact one), exports
each best checkpoint as TorchScript, and evaluates fixed structures (a QM9 molecule, a periodic
cell) through the ASE calculator, ``train.py predict --model`` and the exported files. ``check``
does all of that again in a fresh folder (the losses and ``best.pt`` must be bit-identical, less
the entries that differ between any two runs: the wall-clock ``budget_seconds``, the unseeded
state of Python's ``random`` and the run folder's path; and the config's ``recipe`` label,
which a resume does not compare either), and
also evaluates the checkpoints and exported files that ``make`` wrote with today's code (their
energies, forces and stress must be identical). It uses only the command line, the exported
files and ``schnet_ipu.calculator``, which every layout keeps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from ase import Atoms
from ase.io import read, write

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "table": [],
    "exact": ["model.filter=exact", "data.subset=4000"],
}
COMMON = [
    "seed=0",
    "backend.threads=1",
    "backend.replicas=1",
    "optim.epochs=2",
    "logging.log_every=5",
]


def structures() -> list[Atoms]:
    """A QM9-like molecule and a small periodic C/H/O cell (positions fixed by a seed)."""
    rng = np.random.default_rng(7)
    molecule = Atoms(
        "CH4O",
        positions=[
            [0, 0, 0],
            [1.09, 0, 0],
            [-0.36, 1.03, 0],
            [-0.36, -0.51, 0.89],
            [-0.5, -0.7, -1.2],
            [0.3, -0.9, -1.6],
        ],
    )
    cell = 6.0 * np.eye(3) + rng.normal(0, 0.2, (3, 3))
    crystal = Atoms("C4H4O2", positions=rng.uniform(0, 6, (10, 3)), cell=cell, pbc=True)
    return [molecule, crystal]


def train(folder: Path, name: str) -> Path:
    run = folder / f"run_{name}"
    command = [sys.executable, "train.py", "--config", "configs/qm9_quickstart.yaml", "--fresh",
               *COMMON, *RUNS[name], f"logging.run_dir={run}"]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True)
    return run


def losses(run: Path) -> list:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [[row.get("step"), row.get("loss")] for row in rows if "loss" in row]


def evaluate(checkpoint: Path, exported: Path, folder: Path) -> dict:
    """Energies, forces and stress of ``structures()`` by the calculator (float64 and float32),
    by ``train.py predict`` and by the exported file."""
    from schnet_ipu.calculator import SchNetCalculator

    out: dict = {}
    for dtype in (torch.float64, torch.float32):
        calc = SchNetCalculator(str(checkpoint), dtype=dtype)
        for index, atoms in enumerate(structures()):
            atoms = atoms.copy()
            atoms.calc = calc
            key = f"calculator_{dtype}_{index}"
            out[key] = {
                "energy": atoms.get_potential_energy(),
                "forces": atoms.get_forces().tolist(),
            }
            if atoms.pbc.any():
                out[key]["stress"] = atoms.get_stress().tolist()
    given, predicted = folder / "structures.extxyz", folder / "predicted.extxyz"
    write(given, structures())
    command = [
        "predict",
        "--model",
        str(checkpoint),
        "--input",
        str(given),
        "--out",
        str(predicted),
    ]
    subprocess.run([sys.executable, "train.py", *command], cwd=ROOT, check=True)
    for index, atoms in enumerate(read(predicted, ":")):
        results = atoms.calc.results  # extxyz's energy, forces and stress come back as results
        out[f"predict_{index}"] = {
            key: np.asarray(value).tolist() for key, value in results.items()
        }
    model = torch.jit.load(str(exported))
    for index, atoms in enumerate(structures()):
        z = torch.tensor(atoms.numbers)
        pos = torch.tensor(atoms.positions, dtype=torch.float32)
        if atoms.pbc.any():
            cell = torch.tensor(np.asarray(atoms.cell), dtype=torch.float32)
            energy, forces, stress = model(z, pos, cell, torch.tensor(atoms.pbc))
            result = {"stress": stress.tolist()}
        else:
            energy, forces = model(z, pos)
            result = {}
        out[f"exported_{index}"] = {"energy": float(energy), "forces": forces.tolist(), **result}
    return out


def checkpoint_digest(path: Path) -> dict:
    """Every entry of a checkpoint as text (tensors by their bytes), less those that differ
    between two runs of one command: wall time, Python's unseeded RNG, the run folder."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state.pop("budget_seconds", None)
    state.get("rng", {}).pop("python", None)
    state["config"]["logging"].pop("run_dir")
    state["config"].pop("recipe", None)  # names where unset keys came from (configs name it now)

    def plain(value):
        if isinstance(value, torch.Tensor):
            return [str(value.dtype), list(value.shape), value.numpy().tobytes().hex()]
        if isinstance(value, dict):
            return {str(key): plain(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)

    return plain(state)


def differences(before: dict, now: dict) -> list[str]:
    """The predictions that differ, each with its largest absolute difference."""
    found = []
    for key, values in before.items():
        for quantity, value in values.items():
            gap = np.abs(np.asarray(value) - np.asarray(now[key][quantity])).max()
            if gap > 0:
                found.append(f"{key} {quantity} (max |difference| {gap:.3g})")
    return found


def snapshot(folder: Path) -> dict:
    """Train, export and evaluate every run into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    result = {}
    for name in RUNS:
        run = train(folder, name)
        best = run / "checkpoints" / "best.pt"
        exported = folder / f"{name}.torchscript.pt"
        command = ["export", "--run", str(run), "--out", str(exported)]
        subprocess.run([sys.executable, "train.py", *command], cwd=ROOT, check=True)
        result[name] = {
            "losses": losses(run),
            "best_pt": checkpoint_digest(best),
            "predictions": evaluate(best, exported, folder),
        }
    return result


def main(argv: list[str]) -> int:
    mode, folder = argv[0], Path(argv[1]).resolve()
    if mode == "make":
        (folder / "snapshot.json").parent.mkdir(parents=True, exist_ok=True)
        (folder / "snapshot.json").write_text(json.dumps(snapshot(folder), indent=1))
        return 0
    before = json.loads((folder / "snapshot.json").read_text())
    now = snapshot(folder / "again")
    failures = []
    for name, runs in before.items():
        for key in ("losses", "best_pt"):
            same = runs[key] == now[name][key]
            print(f"{name} {key} (a fresh run now): {'identical' if same else 'DIFFERENT'}")
            failures += [] if same else [f"{name} {key}"]
        best = folder / f"run_{name}" / "checkpoints" / "best.pt"
        old_files = evaluate(best, folder / f"{name}.torchscript.pt", folder / "again")
        for what, predictions in (
            ("a fresh run's", now[name]["predictions"]),
            ("files written before,", old_files),
        ):
            gaps = differences(runs["predictions"], predictions)
            print(f"{name}: {what} predictions now: {'identical' if not gaps else 'DIFFERENT'}")
            print("".join(f"  {gap}\n" for gap in gaps), end="")
            failures += [f"{name} {what} predictions"] if gaps else []
    print("behaviour unchanged" if not failures else f"changed: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
