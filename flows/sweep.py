"""The ``sweep`` flow: a sweep spec's cells (presets x seeds x grid) as ``rlhf`` subflows, then
their summary.

Every cell is one run of the ``rlhf`` flow (:mod:`flows.pipeline`), so stages whose cache
keys are equal across cells (the data and base model of cells that differ in seed; data, SFT
and the reward model of cells that differ only in a PPO setting) run once and are taken from
the cache by the others. A failed cell is recorded and the next one starts; the sweep then
ends failed, naming them, and running it again resumes only what is missing. The summary
(:mod:`rlhf_core.sweep`) goes to an MLflow parent run for the sweep, under which the cells'
runs are nested, and to a Prefect markdown artifact. Deployed as ``rlhf/sweep``
(``infra/prefect.yaml``); ``rlhf sweep SPEC`` runs it in this process.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from rlhf_core.config import ConfigError
from rlhf_core.io import write_json_atomic
from rlhf_core.sweep import (
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
    summary_markdown,
    summary_rows,
)
from tasks.attempts import attempt, end_dead_attempts
from tasks.mlflow_tracking import experiment_id, source_tags, tracking_client
from tasks.stages import preflight, work_root

from .pipeline import rlhf


class SweepError(RuntimeError):
    """Cells of a sweep failed; the others finished and the summary was written."""


@flow(name="rlhf")
def sweep(spec: str = "cpu-seeds", overrides: list[str] | None = None) -> dict:
    """Run the cells of sweep ``spec`` (a name in ``configs/sweeps/`` or a YAML path), each
    with ``overrides`` added, and summarise them.

    Returns:
        ``{"mlflow_run_id", "summary" (the markdown file), "cells" (one row per cell), "flags"}``.

    Raises:
        ConfigError: the spec, or any cell's configuration, does not load (before any cell runs).
        SweepError: cells failed (after the others ran and the summary was written).
    """
    logger = get_run_logger()
    s = load_sweep(spec)
    if overrides:
        s = s.model_copy(update={"overrides": [*s.overrides, *overrides]})
    cells = expand(s)
    configs = cell_configs(s, cells)
    stores = {(c.tracking.tracking_uri, c.tracking.experiment_name) for c in configs.values()}
    if len(stores) > 1:
        raise ConfigError(
            f"sweep {s.name}: its cells track to different MLflow stores or experiments {sorted(map(str, stores))}; "
            "a sweep's runs are nested under one parent run: set tracking.* equal for every preset"
        )
    for cfg in configs.values():
        preflight(cfg)
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


def _run_cells(s: SweepSpec, cells: list[Cell], client: MlflowClient, parent_id: str, out: Path, logger: Any) -> dict:
    """The cells in order as ``rlhf`` subflows under the sweep's MLflow run ``parent_id``, then
    the summary in ``out``, in that run and as a Prefect artifact."""
    try:
        client.log_dict(parent_id, s.model_dump(mode="json"), "sweep.yaml")
        client.log_param(parent_id, "cells", len(cells))
        results = []
        for i, cell in enumerate(cells, 1):
            logger.info("sweep %s: cell %d of %d: %s", s.name, i, len(cells), cell.name)
            run_cell = rlhf.with_options(flow_run_name=cell.name)
            try:
                record = run_cell(
                    preset=cell.preset,
                    overrides=list(cell.overrides),
                    until=s.until,
                    sweep_run_id=parent_id,
                    cell=cell.name,
                )
            except Exception as exc:  # one failed cell does not stop the others
                logger.error("sweep %s: cell %s failed: %s: %s", s.name, cell.name, type(exc).__name__, exc)
                results.append(CellResult(cell, error=f"{type(exc).__name__}: {exc}"))
                continue
            stages = {name: r["metrics"] for name, r in record["stages"].items()}
            results.append(CellResult(cell, stages, record["mlflow_run_id"]))
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
        create_markdown_artifact(
            key="sweep-" + re.sub(r"[^a-z0-9]+", "-", s.name.lower()).strip("-"),
            markdown=summary.read_text(),
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
    return {"mlflow_run_id": parent_id, "summary": str(summary), "cells": rows, "flags": flags}


def write_summary(spec: SweepSpec, results: list[CellResult], flags: dict, out: Path) -> Path:
    """The summary files in ``out``: ``summary.md``, ``cells.json`` and one plot per plotted
    column with values (``ppo_win_rate.png``: Figure 1 across sizes, the ablation within one);
    returns the markdown file."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "cells.json", {"spec": spec.model_dump(mode="json"), "cells": summary_rows(results, flags)})
    for column in ("PPO win rate", "DPO win rate", "RM accuracy", "PPO KL", "PPO response length"):
        if any(r.error is None and not math.isnan(r.value(column)[0]) for r in results):
            plot_sweep(results, column, out / (re.sub(r"[^a-z0-9]+", "_", column.lower()) + ".png"))
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
