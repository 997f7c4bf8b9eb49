"""The ``rlhf`` flow: every stage in order, cached and resumable, tracked in MLflow.

Deployed as ``rlhf/full-pipeline`` (``infra/prefect.yaml``); also runnable in-process with
Prefect's ephemeral mode with ``rlhf run`` (:mod:`flows.cli`).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from functools import partial
from typing import Any

from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from rlhf_core.common.io import exclusive_lock, json_digest
from rlhf_core.config.presets import flatten, load_config
from rlhf_core.config.settings import PipelineConfig
from rlhf_core.run.pipeline import STAGES, stage_entry, stages_until
from tasks.attempts import attempt, end_dead_attempts
from tasks.mlflow_models import MLFLOW_MODELS
from tasks.mlflow_tracking import (
    MLflowTracker,
    dataset_inputs,
    experiment_id,
    register_model_version,
    source_tags,
    tracking_client,
    ui_address,
    ui_link,
)
from tasks.stages import StageRecord, preflight, result_storage, stage_task, work_root
from tasks.storage import ArtifactStore


@flow(name="rlhf")
def rlhf(
    preset: str | None = "cpu-demo",
    overrides: list[str] | None = None,
    until: str | None = None,
    sweep_run_id: str | None = None,
    cell: str | None = None,
) -> dict:
    """Run the pipeline for ``preset`` with ``key=value`` ``overrides``, up to stage ``until``
    (default: every stage); returns each stage's record and the registered model versions.
    As a cell of a sweep (:mod:`flows.sweep`), its MLflow run is nested under the sweep's run
    ``sweep_run_id`` and tagged with the cell's name ``cell``.
    """
    logger = get_run_logger()
    cfg = load_config(preset, overrides or [])
    if until is not None and until not in STAGES:
        raise ValueError(f"until={until!r} is not a stage ({', '.join(STAGES)})")
    names = stages_until(until)  # a DPO-only run trains no reward model, a PPO-only run no DPO
    preflight(cfg, names)  # process count, writable stores, what the stages read: before any stage
    client = tracking_client(cfg.tracking.tracking_uri)
    exp = experiment_id(client, cfg.tracking.experiment_name)
    end_dead_attempts(work_root(), client)  # what a killed run on this work directory left RUNNING
    parent = client.create_run(
        exp,
        run_name=cell or f"{cfg.name}-{flow_run.get_name() or 'local'}",
        tags={
            "prefect.flow_run_id": str(flow_run.get_id() or ""),
            "rlhf.preset": str(preset),
            "rlhf.config_digest": config_digest(cfg),
            **source_tags(),
            **({"mlflow.parentRunId": sweep_run_id, "rlhf.sweep_cell": cell or ""} if sweep_run_id else {}),
        },
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
    try:
        store = ArtifactStore()
        records = stage_records(cfg, names, client, parent_id, store, logger)
        for stage, record in records.items():
            tracker.log_metrics({f"{stage}/{k}": v for k, v in record.metrics.items()})
        if "data" in records:  # the TL;DR splits as the run's dataset inputs
            data_dir = store.local_path(records["data"].key, work_root() / "downloads")
            client.log_inputs(parent_id, datasets=dataset_inputs(data_dir, cfg))
        report = None
        if "evaluation" in records:  # the run's report, naming the run, also in the parent run in the MLflow UI
            from rlhf_core.report.run_report import REPORT_FILES
            from rlhf_core.views.page import stamp_report  # matplotlib: only where a report is stamped

            report_dir = store.local_path(records["evaluation"].key, work_root() / "downloads")
            report = stamp_report(
                report_dir, work_root() / "reports" / parent_id, run_provenance(cfg, client, parent_id), REPORT_FILES
            )
            client.log_artifacts(parent_id, str(report.parent), "report")
        # one registering run at a time: two runs of one model would both find no version with
        # its digest and each add one
        with exclusive_lock(work_root() / "model-registry.lock", what="the model registry"):
            versions = {}
            for stage, (model, save_model) in MLFLOW_MODELS.items():
                if stage not in records:
                    continue
                r = records[stage]
                model_dir = store.local_path(r.key, work_root() / "downloads") / "model"
                data_dir = store.local_path(records["data"].key, work_root() / "downloads")
                write = partial(save_model, model_dir, cfg=cfg, data_dir=data_dir)  # write(path)
                versions[model] = register_model_version(
                    client, model, r.mlflow_run_id, r.digest, r.uri, write, store=store
                )
        tracker.close()
        client.set_terminated(parent_id, "FINISHED")
    except BaseException:
        tracker.close()
        client.set_terminated(parent_id, "FAILED")
        raise
    logger.info("registered %s", versions)
    result = {
        "mlflow_run_id": parent_id,
        "stages": {k: v.model_dump() for k, v in records.items()},
        "registered": versions,
        "report": str(report) if report else None,
    }
    create_markdown_artifact(
        key="rlhf-run-" + re.sub(r"[^a-z0-9]+", "-", cfg.name.lower()).strip("-"),
        markdown=run_markdown(cfg, result, client),
        description=f"rlhf run of preset {cfg.name}: stages, headline, MLflow run and report",
    )
    return result


def stage_records(
    cfg: PipelineConfig, names: list[str], client: MlflowClient, parent_id: str, store: ArtifactStore, logger: Any
) -> dict[str, StageRecord]:
    """Run (or take from the cache) the stages ``names`` in order as Prefect tasks under the MLflow
    run ``parent_id``, each reading its inputs' records; a cache entry whose artifact was deleted
    or damaged since runs its stage again. As each stage ends, ``parent_id`` is tagged with its
    artifact (``rlhf.artifact.<stage>``) and MLflow run (``rlhf.stage_run.<stage>``). Returns each
    stage's record."""
    c = cfg.model_dump()
    storage = result_storage(store)  # cache entries beside the artifacts: every worker finds them
    raw: dict[str, dict] = {}
    for name in names:
        upstream = [raw[dep] for dep in stage_entry(name).inputs]
        task = stage_task(name, cfg, storage)
        record = task(name, c, upstream, parent_id)
        damage = store.damage(record["key"], record["digest"])
        if damage is not None:
            logger.warning("stage %s: the artifact of its cache entry is damaged: %s; running it again", name, damage)
            record = task.with_options(refresh_cache=True)(name, c, upstream, parent_id)
        raw[name] = record
        client.set_tag(parent_id, f"rlhf.artifact.{name}", record["uri"])
        client.set_tag(parent_id, f"rlhf.stage_run.{name}", record.get("mlflow_run_id") or "")
    return {name: StageRecord.model_validate(r) for name, r in raw.items()}


