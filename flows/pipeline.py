"""The ``rlhf`` flow: every stage in order, cached and resumable, tracked in MLflow.

Deployed as ``rlhf/full-pipeline`` (``infra/prefect.yaml``); also runnable in-process with
Prefect's ephemeral mode: ``python -m flows.pipeline --preset smoke``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from rlhf_core.config import flatten, load_config
from rlhf_core.pipeline import STAGES
from tasks.mlflow_tracking import MLflowTracker, experiment_id, tracking_client
from tasks.stages import StageRecord, run_stage

#: Model registry names and the alias given to the newest version.
POLICY_MODEL = "rlhf-tldr-policy"
REWARD_MODEL = "rlhf-tldr-reward-model"
ALIAS = "latest-pipeline"


def register(client, name: str, record: StageRecord, alias: str = ALIAS) -> str:
    """Register ``record``'s ``model`` directory as a version of ``name`` and point ``alias`` at it.

    A model already registered with the same artifact digest (a cached stage) keeps its version.
    """
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException:
        pass  # already registered
    for existing in client.search_model_versions(f"name='{name}'"):
        if existing.tags.get("rlhf.digest") == record.digest:  # a cached stage: same model, same version
            client.set_registered_model_alias(name, alias, existing.version)
            return existing.version
    source = f"{record.uri}/model"
    if "://" not in record.uri:
        # MLflow accepts a local source only inside the run's own artifacts: copy the model there.
        client.log_artifacts(record.mlflow_run_id, source, "model")
        source = f"{client.get_run(record.mlflow_run_id).info.artifact_uri}/model"
    version = client.create_model_version(name, source=source, run_id=record.mlflow_run_id,
                                          tags={"rlhf.digest": record.digest, "rlhf.artifact_uri": record.uri})
    client.set_registered_model_alias(name, alias, version.version)
    return version.version


@flow(name="rlhf", log_prints=True)
def rlhf(preset: str = "cpu-demo", overrides: list[str] | None = None) -> dict:
    """Run the pipeline for ``preset`` with ``key=value`` ``overrides``; returns each stage's record."""
    logger = get_run_logger()
    cfg = load_config(preset, overrides or [])
    c = cfg.model_dump()
    client = tracking_client()
    exp = experiment_id(client, cfg.tracking.experiment_name)
    parent = client.create_run(exp, run_name=f"{cfg.name}-{flow_run.get_name() or 'local'}",
                               tags={"prefect.flow_run_id": str(flow_run.get_id() or ""), "rlhf.preset": preset})
    parent_id = parent.info.run_id
    tracker = MLflowTracker(parent_id, client=client)
    tracker.log_params(flatten(cfg))
    try:
        raw: dict[str, dict] = {}
        for name, stage in STAGES.items():
            raw[name] = run_stage(name, c, [raw[dep] for dep in stage.inputs], parent_id)
        records = {name: StageRecord.model_validate(r) for name, r in raw.items()}
        for stage, record in records.items():
            client.set_tag(parent_id, f"rlhf.artifact.{stage}", record.uri)
            client.set_tag(parent_id, f"rlhf.stage_run.{stage}", record.mlflow_run_id or "")
            tracker.log_metrics({f"{stage}/{k}": v for k, v in record.metrics.items()})
        versions = {POLICY_MODEL: register(client, POLICY_MODEL, records["ppo"]),
                    REWARD_MODEL: register(client, REWARD_MODEL, records["reward_norm"])}
        tracker.close()
        client.set_terminated(parent_id, "FINISHED")
    except BaseException:
        tracker.close()
        client.set_terminated(parent_id, "FAILED")
        raise
    logger.info("registered %s", versions)
    return {"mlflow_run_id": parent_id, "stages": {k: v.model_dump() for k, v in records.items()},
            "registered": versions}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the rlhf flow in-process (Prefect's ephemeral mode).")
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    # A first start of the ephemeral server migrates its database: slow on a small, busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = rlhf(preset=args.preset, overrides=args.overrides)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
