"""Bad input of every kind: one line ``error: <culprit>: ...``, exit code 2, no traceback,
nothing changed on disk (every file hashed before and after), no code run from a file.
Over 400 lines because the one-line errors a user can meet are checked here together,
through one hashing harness, in one place."""

from __future__ import annotations

import hashlib
import json
import os
import re
import runpy
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from schnet_ipu.data import MoleculeStore, edge_counts, load_or_make_split, write_store
from schnet_ipu.data.__main__ import main as data_cli
from schnet_ipu.data.splits import split_path
from schnet_ipu.errors import run_cli
from tests.helpers import load_script, smoke_overrides

ROOT = Path(__file__).resolve().parents[2]
MOLECULES, VAL, TEST = 96, 16, 16


train_cli = load_script("train.py")


# The runs here set backend.threads=1 (a tiny model steps ~4x faster on one thread of a busy
# machine); the fixture puts torch's thread count back for the other test modules.
pytestmark = pytest.mark.usefixtures("restore_threads")


def molecules(rng: np.random.Generator, count: int) -> tuple[list, list, np.ndarray]:
    """``count`` small molecules (3-7 atoms of H, C, N, O, about 1.2 A apart) and a target
    that depends on their composition."""
    z, pos = [], []
    for _ in range(count):
        n = int(rng.integers(3, 8))
        z.append(rng.choice([1, 6, 7, 8], size=n))
        pos.append(np.cumsum(rng.normal(0, 0.7, size=(n, 3)), axis=0))
    energy = np.array([-10.0 * len(m) + 0.1 * rng.normal() for m in z])
    return z, pos, energy


def make_store(path: Path, seed: int = 0) -> Path:
    z, pos, energy = molecules(np.random.default_rng(seed), MOLECULES)
    ids = np.arange(MOLECULES) + 1000  # record ids differ from store indices
    return write_store(path, z, pos, {"U0": energy}, {"U0": "eV"}, ids=ids, origin="fixture")


def config(store: Path, run_dir: Path, *extra: str) -> list[str]:
    return smoke_overrides(
        store,
        run_dir,
        f"data.val={VAL}",
        f"data.test={TEST}",
        "optim.epochs=2",
        "logging.log_every=2",
        *extra,
    )


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root``."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def one_error_line(stderr: str, *culprits: str) -> str:
    """The single ``error:`` line of ``stderr`` (no traceback), naming every culprit."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr
    for culprit in culprits:
        assert culprit in lines[0], (culprit, lines[0])
    return lines[0]


def refused(capsys, tmp_path: Path, call, *culprits: str) -> str:
    """Run ``call`` (a CLI main returning an exit code): exit 2, one line naming the
    culprits, and no file under ``tmp_path`` created, changed or removed."""
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert call() == 2
    line = one_error_line(capsys.readouterr().err, *culprits)
    assert snapshot(tmp_path) == before
    return line


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A good store and a finished run on it (read-only for the tests)."""
    root = tmp_path_factory.mktemp("trained")
    store = make_store(root / "good.h5")
    run_dir = root / "run"
    assert train_cli.main(config(store, run_dir)) == 0
    return store, run_dir


@pytest.fixture
def store(tmp_path) -> Path:
    """A good store of its own, with its split and edge counts already saved beside it."""
    path = make_store(tmp_path / "store.h5")
    load_or_make_split(path, MOLECULES, VAL, TEST, seed=0)
    edge_counts(path, cutoff=6.0)
    return path


# --- config values -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "culprit"),
    [
        ("optim.lr=.nan", "optim.lr"),
        ("optim.lr=.inf", "optim.lr"),
        ("model.cutoff=.nan", "model.cutoff"),
        ("data.val=-.inf", "data.val"),
        ("optim.lrr=1", "optim.lr"),
        ("model.cutoff=-1", "model.cutoff"),
    ],
)
def test_bad_config_value(capsys, tmp_path, store, override, culprit):
    run_dir = tmp_path / "run"
    refused(capsys, tmp_path, lambda: train_cli.main(config(store, run_dir, override)), culprit)


