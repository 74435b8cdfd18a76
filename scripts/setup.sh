#!/usr/bin/env bash
# Create (or reuse) the virtual environment in .venv and install schnet-ipu into it.
# torch==2.13.0 goes first so pip keeps the CPU build instead of pulling a multi-GB CUDA one.
# Idempotent: a second run with unchanged requirements does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.schnet-ipu-installed
want=$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet torch==2.13.0
    .venv/bin/python -m pip install --quiet -r requirements-dev.txt
    .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
    echo "$want" > "$stamp"
fi
