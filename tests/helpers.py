"""What several test modules share: a tiny store, a smoke run's overrides, training in a
subprocess, reading a run folder's records, an epoch's batches, and batches of molecules held
in memory (random QM9 molecules, packs from the packing library, the reference collate).

    store = random_store(tmp_path / "store.h5", molecules=96, seed=5)
    overrides = smoke_overrides(store, tmp_path / "run", "optim.epochs=3")
    result = run_train(*overrides)  # train.py in a subprocess
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from schnet_ipu.batch import Batch
from schnet_ipu.data import import_qm9, write_store
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.feed.collate import PackMolecule, collate
from schnet_ipu.feed.layout import Layout
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.packing import assign_packs, plan_packing
from schnet_ipu.training import loop as training

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = [sys.executable, str(ROOT / "train.py")]


class Killed(BaseException):
    """A simulated kill: nothing in the program catches it."""


def load_script(relative: str) -> ModuleType:
    """A repository script that is not a package module (``train.py``,
    ``scripts/make_emt_bulk.py``), imported by its path under the repository root."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_store(path: Path, molecules: int, seed: int) -> Path:
    """A store of ``molecules`` random chains of 3-7 atoms (H, C, N, O; steps of ~1.2 A)
    whose U0 (eV) is -10 eV per atom plus noise: learnable from composition."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(3, 8, size=molecules)
    z = [rng.choice([1, 6, 7, 8], size=n) for n in sizes]
    pos = [np.cumsum(rng.normal(0, 0.7, size=(n, 3)), axis=0) for n in sizes]
    energy = -10.0 * sizes + rng.normal(0, 0.1, size=len(sizes))
    return write_store(path, z, pos, {"U0": energy}, {"U0": "eV"})


def qm9_rows(folder: Path, limit: int) -> Path:
    """A store of the first ``limit`` real QM9 molecules (from the qm9pack package)."""
    return import_qm9(folder / f"qm9_{limit}.h5", limit=limit, progress=False)


def tiny_model(width: int) -> list[str]:
    """Overrides of a SchNet of one interaction, ``width`` features and filters wide."""
    return [
        f"model.hidden_channels={width}",
        f"model.num_filters={width}",
        "model.num_interactions=1",
        f"model.num_gaussians={width // 2}",
    ]


def smoke_overrides(store: Path, run_dir: Path, *extra: str, width: int = 8) -> list[str]:
    """Overrides of a smoke run on the CPU: the bare defaults (no recipe), 16 validation and 16
    test molecules, a SchNet of one interaction ``width`` wide, two packs a batch, a constant
    learning rate, one training thread (the module restores torch's count:
    ``restore_threads``), no progress bars, no plot, no baseline check (too short to learn).
    ``extra`` comes last, so it overrides any of these."""
    return [
        f"data.path={store}",
        "recipe=none",  # the bare defaults: smoke runs test the machinery, not a recipe
        "data.val=16",
        "data.test=16",
        *tiny_model(width),
        "packing.packs_per_batch=2",
        "optim.schedule=constant",
        "optim.beat_baseline=false",  # a smoke run, too short to learn
        "loader.workers=0",
        "backend.device=cpu",  # the CPU program also on a GPU machine (auto would pick CUDA)
        "backend.threads=1",
        "logging.progress=false",
        "logging.plot=false",
        f"logging.run_dir={run_dir}",
        *extra,
    ]


def qm9_smoke_overrides(store: Path, run_dir: Path, *extra: str) -> list[str]:
    """A smoke run (:func:`smoke_overrides`) on real QM9 rows: 60 validation and 60 test
    molecules, four packs a batch, 16 wide, every host call's loss read and recorded."""
    return smoke_overrides(
        store,
        run_dir,
        "data.val=60",
        "data.test=60",
        "packing.packs_per_batch=4",
        "logging.log_every=1",
        *extra,
        width=16,
    )


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with the repository importable (for a subprocess), plus ``extra``."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def run_train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``train.py ARGS`` in a subprocess from the repository root; its output captured."""
    return subprocess.run(
        [*TRAIN_PY, *args], cwd=ROOT, env=repo_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def wait_for(condition, procs: list[subprocess.Popen], what: str, timeout_s: float = 300) -> None:
    """Poll ``condition`` until it holds; fail if one of ``procs`` exits first or ``timeout_s``
    passes (the failure shows a process's stderr where it is a pipe)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                output = proc.stderr.read() if proc.stderr else "(stderr not piped)"
                raise AssertionError(f"exited ({proc.returncode}) before {what}: {output}")
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.02)


def in_epoch_one(run_dir: Path) -> bool:
    """last.pt exists and epoch 1 has logged a step but not its epoch record (a run with
    ``logging.log_every=1``, to be killed after its first checkpoint)."""
    if not (run_dir / "checkpoints/last.pt").exists():
        return False
    whole_lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    return any('"step"' in line and '"epoch": 1,' in line for line in whole_lines)


def whole_records(run_dir: Path) -> list[dict]:
    """Every line of ``run_dir/metrics.jsonl``, each a whole JSON record (no torn line)."""
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n"), "a torn last line"
    return [json.loads(line) for line in text.splitlines()]


def run_outcome(run_dir: Path) -> dict[str, list]:
    """What a finished run's log must hold exactly once, without the timings."""
    rows = whole_records(run_dir)
    return {
        "kinds": sorted(r["kind"] for r in rows),
        "steps": [(r["epoch"], r["call"], r["loss"]) for r in rows if r["kind"] == "step"],
        "epochs": [
            (r["epoch"], r["train_loss"], r["val_mae"], r["lr"])
            for r in rows
            if r["kind"] == "epoch"
        ],
        "final": [(r["test_mae"], r["best_val_mae"]) for r in rows if r["kind"] == "final"],
    }


def kill_after_first_checkpoint(monkeypatch) -> None:
    """The next run dies (:class:`Killed`) right after writing its first last.pt; the patch
    undoes itself then, so the run after it goes on."""
    save = training.save_checkpoint

    def killed_after_first(path, state):
        save(path, state)
        if path.name == "last.pt":
            monkeypatch.setattr(training, "save_checkpoint", save)
            raise Killed

    monkeypatch.setattr(training, "save_checkpoint", killed_after_first)


def epoch_batches(loader: PackedLoader, epoch: int) -> list[Batch]:
    return [b for call in loader.epoch(epoch) for b in call]


def assert_same_batches(xs, ys) -> None:
    """Equal fields, shapes, dtypes and values, batch by batch."""
    xs, ys = list(xs), list(ys)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.present_fields() == y.present_fields() and x.signature() == y.signature()
        for t, u in zip(x.as_tuple(), y.as_tuple(), strict=True):
            assert torch.equal(t, u)


Molecule = "tuple[np.ndarray, np.ndarray]"  # z [n] (int), pos [n, 3] (A); string: Python 3.8


def molecules_to_batch(
    molecules: Sequence[Molecule],
    packs: Sequence[Sequence[int]],
    max_nodes: int,
    max_graphs: int,
    max_edges: int | None = None,
    cutoff: float = 6.0,
    targets: Sequence[float] | None = None,
) -> Batch:
    """Collate ``packs`` (lists of indices into ``molecules``) with the loader's collate;
    radius edges (within ``cutoff``) when ``max_edges`` is given. For tests and benchmarks
    on molecules held in memory."""
    layout = Layout(
        len(packs), max_nodes, max_graphs, max_edges, None if max_edges is None else cutoff
    )
    chosen = [
        [
            PackMolecule(
                np.asarray(molecules[m][0]),
                np.asarray(molecules[m][1], dtype=np.float32),
                0.0 if targets is None else float(targets[m]),
                int(m),
            )
            for m in pack
        ]
        for pack in packs
    ]
    return collate(chosen, layout)


def pair_array(pos: np.ndarray, cutoff: float) -> np.ndarray:
    """Unordered pairs (i < j) of one molecule within ``cutoff`` -> int64 [P, 2]."""
    i, j = molecule_pairs(torch.as_tensor(np.asarray(pos, dtype=np.float32)), cutoff)
    return torch.stack([i, j], dim=1).numpy()


def plan_packs(
    sizes: Sequence[int],
    max_nodes: int,
    max_graphs: int,
    edges: Sequence[int] | None = None,
    max_edges: int = 0,
) -> list[np.ndarray]:
    """Packs of molecule indices from the packing library: LPFHP over atoms, or tuple
    packing over (atoms, directed ``edges``) when edges are given."""
    nodes = np.asarray(sizes)
    edge_counts = None if edges is None else np.asarray(edges)
    plan = plan_packing(
        nodes,
        edge_counts,
        algorithm="lpfhp" if edges is None else "tuple",
        max_nodes=max_nodes,
        max_edges=max_edges,
        max_graphs=max_graphs,
    )
    return assign_packs(plan, nodes, edge_counts, seed=0, epoch=0)


def load_molecules(store: str, count: int, seed: int) -> list[Molecule]:
    """``count`` distinct molecules drawn at random (``seed``) from a MoleculeStore."""
    from schnet_ipu.data import MoleculeStore

    molecules = MoleculeStore(store)
    chosen = np.random.default_rng(seed).choice(len(molecules), count, replace=False)
    return [molecules.molecule(int(i)) for i in np.sort(chosen)]
