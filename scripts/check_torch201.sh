#!/usr/bin/env bash
# Opt-in: the IPU path on the Poplar SDK's Python 3.8 + torch 2.0.1, against torch 2.13.
#
#   bash scripts/check_torch201.sh
#
# Builds (once) a Python 3.8 venv with torch==2.0.1 from PyPI (the CUDA build: about 2.5 GB
# of wheels, 5 GB installed) and requirements-ipu.txt, then:
#   1. scripts/check_py38.py: vermin over every module the IPU path imports;
#   2. scripts/torch201_compare.py: one emulated training step (ipu op flavour, PopTorch op
#      check, Adam) under torch 2.13 (saved) and under torch 2.0.1 (compared within 1e-5).
# Environment: PYTHON38 (default ~/.pyenv/versions/3.8.18/bin/python), VENV38 (default
# .venv-torch201), PYTHON (the torch 2.13 interpreter, default .venv/bin/python), WORK (where
# the reference file goes, default a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON38=${PYTHON38:-$HOME/.pyenv/versions/3.8.18/bin/python}
VENV38=${VENV38:-.venv-torch201}
PYTHON=${PYTHON:-.venv/bin/python}
WORK=${WORK:-$(mktemp -d)}
export PYTHONPATH=$PWD

if [ ! -x "$VENV38/bin/python" ]; then
    df -h . | tail -1 | awk '{print "free disk: " $4 " (the venv needs about 5 GB)"}'
    "$PYTHON38" -m venv "$VENV38"
    "$VENV38/bin/pip" install -q "torch==2.0.1" -r requirements-ipu.txt
fi

"$PYTHON" scripts/check_py38.py
"$PYTHON" scripts/torch201_compare.py save "$WORK/torch213.pt"
"$VENV38/bin/python" scripts/torch201_compare.py compare "$WORK/torch213.pt"
