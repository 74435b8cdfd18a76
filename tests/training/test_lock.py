"""One writer per run folder: a second run on a held folder is refused with one line naming
the holder; a lock whose holder was SIGKILLed is taken over with a warning."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schnet_ipu.errors import run_cli
from schnet_ipu.training.lock import RunLockError, hold_run_lock, lock_path, read_holder
from schnet_ipu.training.log import read_records
from tests.helpers import (
    TRAIN_PY,
    load_script,
    random_store,
    repo_env,
    run_train,
    smoke_overrides,
    wait_for,
    whole_records,
)

EPOCHS = 3


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return random_store(tmp_path_factory.mktemp("lock") / "store.h5", molecules=96, seed=5)


def train_args(store: Path, run_dir: Path, epochs: int = EPOCHS) -> list[str]:
    return smoke_overrides(
        store,
        run_dir,
        f"optim.epochs={epochs}",
    )


def start(args: list[str]) -> subprocess.Popen:
    """``train.py ARGS`` in the background."""
    return subprocess.Popen(
        [*TRAIN_PY, *args], env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def epochs_once(run_dir: Path) -> list[int]:
    """The epochs of metrics.jsonl; also checks one final record and whole lines."""
    assert (run_dir / "metrics.jsonl").read_text().endswith("\n")
    assert len(read_records(run_dir / "metrics.jsonl", "final")) == 1
    return [r["epoch"] for r in read_records(run_dir / "metrics.jsonl", "epoch")]


def test_a_second_run_on_a_held_folder_is_refused(store, tmp_path):
    run_dir = tmp_path / "run"
    first = start(train_args(store, run_dir))
    lock = lock_path(run_dir)
    wait_for(lambda: read_holder(lock) is not None, [first], "the first run's lock")
    began = time.perf_counter()
    second = run_train(*train_args(store, run_dir), timeout=120)
    refused_after = time.perf_counter() - began
    still_running = first.poll() is None
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert second.returncode == 2, second.stderr
    lines = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
    assert (
        str(run_dir) in lines[0] and f"pid {first.pid} on host {socket.gethostname()}" in lines[0]
    )
    assert still_running, "the second run waited for the first instead of refusing"
    print(f"second run refused {refused_after:.2f} s after it started (process start to exit)")
    assert epochs_once(run_dir) == list(range(EPOCHS))
    assert not lock.exists()  # released and removed by the first run's clean exit
    # the run ends on one human line; the whole final record stays in the run folder
    final = whole_records(run_dir)[-1]
    assert out.strip().splitlines() == [
        f"test MAE {final['test_mae']:.4g} {final['unit']} over {final['test_molecules']} "
        f"structures (dressed-atom baseline {final['baseline_test_mae']:.4g} {final['unit']}); "
        f"{final['wall_seconds']:.0f} s; records in {run_dir / 'metrics.jsonl'}"
    ]


@pytest.mark.slow  # ~25 s: two trainings; test_stale_lock_taken_over_with_a_warning is quick
def test_the_lock_of_a_sigkilled_run_is_taken_over(store, tmp_path):
    """SIGKILL after the first checkpoint: the lock file stays with the dead pid, the next
    start warns, takes it over, resumes, and ends with every epoch once."""
    run_dir = tmp_path / "run"
    killed = start(train_args(store, run_dir))
    wait_for((run_dir / "checkpoints/last.pt").exists, [killed], "a first checkpoint")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert read_holder(lock_path(run_dir))["pid"] == killed.pid
    again = run_train(*train_args(store, run_dir))
    assert again.returncode == 0, again.stderr
    assert f"taking over the lock of pid {killed.pid}" in again.stderr
    assert "resuming" in again.stderr
    assert epochs_once(run_dir) == list(range(EPOCHS))
    assert not lock_path(run_dir).exists()


HOLD = """
import sys, time
from pathlib import Path
from schnet_ipu.training.lock import hold_run_lock
with hold_run_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def hold_elsewhere(run_dir: Path) -> subprocess.Popen:
    """Another process holding the lock of ``run_dir`` until it is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], env=repo_env(),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_held_elsewhere_refused_as_one_line_nothing_written(tmp_path, capsys):
    run_dir = tmp_path / "deep/run"
    other = hold_elsewhere(run_dir)
    try:
        before = sorted(tmp_path.rglob("*"))
        with pytest.raises(RunLockError, match=f"pid {other.pid} on host"), hold_run_lock(run_dir):
            pytest.fail("entered a held lock")

        def body() -> None:
            with hold_run_lock(tmp_path / "deep/../deep/run"):  # another spelling, one lock
                pass

        assert run_cli(body) == 2
        assert capsys.readouterr().err.count("\n") == 1
        assert sorted(tmp_path.rglob("*")) == before
    finally:
        other.kill()
        other.wait()
    assert read_holder(lock_path(run_dir))["pid"] == other.pid  # left by a SIGKILL: stale


def test_stale_lock_taken_over_with_a_warning(tmp_path, caplog):
    run_dir = tmp_path / "run"
    other = hold_elsewhere(run_dir)
    other.kill()
    other.wait()
    with hold_run_lock(run_dir):
        assert read_holder(lock_path(run_dir))["pid"] == os.getpid()
    assert f"taking over the lock of pid {other.pid}" in caplog.text
    assert not lock_path(run_dir).exists()


def test_a_nested_hold_is_refused_and_other_ranks_hold_none(tmp_path):
    """The lock is taken in one place: a second hold in the same process is an error, whose
    failed attempt leaves the first hold's lock in force."""
    run_dir = tmp_path / "a/b/run"
    with hold_run_lock(run_dir, holder=False):
        assert not lock_path(run_dir).exists()
    with hold_run_lock(run_dir):
        refused = pytest.raises(RuntimeError, match="holds its run lock already")
        with refused, hold_run_lock(tmp_path / "a/b/../b/run"):  # another spelling, one lock
            pytest.fail("entered a lock this process holds")
        # the refused attempt must not have dropped the lock: another process is refused
        probe = subprocess.run(
            [sys.executable, "-c", HOLD, str(run_dir)], env=repo_env(),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert probe.returncode != 0 and f"pid {os.getpid()}" in probe.stderr
    assert not lock_path(run_dir).exists() and not (tmp_path / "a").exists()


def test_evaluate_and_predict_into_a_held_folder_are_refused(tmp_path, capsys):
    """They write pictures / predictions into the run folder; predict --out elsewhere only
    reads the run and goes on (here to a missing checkpoint)."""
    train_cli = load_script("train.py")
    run_dir = tmp_path / "run"
    other = hold_elsewhere(run_dir)
    try:
        for command in ("evaluate", "predict"):
            assert train_cli.main([command, "--run", str(run_dir)]) == 2
            assert f"pid {other.pid}" in capsys.readouterr().err, command
        elsewhere = ["predict", "--run", str(run_dir), "--out", str(tmp_path / "p.csv")]
        assert train_cli.main(elsewhere) == 2
        err = capsys.readouterr().err
        assert "no such model file or run folder" in err and "in use" not in err, err
    finally:
        other.kill()
        other.wait()
