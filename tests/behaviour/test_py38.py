"""The whole package (bench/ included), the scripts, train.py and the IPU test files need no
Python newer than the Poplar SDK's 3.8, by vermin's reading (scripts/check_py38.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_py38.py"


def test_closure_includes_lazy_imports():
    listed = subprocess.run(
        [sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    # imported inside functions only: the PopTorch backend (make_backend) and its op check
    assert {
        "train.py",
        "schnet_ipu/training/loop.py",
        "schnet_ipu/backends/poptorch_backend.py",
    } <= set(listed)
    assert "schnet_ipu/backends/poptorch_ops.py" in listed
    # the CLIs and test files an SDK user runs, and what only they import
    run_by_sdk_users = {
        "scripts/poprun.py",
        "schnet_ipu/data/__main__.py",
        "schnet_ipu/packing/report.py",
        "tests/backends/test_ipu_emulator.py",
        "tests/backends/test_poptorch_ops.py",
    }
    assert run_by_sdk_users <= set(listed)
    # the whole package, also what no entry point imports
    assert {"schnet_ipu/bench/accuracy.py", "scripts/water_scale.py"} <= set(listed)


@pytest.mark.skipif(
    shutil.which("vermin") is None and not Path(sys.executable).with_name("vermin").exists(),
    reason="vermin not installed (requirements-dev.txt)",
)
def test_package_needs_at_most_python_38():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Minimum required versions: 3.8" in result.stdout, result.stdout
