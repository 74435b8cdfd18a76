# schnet-ipu images. Same install steps as README.md (scripts/setup.sh), two targets:
#
#   docker build --target cpu -t schnet-ipu:cpu .          # CPU (and CUDA hosts, see below)
#   docker build --target ipu -t schnet-ipu:ipu \
#       --build-arg POPLAR_IMAGE=graphcore/pytorch:3.3.0-ubuntu-20.04 .
#
# The cpu target installs torch==2.13.0 first, exactly as the README does, so no CUDA build
# is pulled in. For GPUs, build with --build-arg TORCH_SPEC="torch==2.13.0" and a CUDA index.
# The ipu target starts from a Poplar SDK PyTorch image, which already ships torch and
# poptorch; it installs only the rest of the requirements.

ARG PYTHON_IMAGE=python:3.11-slim
ARG POPLAR_IMAGE=graphcore/pytorch:latest

FROM ${PYTHON_IMAGE} AS cpu
WORKDIR /app
COPY . /app
RUN bash scripts/setup.sh
ENV PATH=/app/.venv/bin:$PATH
CMD ["python", "train.py", "--config", "configs/qm9_quickstart.yaml"]

FROM ${POPLAR_IMAGE} AS ipu
WORKDIR /app
COPY . /app
# torch and poptorch come with the SDK image: keep them, install everything else.
RUN grep -v '^torch==' requirements.txt > /tmp/requirements-ipu.txt \
    && python3 -m pip install --no-cache-dir -r /tmp/requirements-ipu.txt \
    && python3 -m pip install --no-cache-dir --no-deps -e .
CMD ["python3", "train.py", "--config", "configs/qm9.yaml", "backend.device=ipu"]
