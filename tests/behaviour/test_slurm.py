"""scripts/slurm/train.sbatch on a real Slurm: a one-node cluster (slurmctld and slurmd from
Debian's slurm-wlm, started here with a config this test writes, no authentication between
them) runs the example with 2 processes on its node, as a user submits it (opt-in:
``pytest -m slurm``; root; skipped with one line without the Slurm daemons).

The job must end COMPLETED with exit code 0 and leave a whole run: every epoch once and a
final record, trained by backend.replicas=2 (the sbatch script's nodes x processes).
Every wait is bounded; the daemons and any job left go in a finalizer.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schnet_ipu.backends.distributed import free_port
from tests.helpers import ROOT, random_store, run_outcome, smoke_overrides, whole_records

pytestmark = pytest.mark.slurm

COMMANDS = ("slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scontrol", "scancel")
EPOCHS = 3
JOB_S = 300  # the longest the job may take (queue, two workers, three epochs, test)


def slurm_conf(folder: Path) -> Path:
    """A one-node cluster's slurm.conf: this host (as 127.0.0.1), its CPUs, free ports, no
    authentication, state and logs under ``folder``."""
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True)
    node = socket.gethostname()
    lines = [
        "ClusterName=schnetipu",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "AuthType=auth/none",
        "CredType=cred/none",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    path = folder / "slurm.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def slurm(env: dict[str, str], *command: str) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}"
    return done.stdout


def wait_until(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The Slurm environment of a running one-node cluster (SLURM_CONF set)."""
    if os.geteuid() != 0:
        pytest.skip("Slurm test: the daemons run as root here")
    missing = [name for name in COMMANDS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm test: {', '.join(missing)} not installed (Debian: slurm-wlm)")
    folder = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_CONF": str(slurm_conf(folder))}
    daemons = [
        subprocess.Popen([name, "-D", *flags], env=env, stdout=log, stderr=subprocess.STDOUT)
        for name, flags, log in (
            ("slurmctld", ["-i"], (folder / "slurmctld.out").open("w")),
            ("slurmd", [], (folder / "slurmd.out").open("w")),
        )
    ]
    try:
        wait_until(
            lambda: slurm(env, "sinfo", "-h", "-o", "%T").strip() == "idle",
            "idle node",
            60,
        )
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, timeout=30, check=False)
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=30)


def test_the_sbatch_example_trains_on_a_slurm_cluster(cluster, tmp_path):
    store = random_store(tmp_path / "store.h5", molecules=300, seed=5)
    run_dir = tmp_path / "run"
    overrides = smoke_overrides(
        store, run_dir, "data.subset=0", "data.val=32", "data.test=32",
        f"optim.epochs={EPOCHS}", "logging.log_every=1", "loader.shard=true",
    )  # fmt: skip
    env = {
        **cluster,
        "PROCS_PER_NODE": "2",
        "RDZV_PORT": str(free_port()),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
    }
    job = slurm(
        env, "sbatch", "--parsable", "--nodes=1", f"--chdir={ROOT}",
        f"--output={tmp_path / 'job.out'}", str(ROOT / "scripts/slurm/train.sbatch"),
        "configs/qm9_quickstart.yaml", *overrides,
    ).strip()  # fmt: skip
    wait_until(lambda: not slurm(env, "squeue", "-h", "-j", job).strip(), "finished job", JOB_S)
    state = slurm(env, "scontrol", "show", "job", job)
    output = (tmp_path / "job.out").read_text()
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, output[-4000:]
    outcome = run_outcome(run_dir)
    assert [e[0] for e in outcome["epochs"]] == list(range(EPOCHS)) and outcome["final"]
    steps = [r for r in whole_records(run_dir) if r["kind"] == "step"]
    assert {r["replicas"] for r in steps} == {2}  # nodes x processes per node
    assert "global batch: backend.replicas 2 x" in output