def test_missing_config_file(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"
    refused(capsys, tmp_path, lambda: train_cli.main(["--config", str(missing)]), str(missing))


# --- store contents ------------------------------------------------------------------------


def damage(path: Path, dataset: str, index, value) -> None:
    with h5py.File(path, "r+") as f:
        data = f[dataset][:]
        data[index] = value
        f[dataset][...] = data


@pytest.mark.parametrize(
    ("dataset", "index", "value", "problem"),
    [
        ("pos", (5, 1), np.nan, "non-finite (NaN/inf) coordinates"),
        ("pos", (5, 0), np.inf, "non-finite (NaN/inf) coordinates"),
        ("z", 5, 0, "unknown element (atomic number 0"),
        ("z", 5, 200, "unknown element (atomic number 200"),
        ("targets/U0", 7, np.nan, "non-finite target 'U0'"),
    ],
)
def test_bad_store_record(capsys, tmp_path, store, dataset, index, value, problem):
    """A store damaged after import: the run stops before training, naming the file, the
    store index and the record id."""
    damage(store, dataset, index, value)
    atom = index[0] if isinstance(index, tuple) else index
    offsets = MoleculeStore(store).offsets
    molecule = (
        index if dataset.startswith("targets") else int(np.searchsorted(offsets, atom, "right") - 1)
    )
    run_dir = tmp_path / "run"
    line = refused(
        capsys,
        tmp_path,
        lambda: train_cli.main(config(store, run_dir)),
        str(store),
        f"molecule {molecule} (record {1000 + molecule})",
        problem,
    )
    assert not run_dir.exists(), line


def test_store_with_inconsistent_offsets(capsys, tmp_path, store):
    with h5py.File(store, "r") as f:
        offsets = f["offsets"][:]
    offsets[3] = offsets[2]  # molecule 2 loses its atoms to molecule 3
    damage(store, "offsets", slice(None), offsets)
    refused(
        capsys,
        tmp_path,
        lambda: train_cli.main(config(store, tmp_path / "run")),
        str(store),
        "molecule 2 (record 1002)",
    )


@pytest.mark.parametrize("content", [b"", b"not hdf5 at all", None])
def test_unusable_store_file(capsys, tmp_path, content):
    path = tmp_path / "broken.h5"
    if content is None:
        path.mkdir()  # a folder where the store should be
    else:
        path.write_bytes(content)
    refused(capsys, tmp_path, lambda: train_cli.main(config(path, tmp_path / "run")), str(path))


def test_stats_refuses_a_bad_cutoff_and_a_damaged_store(capsys, tmp_path, store):
    with pytest.raises(SystemExit) as exit_:
        data_cli(["stats", str(store), "--cutoff", "-1"])
    assert exit_.value.code == 2 and "--cutoff" in capsys.readouterr().err
    damage(store, "offsets", 1, 0)  # molecule 0 loses its atoms
    refused(capsys, tmp_path, lambda: data_cli(["stats", str(store)]), str(store), "record 1000")


def test_ctrl_c_outside_a_run_is_one_line_and_exit_130(capsys) -> None:
    def body() -> None:
        raise KeyboardInterrupt

    assert run_cli(body) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C)\n"


def test_import_refuses_or_skips_invalid_records(capsys, tmp_path):
    """write_store refuses a source with bad records, naming them; with skip_invalid it
    drops them and lists their ids."""
    z, pos, energy = molecules(np.random.default_rng(1), 12)
    z[3][0] = 0
    pos[5][1, 2] = np.nan
    energy[8] = np.inf
    ids = np.arange(12) + 50
    out = tmp_path / "imported.h5"

    def write(**kwargs):
        return run_cli(
            lambda: write_store(out, z, pos, {"y": energy}, {"y": "eV"}, ids=ids, **kwargs)
        )

    line = refused(capsys, tmp_path, write, "record 53 (molecule 3)", "3 bad record(s)")
    assert "--skip-invalid" in line
    assert write(skip_invalid=True) == 0
    kept = MoleculeStore(out)
    assert len(kept) == 9 and 53 not in kept.ids and 55 not in kept.ids and 58 not in kept.ids
    assert list(kept.attrs["skipped_records"]) == [53, 55, 58]
    np.testing.assert_array_equal(kept.target("y"), np.delete(energy, [3, 5, 8]))
    np.testing.assert_array_equal(kept.molecule(3)[0], z[4])  # the next good molecule