def config_digest(cfg: PipelineConfig) -> str:
    """The digest of the whole configuration (16 hex): equal for equal settings."""
    return json_digest(cfg.model_dump(mode="json"))


def mlflow_run_link(client: MlflowClient, run_id: str) -> str:
    """The run's page in the MLflow UI for a tracking server, in its "Model training" view
    (:func:`tasks.mlflow_tracking.ui_link`), else the run id and its store."""
    address, first = ui_address(client.tracking_uri)
    if not first:
        return ui_link(address, client.get_run(run_id).info.experiment_id, run_id)
    return f"{run_id} in {client.tracking_uri}"


def run_provenance(cfg: PipelineConfig, client: MlflowClient, parent_id: str) -> dict[str, str]:
    """What names a run in its report: preset, config digest, code commit, date, MLflow and
    Prefect runs."""
    tags = source_tags()
    commit = tags.get("mlflow.source.git.commit", "unknown (not a git checkout)")
    if tags.get("rlhf.git.dirty") == "true":
        commit += " (with uncommitted changes)"
    return {
        "preset": cfg.name,
        "config digest": config_digest(cfg),
        "commit": commit,
        "date (UTC)": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "MLflow run": mlflow_run_link(client, parent_id),
        "Prefect flow run": f"{flow_run.get_name() or 'local'} ({flow_run.get_id() or '-'})",
    }


def run_markdown(cfg: PipelineConfig, result: dict, client: MlflowClient) -> str:
    """The Prefect artifact of a finished run: each stage's artifact and MLflow run, the
    evaluation's win rates with their 95% intervals, registered versions, the report and the
    MLflow run."""
    lines = [
        f"# rlhf run: {cfg.name}",
        "",
        f"MLflow run: {mlflow_run_link(client, result['mlflow_run_id'])}",
        "",
        f"Report: {result['report'] or 'none (the run stopped before evaluation)'}",
        "",
        "| stage | artifact | MLflow run |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | `{r['uri']}` | {r['mlflow_run_id']} |" for name, r in result["stages"].items()]
    metrics = result["stages"].get("evaluation", {}).get("metrics", {})
    if metrics:
        from rlhf_core.evaluation.stage import POLICIES  # torch: only where the run was evaluated

        lines += ["", "| policy | win rate vs references [95% CI] | RM score |", "|---|---:|---:|"]
        for policy, _ in POLICIES:
            m = {k.removeprefix(f"eval/{policy}/"): v for k, v in metrics.items() if k.startswith(f"eval/{policy}/")}
            if "win_rate" in m:
                lines.append(
                    f"| {policy} | {m['win_rate']:.1%} [{m.get('win_rate_ci_low', float('nan')):.1%}, "
                    f"{m.get('win_rate_ci_high', float('nan')):.1%}] | {m.get('score', float('nan')):.3f} |"
                )
    if result["registered"]:
        lines += ["", "Registered: " + ", ".join(f"{m} version {v}" for m, v in result["registered"].items())]
    return "\n".join(lines) + "\n"
