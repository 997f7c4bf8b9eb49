"""The ``sweep`` flow: a sweep spec's cells (presets x seeds x grid) as ``rlhf`` subflows, then
their summary.

Every cell is one run of the ``rlhf`` flow (:mod:`flows.pipeline`), so stages whose cache
keys are equal across cells (the data and base model of cells that differ in seed; data, SFT
and the reward model of cells that differ only in a PPO setting) run once and are taken from
the cache by the others. With ``max_concurrent`` 1 the cells run one after the other in this
process, as subflows. With more, each cell is a run of the pipeline's deployment
(:data:`PIPELINE_DEPLOYMENT`) that the workers pick up, each in its own process (torch's
random state and the accelerator are per process), at most ``max_concurrent`` at a time,
linked to this flow run as subflows; a stage that two cells share runs in one of them while
the other waits for its record (``tasks.stages.rlhf_stage``'s lock), and Prefect's tag
concurrency limits (``gpu``, ``judge-api``: the spec's ``concurrency_limits``) bound how many
stage tasks hold an accelerator or call the judge at once, over all workers. A failed cell is
recorded and the others go on; the sweep then ends failed, naming them, and running it again
resumes only what is missing. The summary
(:mod:`rlhf_core.run.sweep`) goes to an MLflow parent run for the sweep, under which the cells'
runs are nested, and to a Prefect markdown artifact. Deployed as ``rlhf/sweep``
(``infra/prefect.yaml``); ``rlhf sweep SPEC`` runs it in this process.
"""

from __future__ import annotations

import contextvars
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from rlhf_core.common.io import write_json_atomic
from rlhf_core.config.settings import ConfigError
from rlhf_core.run.pipeline import STAGES, stages_until
from rlhf_core.run.sweep import (
    COLUMNS,
    Cell,
    CellResult,
    SweepSpec,
    cell_configs,
    expand,
    group_stats,
    health_flags,
    load_sweep,
    plot_sweep,
    plot_win_rate_by_length_sweep,
    summary_markdown,
    summary_rows,
)
from tasks.attempts import attempt, end_dead_attempts
from tasks.mlflow_tracking import compare_link, experiment_id, source_tags, tracking_client, ui_address
from tasks.stages import preflight, work_root

from .pipeline import rlhf


class SweepError(RuntimeError):
    """Cells of a sweep failed; the others finished and the summary was written."""


#: The deployment that runs a cell when cells run concurrently (infra/prefect.yaml).
PIPELINE_DEPLOYMENT = "rlhf/full-pipeline"
#: What a cell's flow run takes from the sweep's environment (its job variables): where stages,
#: artifacts, cache entries and tracking live, and the offline data. Credentials are not passed
#: on: the workers have their own.
FORWARDED_ENV = (
    "RLHF_WORK_DIR",
    "RLHF_ARTIFACT_ROOT",
    "RLHF_RESULT_STORAGE",
    "RLHF_JUDGE_CACHE",
    "RLHF_TLDR_DIR",
    "MLFLOW_TRACKING_URI",
)


@flow(name="rlhf")
def sweep(spec: str = "cpu-seeds", overrides: list[str] | None = None, max_concurrent: int | None = None) -> dict:
    """Run the cells of sweep ``spec`` (a name in ``configs/sweeps/`` or a YAML path), each
    with ``overrides`` added, ``max_concurrent`` at a time (default: the spec's), and
    summarise them.

    Returns:
        ``{"mlflow_run_id", "summary" (the markdown file), "cells" (one row per cell), "flags",
        "compare" (the cells side by side in the MLflow UI: :func:`cells_compare_link`)}``.

    Raises:
        ConfigError: the spec, or any cell's configuration, does not load (before any cell runs).
        SweepError: cells failed (after the others ran and the summary was written).
    """
    logger = get_run_logger()
    s = load_sweep(spec)
    if overrides:
        s = s.model_copy(update={"overrides": [*s.overrides, *overrides]})
    if max_concurrent is not None:
        s = SweepSpec.model_validate(s.model_dump() | {"max_concurrent": max_concurrent})
    cells = expand(s)
    configs = cell_configs(s, cells)
    stores = {(c.tracking.tracking_uri, c.tracking.experiment_name) for c in configs.values()}
    if len(stores) > 1:
        raise ConfigError(
            f"sweep {s.name}: its cells track to different MLflow stores or experiments {sorted(map(str, stores))}; "
            "a sweep's runs are nested under one parent run: set tracking.* equal for every preset"
        )
    for cfg in configs.values():
        preflight(cfg, stages_until(s.until))
    if s.max_concurrent > 1:
        check_pipeline_deployment(s)
    ensure_concurrency_limits(s.concurrency_limits, logger)
    ((uri, experiment),) = stores
    client = tracking_client(uri)
    end_dead_attempts(work_root(), client)  # what a killed sweep (or cell) on this work directory left RUNNING
    parent = client.create_run(
        experiment_id(client, experiment),
        run_name=f"sweep-{s.name}-{flow_run.get_name() or 'local'}",
        tags={
            "rlhf.sweep": s.name,
            "prefect.flow_run_id": str(flow_run.get_id() or ""),
            **source_tags(),
            "mlflow.source.name": "flows/sweep.py:sweep",
        },
    )
    parent_id = parent.info.run_id
    out = work_root() / "sweeps" / parent_id
    with attempt(work_root(), parent_id, str(flow_run.get_id() or "") or None):
        return _run_cells(s, cells, client, parent_id, out, logger)