# --- split files ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda s: s["train"].append(MOLECULES + 5), f"index {MOLECULES + 5}, outside"),
        (lambda s: s["val"].__setitem__(0, -1), "index -1, outside"),
        (lambda s: s["train"].append(s["train"][0]), "twice"),
        (lambda s: s["test"].append(s["train"][0]), "in both the train and test parts"),
        (lambda s: s["val"].__setitem__(0, 1.5), "not a list of integer indices"),
    ],
)
def test_damaged_split_file(capsys, tmp_path, store, change, problem):
    path = split_path(store, MOLECULES, VAL, TEST, 0, 0)
    saved = json.loads(path.read_text())
    change(saved)
    path.write_text(json.dumps(saved))
    refused(
        capsys,
        tmp_path,
        lambda: train_cli.main(config(store, tmp_path / "run")),
        str(path),
        problem,
    )


# --- checkpoints and run directories -------------------------------------------------------


class RunsCode:
    """Unpickling this calls os.system, which creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def copy_run(run_dir: Path, to: Path) -> Path:
    for path in run_dir.rglob("*"):
        if path.is_file():
            target = to / path.relative_to(run_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    return to


@pytest.mark.parametrize("command", ["evaluate", "predict", "train"])
def test_checkpoint_that_would_run_code(capsys, tmp_path, trained, command):
    store, good_run = trained
    run_dir = copy_run(good_run, tmp_path / "run")
    marker = tmp_path / "pwned"
    name = "last.pt" if command == "train" else "best.pt"
    state = torch.load(good_run / "checkpoints" / name, weights_only=True)
    state["model"]["extra"] = RunsCode(marker)
    torch.save(state, run_dir / "checkpoints" / name)
    argv = (
        config(store, run_dir, "optim.epochs=3")
        if command == "train"
        else [command, "--run", str(run_dir)]
    )
    line = refused(capsys, tmp_path, lambda: train_cli.main(argv), str(run_dir / "checkpoints"))
    assert "could run code" in line and "weights_only=False" not in line
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ({"model": {}}, "not a checkpoint of this program"),
        ([1, 2, 3], "not a checkpoint of this program"),
        (b"garbage", "unreadable checkpoint"),
    ],
)
def test_foreign_checkpoint(capsys, tmp_path, trained, content, problem):
    _, good_run = trained
    run_dir = copy_run(good_run, tmp_path / "run")
    path = run_dir / "checkpoints/best.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    refused(capsys, tmp_path, lambda: train_cli.main(["evaluate", "--run", str(run_dir)]), problem)


def test_checkpoint_that_does_not_fit_the_model(capsys, tmp_path, trained):
    store, good_run = trained
    run_dir = copy_run(good_run, tmp_path / "run")
    for name in ("best.pt", "last.pt"):
        state = torch.load(good_run / "checkpoints" / name, weights_only=True)
        key = next(iter(state["model"]))
        state["model"][key] = torch.zeros(3, 3, 3)
        torch.save(state, run_dir / "checkpoints" / name)
    for argv in (["evaluate", "--run", str(run_dir)], config(store, run_dir, "optim.epochs=3")):
        run = lambda argv=argv: train_cli.main(argv)  # noqa: E731
        refused(capsys, tmp_path, run, str(run_dir / "checkpoints"), "does not fit")


def test_os_errors_are_one_line(capsys, tmp_path, trained, store):
    _, good_run = trained
    run_file = tmp_path / "run_is_a_file"
    run_file.write_text("")
    refused(capsys, tmp_path, lambda: train_cli.main(config(store, run_file)), str(run_file))
    out = tmp_path / "missing_folder/predictions.csv"
    run_dir = copy_run(good_run, tmp_path / "run")
    argv = ["predict", "--run", str(run_dir), "--out", str(out)]
    refused(capsys, tmp_path, lambda: train_cli.main(argv), str(out))
    missing = tmp_path / "no_run"
    refused(capsys, tmp_path, lambda: train_cli.main(["evaluate", "--run", str(missing)]), "no_run")


def test_damaged_metrics_line_is_named(capsys, tmp_path, trained):
    store, good_run = trained
    run_dir = copy_run(good_run, tmp_path / "run")
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    lines[1] = "{not json\n"
    metrics.write_text("".join(lines))
    argv = config(store, run_dir, "optim.epochs=3")
    refused(capsys, tmp_path, lambda: train_cli.main(argv), f"{metrics}: line 2")


def test_non_finite_loss_is_one_line(capsys, tmp_path, store):
    stop_at_once = "optim.spike_rollbacks=0"  # the divergence guard stops at the first spike
    argv = config(store, tmp_path / "run", "optim.lr=1e12", "optim.grad_clip=0", stop_at_once)
    capsys.readouterr()
    assert train_cli.main(argv) == 2
    one_error_line(capsys.readouterr().err, "loss diverged at step", "(inf >", "optim.lr")
    assert not (tmp_path / "run/checkpoints/last.pt").exists()


@pytest.mark.slow  # spawns two replica processes (~25 s on 2 busy cores)
def test_an_error_in_a_replica_is_one_line_in_the_parent(capsys, tmp_path, store):
    path = split_path(store, MOLECULES, VAL, TEST, 0, 0)
    saved = json.loads(path.read_text())
    saved["test"].append(saved["train"][0])
    path.write_text(json.dumps(saved))
    argv = config(store, tmp_path / "run", "backend.replicas=2", "backend.device=cpu")
    refused(capsys, tmp_path, lambda: train_cli.main(argv), str(path), "in both")


# --- the __main__ of every command, as a user runs it ----------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["train.py", "--config", "{bad}"],
        ["schnet_ipu.data", "stats", "{bad}"],
        ["schnet_ipu.packing", "report", "{bad}"],
        ["schnet_ipu.bench", "loader", "--quick", "--store", "{bad}"],
    ],
)
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_commands_print_one_line(capsys, monkeypatch, tmp_path, command):
    """Each command's own ``__main__`` (run in this process, as ``python -m`` would) on a
    file that is no store, or no YAML mapping: exit 2 and one line, nothing written."""
    bad = tmp_path / "broken.h5"
    bad.write_bytes(b"not hdf5\n")
    target, *args = [part.replace("{bad}", str(bad)) for part in command]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [target, *args])
    with pytest.raises(SystemExit) as exit_:
        if target.endswith(".py"):
            runpy.run_path(str(ROOT / target), run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    assert exit_.value.code == 2
    one_error_line(capsys.readouterr().err, str(bad))
    assert list(tmp_path.iterdir()) == [bad]


def test_fresh_keeps_the_old_run_when_the_data_is_bad(capsys, tmp_path, trained):
    """--fresh discards the old run only once the new run's data has been checked."""
    _, good_run = trained
    run_dir = copy_run(good_run, tmp_path / "run")
    broken = tmp_path / "broken.h5"
    broken.write_bytes(b"not hdf5")
    argv = ["--fresh", *config(broken, run_dir)]
    refused(capsys, tmp_path, lambda: train_cli.main(argv), str(broken))
    assert (run_dir / "checkpoints/last.pt").exists()


