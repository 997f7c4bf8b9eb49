"""Orchestration glue around ``rlhf_core``: artifact storage, MLflow tracking and Prefect tasks."""
