"""scripts/poprun.py: a config becomes a poprun command line and a Slurm batch script."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "poprun.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )


def test_config_becomes_a_poprun_command() -> None:
    result = run(
        "--config", "configs/qm9.yaml", "backend.device=ipu", "backend.replicas=16",
        "--instances", "4", "--hosts", "pod-a,pod-b", "--partition", "p16",
        "--vipu-server-host", "pod-a", "--ipus-per-replica", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assert words[:2] == ["poprun", "-vv"]
    for flag in (
        "--num-instances=4",
        "--num-replicas=16",
        "--ipus-per-replica=1",
        "--host=pod-a,pod-b",
        "--vipu-partition=p16",
        "--vipu-server-host=pod-a",
        "backend.replicas=16",
    ):
        assert flag in words, flag
    assert words[words.index("--config") + 1] == "configs/qm9.yaml"
    exports = next(w for w in words if w.startswith("--mpi-local-args="))
    assert "-x MASTER_ADDR=pod-a -x MASTER_PORT=29500" in exports  # the instances' gloo group


def test_slurm_script_runs_the_same_command_on_the_job_hosts(tmp_path) -> None:
    script = tmp_path / "job.sh"
    result = run(
        "--config", "configs/qm9.yaml", "backend.device=ipu", "backend.replicas=16",
        "--instances", "4", "--nodes", "2", "--slurm-script", str(script),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text
    assert 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    poprun_line = next(line for line in text.splitlines() if line.startswith("poprun "))
    assert "--host=${HOSTS}" in poprun_line and "--num-replicas=16" in poprun_line
    assert "-x MASTER_ADDR -x MASTER_PORT" in poprun_line
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_more_than_one_ipu_per_replica_is_refused(tmp_path) -> None:
    script = tmp_path / "job.sh"
    result = run(
        "backend.device=ipu", "backend.replicas=4", "--ipus-per-replica", "2",
        "--slurm-script", str(script),
    )  # fmt: skip
    assert result.returncode == 2 and "--ipus-per-replica=2" in result.stderr
    assert not script.exists()


def test_replicas_must_split_over_instances() -> None:
    result = run("backend.device=ipu", "backend.replicas=6", "--instances", "4")
    assert result.returncode == 2
    assert "multiple of --instances=4" in result.stderr


def test_bad_config_key_fails_before_reserving_ipus() -> None:
    result = run("backend.replcas=2")
    assert result.returncode == 2 and "did you mean backend.replicas" in result.stderr
