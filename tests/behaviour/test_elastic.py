"""Elastic restarts under torchrun: 2 nodes of 1 process on localhost (two torchrun agents
sharing a c10d rendezvous). A rank SIGKILLed mid-epoch after the first checkpoint makes every
rank restart (``--max-restarts``) and the group resume from ``last.pt``; the whole job killed
and resubmitted resumes the same way. Either way the final ``metrics.jsonl`` holds every
record exactly once with the values of an uninterrupted run.

Timeline of a killed-rank run: the test waits for ``checkpoints/last.pt`` (written after
epoch 0) and for the first step record of epoch 1, then SIGKILLs the worker whose RANK is
the one asked for. The survivor's next gloo collective fails, both agents stop their
workers (SIGTERM) and rendezvous again (a round may fail to connect gloo and take one more
restart), and the new rank 0 (either node may get it) loads ``last.pt`` (epoch 1, call 0),
drops the records written after it (``runlog.truncate_after``) and takes the run folder's
lock over (a SIGKILLed or SIGTERMed rank 0 leaves it behind).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schnet_ipu.backends.distributed import free_port
from tests.helpers import (
    ROOT,
    in_epoch_one,
    random_store,
    repo_env,
    run_outcome,
    smoke_overrides,
    wait_for,
)

TORCHRUN = Path(sys.executable).with_name("torchrun")
EPOCHS = 4
# torchrun's agents share their rendezvous TCPStore with the workers by default, and the
# workers tell restart rounds apart by their own agent's restart count, which the agents do
# not agree on: a later round can read a dead round's keys and hang in init_process_group
# (seen here: both ranks stuck in ProcessGroupGloo's connect; pytorch/pytorch#135712). With
# the store not shared, rank 0 hosts a fresh one every round.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

pytestmark = [
    pytest.mark.slow,  # each torchrun job ~30-40 s on 2 busy cores; ~2.5 min in all
    pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside python"),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return random_store(tmp_path_factory.mktemp("elastic") / "store.h5", molecules=400, seed=5)


def start_job(store: Path, run_dir: Path) -> list[subprocess.Popen]:
    """Two torchrun agents (nodes) of one worker each, rendezvous on a free local port;
    each agent in a session of its own, as on a node of its own."""
    port = free_port()
    train = [
        str(ROOT / "train.py"),
        *smoke_overrides(
            store,
            run_dir,
            "data.val=32",
            "data.test=32",
            f"optim.epochs={EPOCHS}",
            "backend.replicas=2",
            "logging.log_every=1",
        ),
    ]
    agents = []
    for node, is_host in enumerate(("true", "false")):
        command = [
            str(TORCHRUN),
            "--nnodes=2",
            "--nproc-per-node=1",
            "--max-restarts=3",  # a restart round can fail to connect gloo once
            "--monitor-interval=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=elastic-{port}",
            f"--rdzv-conf=is_host={is_host}",
            *train,
        ]
        log = (run_dir.parent / f"{run_dir.name}.node{node}.log").open("w")
        agents.append(
            subprocess.Popen(
                command,
                env=repo_env(**ELASTIC_ENV),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return agents


def finish(agents: list[subprocess.Popen], run_dir: Path) -> None:
    for agent in agents:
        try:
            agent.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
    logs = [(run_dir.parent / f"{run_dir.name}.node{n}.log").read_text() for n in (0, 1)]
    assert [a.returncode for a in agents] == [0, 0], logs[0][-3000:] + logs[1][-3000:]


@pytest.fixture(scope="module")
def uninterrupted(store, tmp_path_factory) -> dict[str, list]:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    finish(start_job(store, run_dir), run_dir)
    return run_outcome(run_dir)


def worker_of_rank(agents: list[subprocess.Popen], rank: int) -> int:
    """The pid of the worker process (an agent's child) whose environment has RANK=rank."""
    agent_pids = {a.pid for a in agents}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        if parent in agent_pids and f"RANK={rank}".encode() in environ:
            return int(entry)
    raise AssertionError(f"no worker of rank {rank} among the agents' children")


@pytest.mark.parametrize("killed", ["rank 1", "rank 0", "whole job"])
def test_killed_run_resumes_to_the_uninterrupted_log(store, uninterrupted, tmp_path, killed):
    run_dir = tmp_path / "run"
    agents = start_job(store, run_dir)
    wait_for(lambda: in_epoch_one(run_dir), agents, "a step of epoch 1")
    if killed == "whole job":  # every agent and worker at once, then resubmitted
        workers = [worker_of_rank(agents, rank) for rank in (0, 1)]  # own sessions: by pid
        for pid in [*workers, *(a.pid for a in agents)]:
            os.kill(pid, signal.SIGKILL)
        for agent in agents:
            agent.wait()
        agents = start_job(store, run_dir)
    else:
        os.kill(worker_of_rank(agents, int(killed[-1])), signal.SIGKILL)
    finish(agents, run_dir)
    got = run_outcome(run_dir)
    assert got["kinds"] == uninterrupted["kinds"], killed  # every record exactly once
    assert [e[0] for e in got["epochs"]] == list(range(EPOCHS))
    for key in ("steps", "epochs", "final"):
        np.testing.assert_allclose(
            np.array(got[key], dtype=float),
            np.array(uninterrupted[key], dtype=float),
            rtol=1e-5,
            atol=0,
            err_msg=f"{killed}: {key}",
        )
    logs = "".join((run_dir.parent / f"run.node{n}.log").read_text() for n in (0, 1))
    assert "at epoch 1, host call 0" in logs  # resumed from the first checkpoint
    # a SIGKILLed rank 0 leaves its lock behind and the restarted rank 0 takes it over (after
    # a killed rank 1 too, when the agent SIGTERMs rank 0 before it exits on its own)
    if killed != "rank 1":
        assert "taking over the lock" in logs, killed
