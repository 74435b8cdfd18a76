"""``python -m schnet_ipu.backends.torchrun``: torchrun with the project's error boundary.
A node that cannot reach the rendezvous, or whose peers never join, ends within its
timeout with one line naming the endpoint (exit 2); a failed worker's exit code passes
through; the rendezvous store is not shared with the workers unless asked.

(The same over a real network, between network namespaces: tests/behaviour/test_multihost.py.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from schnet_ipu.backends.distributed import free_port
from tests.helpers import ROOT, repo_env

LAUNCH = [sys.executable, "-m", "schnet_ipu.backends.torchrun"]


def launch(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [*LAUNCH, *args], cwd=ROOT, env=repo_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    return done, time.monotonic() - start


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_an_unreachable_rendezvous_is_one_line_naming_it():
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    done, seconds = launch(
        "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}", "--rdzv-id=unreachable",
        "--rdzv-conf=is_host=false,read_timeout=2", "train.py",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    line = last_line(done.stderr)
    assert line.startswith(f"error: rendezvous {endpoint}: this node could not connect"), line
    assert "within read_timeout=2 s" in line
    assert seconds < 60


def test_peers_that_never_join_end_the_wait_with_one_line():
    endpoint = f"127.0.0.1:{free_port()}"
    done, seconds = launch(
        "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}", "--rdzv-id=alone",
        "--rdzv-conf=is_host=true,join_timeout=3", "train.py",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    line = last_line(done.stderr)
    assert line.startswith(f"error: rendezvous {endpoint}: fewer than --nnodes=2 nodes"), line
    assert "within join_timeout=3 s" in line
    assert seconds < 60


def test_a_failed_worker_exit_code_passes_through_and_the_store_is_not_shared(tmp_path: Path):
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, sys\n"
        "print('share:', os.environ.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE'), flush=True)\n"
        "sys.exit(2)\n"
    )
    done, _ = launch("--standalone", "--nproc-per-node=1", "--max-restarts=0", str(worker))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "share: 1" in done.stdout  # the default this command sets for its workers
    assert "Traceback" not in done.stderr  # torch's summary of the failure, not a traceback
    assert "exitcode  : 2" in done.stderr