def test_oversized_molecule_is_named_by_store_index_and_record(capsys, tmp_path, store):
    """Packing limits below a molecule: the error names it as the store knows it (index and
    record id), not by its position in the split."""
    run = lambda: train_cli.main(config(store, tmp_path / "run", "packing.max_nodes=4"))  # noqa: E731
    line = refused(capsys, tmp_path, run, str(store), "packing.max_nodes=4")
    index, record = (int(n) for n in re.search(r"molecule (\d+) \(record (\d+)\)", line).groups())
    assert record == 1000 + index and MoleculeStore(store).num_atoms[index] > 4


# --- ASE import and the streaming writer (data.source=ase, import hydronet) ----------------


def emt_frames(count: int = 5) -> list:
    """``count`` Cu clusters of 3-6 atoms labelled by ASE's EMT, energy and forces stored as
    ``info`` / ``arrays`` (so each frame can be damaged on its own)."""
    from ase import Atoms
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(2)
    frames = []
    for i in range(count):
        n = 3 + i % 4
        atoms = Atoms(
            f"Cu{n}", positions=2.5 * np.eye(3)[np.arange(n) % 3] * (1 + np.arange(n))[:, None]
        )
        atoms.positions += rng.normal(0, 0.05, (n, 3))
        atoms.calc = EMT()
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = None
        atoms.info["energy"] = energy
        atoms.arrays["forces"] = forces
        frames.append(atoms)
    return frames


