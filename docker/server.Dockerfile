# syntax=docker/dockerfile:1
# The server images of docker/compose.yaml, one target each, all at the versions of
# requirements.lock and docker/constraints.txt (inside pyproject.toml's ranges):
#   prefect-server  the Prefect API and UI on port 4200, SQLite database in /var/lib/prefect
#   mlflow-server   the MLflow tracking server on port 5000, SQLite backend and served
#                   artifacts in /var/lib/mlflow (or artifacts on S3)
#   docker-worker   a Prefect worker for a Docker work pool: it starts the GPU job image
#                   (docker/worker.Dockerfile) once per flow run, through the host's Docker socket
#
#   docker compose -f docker/compose.yaml build
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    DO_NOT_TRACK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    MLFLOW_DISABLE_TELEMETRY=true
COPY requirements.lock /etc/rlhf/requirements.lock
COPY docker/constraints.txt /etc/rlhf/constraints.txt
RUN groupadd --gid 1000 rlhf && useradd --uid 1000 --gid rlhf --create-home --shell /bin/bash rlhf

FROM base AS prefect-server
RUN pip install --constraint /etc/rlhf/requirements.lock --constraint /etc/rlhf/constraints.txt prefect fastapi \
    && install -d -o rlhf -g rlhf /var/lib/prefect
ENV PREFECT_HOME=/var/lib/prefect
USER rlhf
EXPOSE 4200
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=6 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:4200/api/health', timeout=4)"]
CMD ["prefect", "server", "start", "--host", "0.0.0.0", "--port", "4200"]

FROM base AS mlflow-server
# boto3 for an artifacts destination on S3 (--artifacts-destination s3://...).
RUN pip install --constraint /etc/rlhf/requirements.lock --constraint /etc/rlhf/constraints.txt mlflow boto3 \
    && install -d -o rlhf -g rlhf /var/lib/mlflow /var/lib/mlflow/artifacts
# MLflow's background job runner stays off: the pipeline uses none of its jobs.
ENV MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
USER rlhf
EXPOSE 5000
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=6 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/health', timeout=4)"]
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000", "--workers", "1", \
     "--backend-store-uri", "sqlite:////var/lib/mlflow/mlflow.db", \
     "--artifacts-destination", "/var/lib/mlflow/artifacts"]

FROM base AS docker-worker
RUN pip install --constraint /etc/rlhf/requirements.lock --constraint /etc/rlhf/constraints.txt prefect prefect-docker fastapi
# Runs as root: it talks to the Docker daemon through the mounted /var/run/docker.sock.
CMD ["prefect", "worker", "start", "--pool", "rlhf-gpu", "--type", "docker"]
