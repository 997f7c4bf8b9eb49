"""The ``rlhf`` flow: every stage in order, cached and resumable, tracked in MLflow.

Deployed as ``rlhf/full-pipeline`` (``infra/prefect.yaml``); also runnable in-process with
Prefect's ephemeral mode with ``rlhf run`` (:mod:`flows.cli`).
"""

from __future__ import annotations

from typing import Any

from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from rlhf_core.config import PipelineConfig, flatten, load_config
from rlhf_core.evaluation import REPORT_FILES
from rlhf_core.io import exclusive_lock
from rlhf_core.pipeline import STAGES
from tasks.attempts import attempt, end_dead_attempts
from tasks.mlflow_tracking import (
    REGISTERED_MODELS,
    MLflowTracker,
    experiment_id,
    register_model_version,
    tracking_client,
)
from tasks.stages import StageRecord, preflight, run_stage, work_root
from tasks.storage import ArtifactStore


@flow(name="rlhf")
def rlhf(preset: str | None = "cpu-demo", overrides: list[str] | None = None, until: str | None = None) -> dict:
    """Run the pipeline for ``preset`` with ``key=value`` ``overrides``, up to stage ``until``
    (default: every stage); returns each stage's record and the registered model versions.
    """
    logger = get_run_logger()
    cfg = load_config(preset, overrides or [])
    names = list(STAGES)
    if until is not None and until not in STAGES:
        raise ValueError(f"until={until!r} is not a stage ({', '.join(names)})")
    names = names[: names.index(until) + 1] if until else names
    preflight(cfg)  # settings for this machine's process count, writable stores: before any stage
    client = tracking_client(cfg.tracking.tracking_uri)
    exp = experiment_id(client, cfg.tracking.experiment_name)
    end_dead_attempts(work_root(), client)  # what a killed run on this work directory left RUNNING
    parent = client.create_run(
        exp,
        run_name=f"{cfg.name}-{flow_run.get_name() or 'local'}",
        tags={"prefect.flow_run_id": str(flow_run.get_id() or ""), "rlhf.preset": str(preset)},
    )
    parent_id = parent.info.run_id
    tracker = MLflowTracker(parent_id, client=client)
    tracker.log_params(flatten(cfg))
    with attempt(work_root(), parent_id, str(flow_run.get_id() or "") or None):
        return _run_stages(cfg, names, client, parent_id, tracker, logger)


def _run_stages(
    cfg: PipelineConfig, names: list[str], client: MlflowClient, parent_id: str, tracker: MLflowTracker, logger: Any
) -> dict:
    """The stages ``names`` in order under the pipeline's MLflow run ``parent_id``, then the
    report and the model registrations; the run ends FINISHED, or FAILED on an error."""
    c = cfg.model_dump()
    try:
        store = ArtifactStore()
        raw: dict[str, dict] = {}
        for name in names:
            stage = STAGES[name]
            upstream = [raw[dep] for dep in stage.inputs]
            record = run_stage(name, c, upstream, parent_id)
            damage = store.damage(record["key"], record["digest"])
            if damage is not None:
                # A cache entry whose artifact was deleted or damaged since: run the stage again.
                logger.warning(
                    "stage %s: the artifact of its cache entry is damaged: %s; running it again", name, damage
                )
                record = run_stage.with_options(refresh_cache=True)(name, c, upstream, parent_id)
            raw[name] = record
        records = {name: StageRecord.model_validate(r) for name, r in raw.items()}
        for stage, record in records.items():
            client.set_tag(parent_id, f"rlhf.artifact.{stage}", record.uri)
            client.set_tag(parent_id, f"rlhf.stage_run.{stage}", record.mlflow_run_id or "")
            tracker.log_metrics({f"{stage}/{k}": v for k, v in record.metrics.items()})
        if "evaluation" in records:  # the run's report, readable from the parent run in the MLflow UI
            report_dir = store.local_path(records["evaluation"].key, work_root() / "downloads")
            for name in REPORT_FILES:
                if (report_dir / name).is_file():
                    client.log_artifact(parent_id, str(report_dir / name), "report")
        # one registering run at a time: two runs of one model would both find no version with
        # its digest and each add one
        with exclusive_lock(work_root() / "model-registry.lock", what="the model registry"):
            versions = {
                model: register_model_version(
                    client, model, records[stage].mlflow_run_id, records[stage].digest, records[stage].uri
                )
                for stage, model in REGISTERED_MODELS.items()
                if stage in records
            }
        tracker.close()
        client.set_terminated(parent_id, "FINISHED")
    except BaseException:
        tracker.close()
        client.set_terminated(parent_id, "FAILED")
        raise
    logger.info("registered %s", versions)
    return {
        "mlflow_run_id": parent_id,
        "stages": {k: v.model_dump() for k, v in records.items()},
        "registered": versions,
    }