def write_extxyz(path: Path, frames: list, edit=None) -> Path:
    """Write ``frames`` as extxyz; ``edit(lines, first_line_of_frame)`` may change the text."""
    import ase.io

    ase.io.write(path, frames, format="extxyz")
    if edit is not None:
        lines = path.read_text().splitlines(keepends=True)
        starts = np.cumsum([0] + [len(f) + 2 for f in frames])
        edit(lines, [int(s) for s in starts])
        path.write_text("".join(lines))
    return path


def damaged_frame(change) -> list:
    frames = emt_frames()
    change(frames[2])
    return frames


def frame2_text(pattern: str, new: str):
    """An edit of frame 2's header or first atom line: the first match of ``pattern``."""

    def edit(lines: list, starts: list) -> None:
        for row in (starts[2] + 1, starts[2] + 2):
            if re.search(pattern, lines[row]):
                lines[row] = re.sub(pattern, new, lines[row], count=1)
                return
        raise AssertionError(f"{pattern!r} not in frame 2")

    return edit


def wrong_force_shape(atoms) -> None:
    del atoms.arrays["forces"]
    atoms.arrays["forces"] = np.ones((len(atoms), 2))


def with_forces(value: float):
    def change(atoms) -> None:
        atoms.arrays["forces"][1, 0] = value

    return change


ASE_CASES = {
    # name: (frames, text edit, energy_key, what the line must say besides file and frame)
    "missing energy": (damaged_frame(lambda a: a.info.pop("energy")), None, "no energy 'energy'"),
    "forces of the wrong shape": (damaged_frame(wrong_force_shape), None, "shape [5, 2], expected"),
    "NaN forces": (damaged_frame(with_forces(np.nan)), None, "forces 'forces' on atom 1"),
    "inf forces": (damaged_frame(with_forces(np.inf)), None, "forces 'forces' on atom 1"),
    "non-numeric energy": (emt_frames(), frame2_text(r"energy=\S+", "energy=abc"), "not a number"),
    "unknown element": (emt_frames(), frame2_text(r"^Cu ", "Qq "), "unknown element 'Qq'"),
}  # fmt: skip


def ase_command(files: list[Path], out: Path, run_dir: Path, energy_key: str = "energy") -> list:
    return [
        "data.source=ase",
        f"data.files=[{', '.join(str(f) for f in files)}]",
        f"data.path={out}",
        "data.target=energy",
        f"data.energy_key={energy_key}",
        "backend.device=cpu",
        f"logging.run_dir={run_dir}",
    ]


@pytest.mark.parametrize("case", list(ASE_CASES))
def test_bad_ase_frame(capsys, tmp_path, case):
    """One ``error:`` line naming the file and frame 2, exit 2, no store, no run folder."""
    frames, edit, problem = ASE_CASES[case]
    path = write_extxyz(tmp_path / "frames.extxyz", frames, edit)
    out = tmp_path / "store.h5"
    argv = ase_command([path], out, tmp_path / "run")
    line = refused(capsys, tmp_path, lambda: train_cli.main(argv), f"{path}, frame 2", problem)
    assert not out.exists() and not (tmp_path / "run").exists(), line


