"""A crash right after any write to the run directory (or in the middle of one): re-running
resumes, and metrics.jsonl then holds every record exactly once and parses line by line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from schnet_ipu.config import load_config
from schnet_ipu.training import loop as training
from schnet_ipu.training.log import RunLog
from schnet_ipu.training.loop import train
from tests.helpers import Killed, random_store, run_outcome, smoke_overrides

EPOCHS = 2


# The runs here set backend.threads=1 (a tiny model steps ~4x faster on one thread of a busy
# machine); the fixture puts torch's thread count back for the other test modules.
pytestmark = pytest.mark.usefixtures("restore_threads")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return random_store(tmp_path_factory.mktemp("crash") / "store.h5", molecules=80, seed=3)


def config(store: Path, run_dir: Path):
    return load_config(
        None,
        smoke_overrides(
            store,
            run_dir,
            "packing.max_nodes=24",
            "packing.target_efficiency=0.8",
            f"optim.epochs={EPOCHS}",
            "logging.log_every=3",
        ),
    )


def crash_after(monkeypatch, crash_at: int | None, torn: bool = False) -> list[str]:
    """Count the run directory's writes (records, checkpoints) and raise :class:`Killed`
    right after write number ``crash_at``, or halfway through it when ``torn``."""
    writes: list[str] = []
    save_checkpoint, write_record = training.save_checkpoint, RunLog.write

    def wrote(what: str) -> None:
        writes.append(what)
        if len(writes) == crash_at:
            raise Killed(what)

    def save(path: Path, state: dict) -> None:
        save_checkpoint(path, state)
        wrote(path.name)

    def write(self: RunLog, kind: str, **fields) -> None:
        if torn and len(writes) + 1 == crash_at:
            line = json.dumps({"kind": kind, "epoch": fields.get("epoch")})
            with self.path.open("a") as f:
                f.write(line[: len(line) // 2])
            raise Killed(f"torn {kind}")
        write_record(self, kind, **fields)
        wrote(kind)

    monkeypatch.setattr(training, "save_checkpoint", save)
    monkeypatch.setattr(RunLog, "write", write)
    return writes


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory) -> tuple[list[str], dict[str, list]]:
    """The writes of an uninterrupted run, in order, and its log."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        writes = crash_after(monkeypatch, None)
        train(config(store, run_dir))
    return writes, run_outcome(run_dir)


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
        with pytest.raises(Killed):
            train(config(store, run_dir))
    train(config(store, run_dir))  # re-running resumes
    return run_outcome(run_dir)


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
