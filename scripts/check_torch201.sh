#!/usr/bin/env bash
# Opt-in: the IPU path on the Poplar SDK's Python 3.8 + torch 2.0.1.
#
#   bash scripts/check_torch201.sh
#
# Builds (once) a Python 3.8 venv with torch==2.0.1 from PyPI (its Linux wheel is the CUDA
# build, which runs on the CPU: about 2.5 GB of wheels, 5 GB installed) and
# requirements-ipu.txt, then:
#   1. scripts/check_py38.py: vermin over the whole package (bench/ included), the scripts,
#      train.py and the IPU test files with what they import (run by PYTHON, which needs
#      vermin);
#   2. Python 3.8 collects the IPU test files (IPU_TESTS), test helpers included;
#   3. Python 3.8 runs the emulator's tests and the op check's: among them the emulated
#      2-replica run with weight decay, clipping, a schedule, a resume, evaluate and predict
#      (tests/backends/test_ipu_emulator.py), about 3 minutes on 2 cores;
#   4. when data/qm9.h5 exists, scripts/torch201_compare.py: one emulated step under PYTHON's
#      torch (saved) and under torch 2.0.1 (compared within 1e-5).
# Environment: PYTHON38 (default ~/.pyenv/versions/3.8.18/bin/python), VENV38 (default
# .venv-torch201), PYTHON (default .venv/bin/python, else python3), WORK (where the
# reference file goes, default a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON38=${PYTHON38:-$HOME/.pyenv/versions/3.8.18/bin/python}
VENV38=${VENV38:-.venv-torch201}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WORK=${WORK:-$(mktemp -d)}
IPU_TESTS="tests/backends/test_poptorch.py tests/backends/test_poptorch_ops.py tests/backends/test_ipu_emulator.py"
export PYTHONPATH=$PWD

if [ ! -x "$VENV38/bin/python" ]; then
    df -h . | tail -1 | awk '{print "free disk: " $4 " (the venv needs about 5 GB)"}'
    "$PYTHON38" -m venv "$VENV38"
    "$VENV38/bin/pip" install -q "torch==2.0.1" -r requirements-ipu.txt pytest
fi
"$VENV38/bin/python" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)'

echo "== 1. vermin: nothing newer than Python 3.8"
"$PYTHON" scripts/check_py38.py
echo "== 2. Python 3.8 collects the IPU test files"
"$VENV38/bin/python" -m pytest -p no:cacheprovider --collect-only -q $IPU_TESTS | tail -3
echo "== 3. Python 3.8 + torch 2.0.1 runs the emulator (the emulated end-to-end run included)"
"$VENV38/bin/python" -m pytest -p no:cacheprovider -q -rxX tests/backends/test_ipu_emulator.py tests/backends/test_poptorch_ops.py
if [ -f data/qm9.h5 ]; then
    echo "== 4. one emulated step: torch 2.0.1 against $("$PYTHON" -c 'import torch; print(torch.__version__)')"
    "$PYTHON" scripts/torch201_compare.py save "$WORK/torch213.pt"
    "$VENV38/bin/python" scripts/torch201_compare.py compare "$WORK/torch213.pt"
else
    echo "== 4. skipped: data/qm9.h5 is missing (python -m schnet_ipu.data import qm9 --out data/qm9.h5)"
fi