def test_empty_ase_file(capsys, tmp_path):
    empty = tmp_path / "empty.extxyz"
    empty.write_text("")
    argv = ase_command([empty], tmp_path / "store.h5", tmp_path / "run")
    refused(capsys, tmp_path, lambda: train_cli.main(argv), str(empty), "empty file")


def test_truncated_gzip_names_the_frame_it_ends_in(capsys, tmp_path):
    import gzip
    import zlib

    frames = emt_frames(200)
    whole = write_extxyz(tmp_path / "frames.extxyz", frames).read_bytes()
    path = tmp_path / "frames.extxyz.gz"
    packed = gzip.compress(whole)
    path.write_bytes(packed[: len(packed) * 3 // 5])
    (tmp_path / "frames.extxyz").unlink()
    # the frame the readable text ends in: whole frames before the cut
    readable = zlib.decompressobj(wbits=31).decompress(path.read_bytes()).decode()
    lines = readable.count("\n")
    ends_in = int(np.searchsorted(np.cumsum([len(f) + 2 for f in frames]), lines, "right"))
    assert 0 < ends_in < len(frames)
    argv = ase_command([path], tmp_path / "store.h5", tmp_path / "run")
    refused(
        capsys, tmp_path, lambda: train_cli.main(argv), f"{path}, frame {ends_in}", "ends early"
    )


def test_energy_key_in_no_frame_lists_the_keys_present(capsys, tmp_path):
    path = write_extxyz(tmp_path / "frames.extxyz", emt_frames())
    argv = ase_command([path], tmp_path / "store.h5", tmp_path / "run", energy_key="U0")
    line = refused(capsys, tmp_path, lambda: train_cli.main(argv), str(path), "'U0'")
    assert "keys present: energy, forces" in line and "data.energy_key" in line


def hydronet_files(raw_dir: Path, damage) -> None:
    """Tiny PyG-style HydroNet files W3..W25 (2 clusters each); ``damage(waters, z, pos, y)``
    may spoil one."""
    rng = np.random.default_rng(0)
    raw_dir.mkdir()
    for waters in range(3, 26):
        z = np.tile([8, 1, 1], (2, waters))
        pos = np.arange(3 * waters)[None, :, None] * 1.6 + rng.normal(0, 0.1, (2, 3 * waters, 3))
        y = -10.0 * waters + rng.normal(size=2)
        damage(waters, z, pos, y)
        np.savez(raw_dir / f"W{waters}_geoms_all.npz", z=z, pos=pos, y=y, num_graphs=2)


def spoil(waters: int, what: str):
    def damage(w: int, z: np.ndarray, pos: np.ndarray, y: np.ndarray) -> None:
        if w != waters:
            return
        if what == "energy":
            y[1] = np.nan
        elif what == "position":
            pos[1, 4, 0] = np.inf
        else:
            z[1, 4] = 0

    return damage


@pytest.mark.parametrize(
    ("what", "problem"),
    [("energy", "non-finite target"), ("position", "non-finite"), ("element", "unknown element")],
)
def test_streaming_writer_refuses_a_bad_record_and_leaves_nothing(capsys, tmp_path, what, problem):
    """W3..W9 are streamed into the partial store before W10's bad record: the import stops
    naming the record, and deletes the partial file."""
    raw = tmp_path / "raw"
    hydronet_files(raw, spoil(10, what))
    out = tmp_path / "water.h5"
    argv = ["import", "hydronet", "--raw-dir", str(raw), "--subset", "small", "--out", str(out)]
    line = refused(
        capsys, tmp_path, lambda: data_cli(argv), str(out), f"record {10 * 10**8 + 1}", problem
    )
    assert not out.exists() and not list(tmp_path.glob(".water.h5*")), line


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--clusters", "0"], "clusters >= 1"),
        (["--sizes", "5", "3"], "1 <= min <= max"),
        (["--sizes", "31", "40", "--distribution", "hydronet"], "none in 31..40"),
        (["--templates", "-2"], "templates >= 1"),
    ],
)
def test_streaming_water_generator_refuses_bad_parameters(capsys, tmp_path, args, problem):
    """``import water --templates N`` (the streamed HydroNet-scale generator): one line,
    no partial file."""
    out = tmp_path / "water.h5"
    argv = ["import", "water", "--templates", "2", *args, "--out", str(out)]
    line = refused(capsys, tmp_path, lambda: data_cli(argv), problem)
    assert not list(tmp_path.glob("*water.h5*")), line


