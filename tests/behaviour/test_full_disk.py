"""A full disk in the middle of a run: the run stops with one line, and the last good
checkpoint and every metrics record already on disk stay intact; re-running resumes.

Simulated with RLIMIT_FSIZE (a loop device or a small mount is not available here): the run
is ``train.py`` in a subprocess that ignores SIGXFSZ, so a write past the limit fails with
EFBIG part-way, as a write on a full disk fails with ENOSPC. A thread of that process lowers
the limit once the first checkpoint exists, i.e. mid-run, not at the start:
``checkpoint``: to 4 KB above the log's size, below a checkpoint's (the next checkpoint
write fails); ``metrics``: to 20 bytes above the log's size (the next record is cut short).
``read-only``: the run folder becomes read-only at that point (as root, which ignores file
permissions: a bind mount of the folder, remounted read-only, in the run's own mount
namespace made by ``unshare -m``; otherwise the folder's permissions).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, random_store, repo_env, run_train, smoke_overrides, whole_records

EPOCHS = 3

DRIVER = """
import resource, runpy, signal, subprocess, sys, threading, time
from pathlib import Path

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
run_dir, room, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]


def fill_the_disk_after_the_first_checkpoint():
    while not (run_dir / "checkpoints/last.pt").exists():
        time.sleep(0.002)
    if room == "read-only":  # in a mount namespace of its own: remount the folder read-only
        subprocess.run(["mount", "-o", "remount,ro,bind", str(run_dir)], check=True)
    elif room == "no-permission":
        for path in (run_dir / "metrics.jsonl", run_dir / "checkpoints", run_dir):
            path.chmod(0o555)
    else:
        limit = (run_dir / "metrics.jsonl").stat().st_size + int(room)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    print(f"disk full: {room}", file=sys.stderr, flush=True)


threading.Thread(target=fill_the_disk_after_the_first_checkpoint, daemon=True).start()
sys.argv = ["train.py", *argv]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return random_store(tmp_path_factory.mktemp("disk") / "store.h5", molecules=96, seed=7)


def train_args(store: Path, run_dir: Path) -> list[str]:
    return smoke_overrides(
        store,
        run_dir,
        f"optim.epochs={EPOCHS}",
        "logging.log_every=2",
    )


def read_only_launcher(run_dir: Path) -> list[str]:
    """How to make ``run_dir`` read-only mid-run: a bind mount remounted read-only in a
    mount namespace of the run's own (root ignores permissions), else file permissions."""
    if os.geteuid() != 0:
        return []
    run_dir.mkdir()
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount --bind {run_dir} {run_dir}"],
            capture_output=True, timeout=60,
        )  # fmt: skip
    except FileNotFoundError:
        pytest.skip("root without unshare(1): cannot make a folder read-only")
    if probe.returncode != 0:
        pytest.skip(f"root without mount namespaces: {probe.stderr.decode().strip()}")
    return ["unshare", "-m", "sh", "-c", f'mount --bind {run_dir} {run_dir} && exec "$@"', "sh"]


@pytest.mark.parametrize(
    ("full_during", "room"),
    [
        ("checkpoint", "4096"),
        pytest.param("metrics", "20", marks=pytest.mark.slow),  # ~20 s each
        pytest.param("read-only", "read-only", marks=pytest.mark.slow),
    ],
)
def test_full_disk_mid_run_keeps_what_was_written(store, tmp_path, full_during, room):
    run_dir = tmp_path / "run"
    launcher = []
    if full_during == "read-only":
        launcher = read_only_launcher(run_dir)
        room = "read-only" if launcher else "no-permission"
    driver = [sys.executable, "-c", DRIVER, str(run_dir), room, *train_args(store, run_dir)]
    stopped = subprocess.run(
        [*launcher, *driver], cwd=ROOT, env=repo_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    if room == "no-permission":
        for path in (run_dir, run_dir / "checkpoints", run_dir / "metrics.jsonl"):
            path.chmod(0o755)
    assert stopped.returncode == 2, stopped.stderr
    assert "disk full" in stopped.stderr  # it came mid-run
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stopped.stderr, stopped.stderr
    culprit, cause = {
        "checkpoint": (("checkpoints/",), "File too large"),
        "metrics": (("metrics.jsonl",), "File too large"),
        "read-only": (("checkpoints/", "metrics.jsonl"), "Read-only" if launcher else "denied"),
    }[full_during]
    assert any(c in errors[0] for c in culprit) and cause in errors[0], errors[0]
    # on disk: the first checkpoint, whole, and whole records only
    last = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    assert last["epoch"] == 1
    records = whole_records(run_dir)
    epochs = [r["epoch"] for r in records if r["kind"] == "epoch"]
    assert epochs == {"checkpoint": [0, 1], "metrics": [0]}.get(full_during, epochs[:1]), epochs
    assert not list(run_dir.rglob(".*tmp*"))  # no temp file left behind
    # space again: the run resumes from that checkpoint and ends with every epoch once
    resumed = run_train(*train_args(store, run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    records = whole_records(run_dir)
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == list(range(EPOCHS))
    assert [r["kind"] for r in records].count("final") == 1
