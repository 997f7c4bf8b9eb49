"""The ``rlhf`` flow's evaluation of any policy: released checkpoints, another run's policy, a
registered model, judged against the TL;DR references as the pipeline's policies are.

Deployed as ``rlhf/evaluate`` (``infra/prefect.yaml``); run in-process by ``rlhf evaluate --preset
NAME --policy SOURCE [--policy SOURCE ...] [--reward SOURCE]`` (:mod:`flows.cli`). The preset's
data and base model stages (cached, as in any run) give the prompts, the references and the
tokenizer; the stage ``policy_eval`` (:data:`rlhf_core.run.pipeline.ON_DEMAND`) samples, judges and
measures the policies, cached by their fingerprints (files' digests, or hub id and revision), and
writes the report. One MLflow run holds it all: the policies by their sources as parameters,
their metrics (``eval/{key}/...``, the key from
:func:`rlhf_core.config.settings.policy_key`) and the report.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from rlhf_core.config.presets import flatten, load_config
from rlhf_core.config.settings import PipelineConfig, policy_key
from tasks.attempts import attempt, end_dead_attempts
from tasks.mlflow_models import download_registered_model
from tasks.mlflow_tracking import MLflowTracker, experiment_id, source_tags, tracking_client
from tasks.stages import preflight, work_root
from tasks.storage import ArtifactStore

from .pipeline import config_digest, mlflow_run_link, run_provenance, stage_records

#: The stages of an evaluation of policies, in order.
EVALUATE_STAGES = ["data", "base_model", "policy_eval"]


def with_policies(
    cfg: PipelineConfig, policies: list[str], reward: str | None, client: Any
) -> tuple[PipelineConfig, dict[str, str]]:
    """``cfg`` with ``eval.policies`` set to ``policies`` (each named by its source; unset: the
    preset's own) and ``eval.reward_model`` to ``reward`` (when given); a registered model
    (``models:/NAME@ALIAS``) among them is downloaded under the work directory
    (:func:`tasks.mlflow_models.download_registered_model`) and read from there.

    Returns:
        ``(the config, {name: the local directory of each registered model})``.

    Raises:
        ValueError: no policy at all; ModelSourceError: a registered model cannot be found.
    """
    chosen = {source: source for source in policies} or dict(cfg.eval.policies)
    if not chosen:
        raise ValueError(
            "rlhf evaluate needs a policy: --policy SOURCE (a directory, a hub id[@REVISION], models:/NAME@ALIAS)"
        )
    downloads = work_root() / "downloads" / "registered"
    registered = {
        name: str(download_registered_model(client, source, downloads))
        for name, source in chosen.items()
        if source.startswith("models:/")
    }
    reward = reward if reward is not None else cfg.eval.reward_model
    if reward and reward.startswith("models:/"):
        registered[reward] = str(download_registered_model(client, reward, downloads))
    tree = cfg.model_dump()
    tree["eval"]["policies"] = {name: registered.get(name, source) for name, source in chosen.items()}
    tree["eval"]["reward_model"] = registered.get(reward, reward) if reward else None
    return PipelineConfig.model_validate(tree), registered


@flow(name="rlhf")
def evaluate(
    preset: str | None = "cpu-demo",
    policies: list[str] | None = None,
    reward: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Judge ``policies`` (sources: local directories, hub ids with an optional ``@REVISION``,
    ``models:/NAME@ALIAS``) on the evaluation prompts of ``preset`` with ``key=value``
    ``overrides``, scored by the reward model ``reward`` when given (a directory, ``model:SOURCE``
    or ``models:/NAME@ALIAS``); returns the MLflow run, each stage's record, the report and each
    policy's metric key.
    """
    logger = get_run_logger()
    cfg = load_config(preset, overrides or [])
    client = tracking_client(cfg.tracking.tracking_uri)
    cfg, registered = with_policies(cfg, list(policies or []), reward, client)
    preflight(cfg, EVALUATE_STAGES)
    exp = experiment_id(client, cfg.tracking.experiment_name)
    end_dead_attempts(work_root(), client)
    parent = client.create_run(
        exp,
        run_name=f"evaluate-{cfg.name}-{flow_run.get_name() or 'local'}",
        tags={
            "prefect.flow_run_id": str(flow_run.get_id() or ""),
            "rlhf.preset": str(preset),
            "rlhf.command": "evaluate",
            "rlhf.config_digest": config_digest(cfg),
            **source_tags(),
        },
    )
    parent_id = parent.info.run_id
    tracker = MLflowTracker(parent_id, client=client)
    keys = {name: policy_key(name) for name in cfg.eval.policies}
    params = {k: v for k, v in flatten(cfg).items() if not k.startswith("eval.policies")}
    tracker.log_params(params | {f"policy.{key}": name for name, key in keys.items()})
    with attempt(work_root(), parent_id, str(flow_run.get_id() or "") or None):
        try:
            store = ArtifactStore()
            records = stage_records(cfg, EVALUATE_STAGES, client, parent_id, store, logger)
            tracker.log_metrics(records["policy_eval"].metrics)
            report = _stamped_report(cfg, client, parent_id, records["policy_eval"].key, store)
            tracker.close()
            client.set_terminated(parent_id, "FINISHED")
        except BaseException:
            tracker.close()
            client.set_terminated(parent_id, "FAILED")
            raise
    result = {
        "mlflow_run_id": parent_id,
        "stages": {k: v.model_dump() for k, v in records.items()},
        "report": str(report),
        "policies": keys,
        "registered": registered,
    }
    create_markdown_artifact(
        key="rlhf-evaluate",
        markdown=evaluate_markdown(result, client),
        description=f"rlhf evaluate of {len(keys)} policies on preset {cfg.name}: win rates and the report",
    )
    return result


def _stamped_report(cfg: PipelineConfig, client: Any, parent_id: str, key: str, store: ArtifactStore):
    """The stage's report stamped with the run that made it, logged under ``report/`` in the run."""
    from rlhf_core.report.policy_report import POLICY_REPORT_FILES
    from rlhf_core.views.page import stamp_report  # matplotlib: only where a report is stamped

    report_dir = store.local_path(key, work_root() / "downloads")
    report = stamp_report(
        report_dir, work_root() / "reports" / parent_id, run_provenance(cfg, client, parent_id), POLICY_REPORT_FILES
    )
    client.log_artifacts(parent_id, str(report.parent), "report")
    return report


def evaluate_markdown(result: dict, client: Any) -> str:
    """The Prefect artifact of a finished evaluation: each policy's win rate with its 95% interval,
    ROUGE-L and mean length, the MLflow run and the report."""
    metrics = result["stages"]["policy_eval"]["metrics"]
    lines = [
        "# rlhf evaluate",
        "",
        f"MLflow run: {mlflow_run_link(client, result['mlflow_run_id'])}",
        "",
        f"Report: {result['report']}",
        "",
        "| policy | win rate vs reference [95% CI] | ROUGE-L | tokens |",
        "|---|---|---:|---:|",
    ]
    for name, key in result["policies"].items():
        m = {k.removeprefix(f"eval/{key}/"): v for k, v in metrics.items() if k.startswith(f"eval/{key}/")}
        lines.append(
            f"| {name} | {m['win_rate']:.1%} [{m['win_rate_ci_low']:.1%}, {m['win_rate_ci_high']:.1%}] "
            f"| {m['rougeL']:.3f} | {m['response_tokens']:.1f} |"
        )
    return "\n".join(lines) + "\n"