def ensure_concurrency_limits(limits: dict[str, int], logger: Any) -> None:
    """Set each tag's concurrency limit (``{tag: slots}``) on the Prefect server where it has
    none; an existing limit is kept, and logged."""
    if not limits:
        return
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for tag, slots in limits.items():
            try:
                found = client.read_concurrency_limit_by_tag(tag)
                logger.info("tag %r: the server's concurrency limit of %d is kept", tag, found.concurrency_limit)
            except ObjectNotFound:
                client.create_concurrency_limit(tag=tag, concurrency_limit=slots)
                logger.info("tag %r: concurrency limit set to %d", tag, slots)


def check_pipeline_deployment(s: SweepSpec) -> None:
    """Raise :class:`ConfigError` unless the Prefect server has :data:`PIPELINE_DEPLOYMENT`,
    which runs the cells of a sweep with ``max_concurrent`` above 1."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    def missing(server: str) -> ConfigError:
        return ConfigError(
            f"sweep {s.name}: max_concurrent={s.max_concurrent} runs each cell as a run of the deployment "
            f"{PIPELINE_DEPLOYMENT}, which {server} does not have: deploy it and start workers "
            "(`make stack-up`), or run the cells one at a time (max_concurrent 1)"
        )

    if not PREFECT_API_URL.value():  # no server is set: the temporary one started here has no workers
        raise missing("Prefect's temporary server (PREFECT_API_URL is not set)")
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(PIPELINE_DEPLOYMENT)
        except ObjectNotFound:
            raise missing(f"this Prefect server ({client.api_url})") from None


def run_cell(s: SweepSpec, cell: Cell, parent_id: str, client: MlflowClient, logger: Any) -> CellResult:
    """One cell: an ``rlhf`` subflow in this process (``max_concurrent`` 1) or a run of
    :data:`PIPELINE_DEPLOYMENT` on a worker, waited for. A failure is recorded, not raised."""
    logger.info("sweep %s: cell %s starts", s.name, cell.name)
    params = dict(preset=cell.preset, overrides=list(cell.overrides), until=s.until, sweep_run_id=parent_id)
    try:
        if s.max_concurrent == 1:
            record = rlhf.with_options(flow_run_name=cell.name)(**params, cell=cell.name)
            stages = {name: r["metrics"] for name, r in record["stages"].items()}
            return CellResult(cell, stages, record["mlflow_run_id"])
        from prefect.deployments import run_deployment

        env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
        run = run_deployment(
            PIPELINE_DEPLOYMENT,
            parameters={**params, "cell": cell.name},
            flow_run_name=cell.name,
            job_variables={"env": {"PREFECT_LOGGING_EXTRA_LOGGERS": "rlhf_core", **env}},
            poll_interval=2,
        )
        if not run.state or not run.state.is_completed():
            state = run.state.name if run.state else "unknown"
            raise RuntimeError(
                f"flow run {run.name} ({run.id}) ended {state}: {run.state.message if run.state else ''}"
            )
        return cell_result_from_mlflow(client, cell, parent_id)
    except Exception as exc:  # one failed cell does not stop the others
        logger.error("sweep %s: cell %s failed: %s: %s", s.name, cell.name, type(exc).__name__, exc)
        return CellResult(cell, error=f"{type(exc).__name__}: {exc}")


def cell_result_from_mlflow(client: MlflowClient, cell: Cell, parent_id: str) -> CellResult:
    """A finished cell's stage metrics as its MLflow run holds them (``stage/metric``, logged by
    the pipeline flow from the stage records), for a cell run in another process.

    Raises:
        RuntimeError: no finished run of the cell is nested under ``parent_id``.
    """
    exp = client.get_run(parent_id).info.experiment_id
    runs = client.search_runs(
        [exp],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and tags.`rlhf.sweep_cell` = '{cell.name}' "
        "and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise RuntimeError(f"cell {cell.name}: no finished MLflow run under the sweep's run {parent_id}")
    stages: dict[str, dict[str, float]] = {}
    for key, value in runs[0].data.metrics.items():
        stage, _, name = key.partition("/")
        if stage in STAGES:
            stages.setdefault(stage, {})[name] = value
    return CellResult(cell, stages, runs[0].info.run_id)


def _run_cells(s: SweepSpec, cells: list[Cell], client: MlflowClient, parent_id: str, out: Path, logger: Any) -> dict:
    """The cells (:func:`run_cell`), ``s.max_concurrent`` at a time, under the sweep's MLflow
    run ``parent_id``; then the summary in ``out``, in that run and as a Prefect artifact."""
    try:
        client.log_dict(parent_id, s.model_dump(mode="json"), "sweep.yaml")
        client.log_param(parent_id, "cells", len(cells))
        client.log_param(parent_id, "max_concurrent", s.max_concurrent)
        logger.info("sweep %s: %d cells, %d at a time", s.name, len(cells), s.max_concurrent)
        with ThreadPoolExecutor(s.max_concurrent, thread_name_prefix="cell") as pool:
            # each thread starts its cell in a copy of this flow run's context, so that Prefect
            # links the cell's flow run to this one
            futures = [
                pool.submit(contextvars.copy_context().run, run_cell, s, c, parent_id, client, logger) for c in cells
            ]
            results = [f.result() for f in futures]
        flags = health_flags(results, s.health)
        summary = write_summary(s, results, flags, out)
        client.log_artifacts(parent_id, str(out), "summary")
        rows = summary_rows(results, flags)
        client.log_table(
            parent_id, {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}, "cells.json"
        )
        metrics = {
            "cells_finished": sum(r.error is None for r in results),
            "cells_failed": sum(r.error is not None for r in results),
            "cells_flagged": len(flags),
        }
        for group in dict.fromkeys(r.cell.group for r in results):
            members = [r for r in results if r.cell.group == group and r.error is None]
            for column, *_ in COLUMNS:
                stats = group_stats(members, column)
                if stats["n"]:
                    name = metric_name(f"{group}/{column}")
                    metrics[f"{name}/mean"] = float(stats["mean"])
                    if not math.isnan(stats["std"]):
                        metrics[f"{name}/std"] = float(stats["std"])
        client.log_batch(parent_id, metrics=[_metric(k, v) for k, v in metrics.items()])
        compare = cells_compare_link(client, [r.mlflow_run_id for r in results if r.mlflow_run_id])
        logger.info("sweep %s: the cells side by side in the MLflow UI: %s", s.name, compare)
        create_markdown_artifact(
            key="sweep-" + re.sub(r"[^a-z0-9]+", "-", s.name.lower()).strip("-"),
            markdown=summary.read_text() + f"\n[The cells side by side in the MLflow UI]({compare})\n",
            description=f"sweep {s.name}: {len(cells)} cells, mean and spread over seeds",
        )
        failed = [r for r in results if r.error is not None]
        client.set_terminated(parent_id, "FAILED" if failed else "FINISHED")
    except BaseException:
        client.set_terminated(parent_id, "FAILED")
        raise
    if failed:
        raise SweepError(
            f"sweep {s.name}: {len(failed)} of {len(cells)} cells failed ({'; '.join(r.cell.name for r in failed)}); "
            f"the others finished and the summary is in {summary}. Run the sweep again to resume the failed cells"
        )
    return {"mlflow_run_id": parent_id, "summary": str(summary), "cells": rows, "flags": flags, "compare": compare}


def cells_compare_link(client: MlflowClient, run_ids: list[str]) -> str:
    """The MLflow UI's compare view of the cells' runs ``run_ids``
    (:func:`tasks.mlflow_tracking.compare_link`); for a local store, preceded by the
    ``mlflow ui`` command that serves it."""
    address, first = ui_address(client.tracking_uri)
    experiment = client.get_run(run_ids[0]).info.experiment_id if run_ids else "0"
    link = compare_link(address, experiment, run_ids)
    return f"{first}, then {link}" if first else link


def write_summary(spec: SweepSpec, results: list[CellResult], flags: dict, out: Path) -> Path:
    """The summary files in ``out``: ``summary.md``, ``cells.json``, one plot per plotted
    column with values (``ppo_win_rate.png``: Figure 1 across sizes, the ablation within one)
    and every cell's policies' win rate by summary length (``win_rate_by_length.png``: Figures 7
    and 8); returns the markdown file."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "cells.json", {"spec": spec.model_dump(mode="json"), "cells": summary_rows(results, flags)})
    for column in (
        "PPO win rate",
        "DPO win rate",
        "RM accuracy",
        "RM in-distribution accuracy",
        "PPO score gain vs SFT",
        "PPO KL",
        "PPO response length",
    ):
        if any(r.error is None and not math.isnan(r.value(column)[0]) for r in results):
            plot_sweep(results, column, out / (re.sub(r"[^a-z0-9]+", "_", column.lower()) + ".png"))
    plot_win_rate_by_length_sweep(results, out / "win_rate_by_length.png")
    path = out / "summary.md"
    path.write_text(summary_markdown(spec, results, flags))
    return path


def metric_name(text: str) -> str:
    """``text`` as an MLflow metric name (letters, digits, ``_ - . / space``)."""
    return re.sub(r"[^A-Za-z0-9_\-. /]+", "_", text)


def _metric(key: str, value: float):
    import time

    from mlflow.entities import Metric

    return Metric(key, float(value), int(time.time() * 1000), 0)


if __name__ == "__main__":
    print(json.dumps(sweep(), indent=2))
