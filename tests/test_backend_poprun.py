"""scripts/poprun.py: a config becomes a poprun command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "poprun.py"


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
    words = result.stdout.split()
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


def test_replicas_must_split_over_instances() -> None:
    result = run("backend.device=ipu", "backend.replicas=6", "--instances", "4")
    assert result.returncode == 2
    assert "multiple of --instances=4" in result.stderr


def test_bad_config_key_fails_before_reserving_ipus() -> None:
    result = run("backend.replcas=2")
    assert result.returncode == 2 and "did you mean backend.replicas" in result.stderr