# --- model files: predict --model, export, the calculator ---------------------------------


def structures_file(path: Path, numbers: list[list[int]]) -> Path:
    import ase.io
    from ase import Atoms

    frames = [
        Atoms(numbers=z, positions=np.arange(3 * len(z)).reshape(-1, 3) * 0.4) for z in numbers
    ]
    ase.io.write(path, frames, format="extxyz")
    return path


def predict_model(model: Path, source: Path, out: Path) -> list[str]:
    return ["predict", "--model", str(model), "--input", str(source), "--out", str(out)]


def test_truncated_model_file(capsys, tmp_path, trained):
    _, good_run = trained
    model = tmp_path / "model.pt"
    whole = (good_run / "checkpoints/best.pt").read_bytes()
    model.write_bytes(whole[: len(whole) // 2])
    source = structures_file(tmp_path / "in.extxyz", [[6, 1, 1, 1, 1]])
    argv = predict_model(model, source, tmp_path / "out.extxyz")
    refused(capsys, tmp_path, lambda: train_cli.main(argv), str(model), "unreadable checkpoint")


@pytest.mark.parametrize("kind", ["torchscript", "state_dict"])
def test_model_file_of_another_kind(capsys, tmp_path, trained, kind):
    _, good_run = trained
    model = tmp_path / "model.pt"
    if kind == "torchscript":  # what train.py export writes
        assert train_cli.main(["export", "--run", str(good_run), "--out", str(model)]) == 0
        problem = "exported TorchScript model"
    else:  # a bare state dict, as PyG or a plain training script saves
        torch.save(torch.load(good_run / "checkpoints/best.pt")["model"], model)
        problem = "not a checkpoint of this program"
    source = structures_file(tmp_path / "in.extxyz", [[6, 1, 1, 1, 1]])
    argv = predict_model(model, source, tmp_path / "out.extxyz")
    refused(capsys, tmp_path, lambda: train_cli.main(argv), str(model), problem)


def test_export_of_a_missing_run(capsys, tmp_path):
    missing, out = tmp_path / "no_such_run", tmp_path / "model.pt"
    argv = ["export", "--run", str(missing), "--out", str(out)]
    refused(capsys, tmp_path, lambda: train_cli.main(argv), str(missing), "no such")


def test_predict_names_the_frame_with_an_element_the_model_never_saw(capsys, tmp_path, trained):
    _, good_run = trained
    source = structures_file(tmp_path / "in.extxyz", [[6, 1, 1, 1, 1], [6, 17, 1, 1, 1]])
    argv = predict_model(good_run, source, tmp_path / "out.extxyz")
    line = refused(capsys, tmp_path, lambda: train_cli.main(argv), f"{source}, frame 1", "17")
    assert "never seen in training" in line


@pytest.mark.parametrize(
    ("numbers", "positions", "problem"),
    [
        ([6, 9], [[0, 0, 0], [1.3, 0, 0]], "element(s) 9 never seen"),
        ([6, 1], [[0, 0, 0], [np.nan, 0, 0]], "NaN"),
    ],
)
def test_calculator_refuses_in_one_line(trained, numbers, positions, problem):
    from ase import Atoms

    from schnet_ipu.errors import UserError
    from schnet_ipu.inference.calculator import SchNetCalculator

    _, good_run = trained
    atoms = Atoms(numbers=numbers, positions=positions)
    atoms.calc = SchNetCalculator(good_run)
    with pytest.raises(UserError) as raised:
        atoms.get_potential_energy()
    assert problem in str(raised.value) and "\n" not in str(raised.value)


# --- outputs that would destroy an input, or are folders ------------------------------------


def test_export_onto_the_checkpoint_it_reads_is_refused(capsys, tmp_path, trained):
    """--out the source checkpoint, a symlink to it, or it through a symlinked run folder."""
    _, good_run = trained
    run_dir = copy_run(good_run, tmp_path / "run")
    best = run_dir / "checkpoints/best.pt"
    (tmp_path / "link.pt").symlink_to(best)
    (tmp_path / "run_link").symlink_to(run_dir, target_is_directory=True)
    for source, out in (
        (run_dir, best),
        (best, best),
        (run_dir, tmp_path / "link.pt"),
        (tmp_path / "run_link", best),
        (run_dir, tmp_path / "run_link/checkpoints/best.pt"),
        (run_dir, run_dir / "checkpoints/last.pt"),  # the run's resume point, not the source
    ):
        argv = ["export", "--run", str(source), "--out", str(out)]
        line = refused(capsys, tmp_path, lambda argv=argv: train_cli.main(argv), str(out))
        assert "checkpoint" in line and "choose another --out" in line, line


@pytest.mark.parametrize("command", ["export", "predict --input", "predict --run"])
def test_an_out_that_is_a_folder_is_named_as_given(capsys, tmp_path, trained, command):
    """One line naming the folder as the user wrote it (no hidden temporary file), and
    nothing left behind."""
    _, good_run = trained
    run_dir = copy_run(good_run, tmp_path / "run")
    folder = tmp_path / "d"
    folder.mkdir()
    if command == "export":
        argv = ["export", "--run", str(run_dir), "--out", str(folder)]
    elif command == "predict --input":
        source = structures_file(tmp_path / "in.extxyz", [[6, 1, 1, 1, 1]])
        argv = predict_model(run_dir, source, folder)
    else:
        argv = ["predict", "--run", str(run_dir), "--out", str(folder)]
    line = refused(capsys, tmp_path, lambda: train_cli.main(argv), str(folder), "is a folder")
    assert ".tmp" not in line, line


def test_predict_onto_a_file_it_reads_is_refused(capsys, tmp_path, trained):
    """--out the --input file (also through a symlink, either way round) or the --model
    checkpoint; predict --run onto the run's checkpoint or its store."""
    store, good_run = trained
    run_dir = copy_run(good_run, tmp_path / "run")
    best = run_dir / "checkpoints/best.pt"
    source = structures_file(tmp_path / "in.extxyz", [[6, 1, 1, 1, 1]])
    link = tmp_path / "link.extxyz"
    link.symlink_to(source)
    for model, given, out, what in (
        (best, source, source, "input file"),
        (best, source, link, "input file"),
        (best, link, source, "input file"),
        (run_dir, source, best, "model checkpoint"),
        (best, source, best, "model checkpoint"),
    ):
        argv = predict_model(model, given, out)
        line = refused(capsys, tmp_path, lambda argv=argv: train_cli.main(argv), str(out), what)
        assert "choose another --out" in line, line
    store_digest = hashlib.sha256(store.read_bytes()).hexdigest()
    for out, what in ((best, "checkpoint"), (store, "data store")):
        argv = ["predict", "--run", str(run_dir), "--out", str(out)]
        refused(capsys, tmp_path, lambda argv=argv: train_cli.main(argv), str(out), what)
    assert hashlib.sha256(store.read_bytes()).hexdigest() == store_digest


@pytest.mark.parametrize("text", ["some notes about my model\n", "epochs: 10\nlr: 0.001\n"])
def test_a_text_file_as_model_is_one_line(capsys, tmp_path, text):
    notes = tmp_path / "notes.pt"
    notes.write_text(text)
    source = structures_file(tmp_path / "in.extxyz", [[6, 1, 1, 1, 1]])
    argv = predict_model(notes, source, tmp_path / "out.extxyz")
    refused(capsys, tmp_path, lambda: train_cli.main(argv), str(notes), "unreadable checkpoint")
