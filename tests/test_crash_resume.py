"""A crash right after any write to the run directory (or in the middle of one): re-running
resumes, and metrics.jsonl then holds every record exactly once and parses line by line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from schnet_ipu import training
from schnet_ipu.config import load_config
from schnet_ipu.data import write_store
from schnet_ipu.runlog import RunLog
from schnet_ipu.training import train

EPOCHS = 2


class Crash(BaseException):
    """A simulated kill: nothing in the program catches it."""


# The runs here set backend.threads=1 (a tiny model steps ~4x faster on one thread of a busy
# machine); the fixture puts torch's thread count back for the other test modules.
pytestmark = pytest.mark.usefixtures("restore_threads")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    rng = np.random.default_rng(3)
    sizes = rng.integers(3, 8, size=80)
    z = [rng.choice([1, 6, 7, 8], size=n) for n in sizes]
    pos = [np.cumsum(rng.normal(0, 0.7, size=(n, 3)), axis=0) for n in sizes]
    energy = -10.0 * sizes + rng.normal(0, 0.1, size=len(sizes))
    path = tmp_path_factory.mktemp("crash") / "store.h5"
    return write_store(path, z, pos, {"U0": energy}, {"U0": "eV"})


def config(store: Path, run_dir: Path):
    return load_config(
        None,
        [
            f"data.path={store}",
            "data.val=16",
            "data.test=16",
            "model.hidden_channels=8",
            "model.num_filters=8",
            "model.num_interactions=1",
            "model.num_gaussians=4",
            "packing.packs_per_batch=2",
            "packing.max_nodes=24",
            "packing.target_efficiency=0.8",
            f"optim.epochs={EPOCHS}",
            "optim.schedule=constant",
            "optim.beat_baseline=false",  # a smoke run, too short to learn
            "loader.workers=0",
            "backend.threads=1",
            "logging.progress=false",
            "logging.plot=false",
            "logging.log_every=3",
            f"logging.run_dir={run_dir}",
        ],
    )


def crash_after(monkeypatch, crash_at: int | None, torn: bool = False) -> list[str]:
    """Count the run directory's writes (records, checkpoints) and raise :class:`Crash`
    right after write number ``crash_at``, or halfway through it when ``torn``."""
    writes: list[str] = []
    save_checkpoint, write_record = training.save_checkpoint, RunLog.write

    def wrote(what: str) -> None:
        writes.append(what)
        if len(writes) == crash_at:
            raise Crash(what)

    def save(path: Path, state: dict) -> None:
        save_checkpoint(path, state)
        wrote(path.name)

    def write(self: RunLog, kind: str, **fields) -> None:
        if torn and len(writes) + 1 == crash_at:
            line = json.dumps({"kind": kind, "epoch": fields.get("epoch")})
            with self.path.open("a") as f:
                f.write(line[: len(line) // 2])
            raise Crash(f"torn {kind}")
        write_record(self, kind, **fields)
        wrote(kind)

    monkeypatch.setattr(training, "save_checkpoint", save)
    monkeypatch.setattr(RunLog, "write", write)
    return writes


def records(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl, each a complete JSON record."""
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def outcome(run_dir: Path) -> dict[str, list]:
    """What a finished run's log must hold exactly once, without the timings."""
    rows = records(run_dir)
    return {
        "kinds": sorted(r["kind"] for r in rows),
        "steps": [(r["epoch"], r["call"], r["loss"]) for r in rows if r["kind"] == "step"],
        "epochs": [
            (r["epoch"], r["train_loss"], r["val_mae"]) for r in rows if r["kind"] == "epoch"
        ],
        "final": [r["test_mae"] for r in rows if r["kind"] == "final"],
    }


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory) -> tuple[list[str], dict[str, list]]:
    """The writes of an uninterrupted run, in order, and its log."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        writes = crash_after(monkeypatch, None)
        train(config(store, run_dir))
    return writes, outcome(run_dir)


def test_the_run_writes_every_kind(reference):
    writes, log = reference
    assert {"stage", "step", "epoch", "final", "last.pt", "best.pt"} <= set(writes)
    assert [e[0] for e in log["epochs"]] == list(range(EPOCHS)) and len(log["final"]) == 1
    # each epoch's record is on disk before the checkpoints that claim the epoch, best.pt
    # (when the epoch improved) before last.pt
    for record in [i for i, w in enumerate(writes) if w == "epoch"]:
        after = writes[record + 1 : record + 3]
        assert after == ["best.pt", "last.pt"] or after[0] == "last.pt", writes


def assert_same_log(got: dict[str, list], expected: dict[str, list], case: str) -> None:
    """Each record once, with the values of the uninterrupted run (resume is exact)."""
    assert got["kinds"] == expected["kinds"], case
    for key in ("steps", "epochs", "final"):
        np.testing.assert_allclose(
            np.array(got[key], dtype=float), np.array(expected[key], dtype=float), 1e-5, 0, case
        )


def resume_after_crash(store, run_dir: Path, crash_at: int, torn: bool) -> dict[str, list]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        crash_after(monkeypatch, crash_at, torn)
        with pytest.raises(Crash):
            train(config(store, run_dir))
    train(config(store, run_dir))  # re-running resumes
    return outcome(run_dir)


def test_crash_after_every_write(store, reference, tmp_path):
    writes, expected = reference
    for crash_at in range(1, len(writes) + 1):
        got = resume_after_crash(store, tmp_path / f"after{crash_at}", crash_at, torn=False)
        assert_same_log(got, expected, f"crash after write {crash_at} ({writes[crash_at - 1]})")


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("stage", marks=pytest.mark.slow),
        "step",
        pytest.param("epoch", marks=pytest.mark.slow),
        "final",
    ],
)
def test_crash_in_the_middle_of_a_record(store, reference, tmp_path, kind, caplog):
    """A torn last line (the kind's last record): the resume warns, drops it and writes
    the record again."""
    writes, expected = reference
    crash_at = len(writes) - writes[::-1].index(kind)
    got = resume_after_crash(store, tmp_path / "run", crash_at, torn=True)
    assert_same_log(got, expected, f"torn {kind}")
    if kind != "stage":  # a crash before the first checkpoint starts over instead
        assert "torn" in caplog.text
