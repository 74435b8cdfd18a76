# schnet-ipu images. Same install steps as README.md (scripts/setup.sh), two targets:
#
#   docker build --target cpu -t schnet-ipu:cpu .          # CPU (and CUDA hosts, see below)
#   docker build --target ipu -t schnet-ipu:ipu \
#       [--build-arg POPLAR_IMAGE=graphcore/pytorch:<sdk>-ubuntu-20.04-<date>] .
#
# The cpu target installs torch==2.13.0 first, exactly as the README does, so no CUDA build
# is pulled in. For GPUs, build with --build-arg TORCH_SPEC="torch==2.13.0" and a CUDA index.
# The ipu target starts from a Poplar SDK PyTorch image (pinned: SDK 3.3.0, Ubuntu 20.04,
# Python 3.8, torch 2.0.1 + poptorch 3.3.0, whose aten handler list equals 3.4.0's, see
# schnet_ipu/backends/poptorch_ops_3.4.0.txt); it installs requirements-ipu.txt (Python 3.8
# wheels, no torch pin) and keeps the SDK's torch and poptorch.

ARG PYTHON_IMAGE=python:3.11-slim
ARG POPLAR_IMAGE=graphcore/pytorch:3.3.0-ubuntu-20.04-20230703

FROM ${PYTHON_IMAGE} AS cpu
WORKDIR /app
COPY . /app
RUN bash scripts/setup.sh
ENV PATH=/app/.venv/bin:$PATH
CMD ["python", "train.py", "--config", "configs/qm9_quickstart.yaml"]

FROM ${POPLAR_IMAGE} AS ipu
WORKDIR /app
COPY . /app
RUN python3 -m pip install --no-cache-dir -r requirements-ipu.txt \
    && python3 -m pip install --no-cache-dir --no-deps -e .
CMD ["python3", "train.py", "--config", "configs/qm9.yaml", "backend.device=ipu"]
