"""One stage run, the same for ``rlhf stages`` and the Prefect tasks: reuse a finished output made
with the same key, or run the stage (in this process or as a ``torchrun`` job), then record what
it wrote (``stage.json``: the key, its parts, the manifest) and drop its checkpoints.

The callers differ only around it: ``rlhf stages`` (:func:`rlhf_core.run.cli.run_stages`) runs every
stage into a folder of one run directory under a lock; a Prefect task
(``tasks.stages.rlhf_stage``) runs one into a work directory named by its key, inside an MLflow
run, then moves the output into the artifact store.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

from ..common.io import ManifestCheck, check_manifest, tree_manifest, write_json_atomic
from ..common.memory import release_free_memory
from ..common.tracking import NullTracker, Tracker
from ..config.settings import PipelineConfig
from .pipeline import key_changes, stage_entry

log = logging.getLogger("rlhf")

#: The marker of a stage folder: its key, status (``running`` or ``done``), the key's parts, and
#: once done its time, metrics and manifest.
MARKER = "stage.json"


def read_marker(out: Path) -> dict:
    """The stage folder ``out``'s ``stage.json``, or ``{}`` without one."""
    marker = out / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else {}


class FinishedOutput(NamedTuple):
    """A stage folder's finished output made with the key asked for (:func:`finished_output`):
    its ``stage.json`` (``marker``), what checking its files against the manifest found
    (``check``, ``None`` without a manifest) and why it cannot be reused (``damage``, the first
    problem; ``None`` when it can)."""

    marker: dict
    check: ManifestCheck | None
    damage: str | None


def finished_output(out: Path, key: str) -> FinishedOutput | None:
    """``None`` unless the stage folder ``out`` holds a finished output (``stage.json`` with
    status ``done``) made with key ``key``; else that output and whether its files still match
    the manifest (:func:`rlhf_core.common.io.check_manifest`, stopping at the first problem; only
    files whose size or time differ from the record are read). Writes nothing. How
    :func:`run_stage` decides to reuse a stage and what ``rlhf plan`` reports."""
    marker = read_marker(out)
    if marker.get("key") != key or marker.get("status") != "done":
        return None
    check = check_manifest(out, marker["manifest"], first=True) if "manifest" in marker else None
    damage = "stage.json has no manifest" if check is None else next(iter(check.problems), None)
    return FinishedOutput(marker, check, damage)


def why_it_runs(
    out: Path | None, key: str, parts: dict[str, Any] | None = None, recorded: dict[str, Any] | None = None
) -> str:
    """Why the stage whose folder is ``out`` runs with key ``key`` (``out=None``: no run
    directory): not run yet, unfinished (it resumes), damaged, or made with another key, naming
    the key's parts that changed (:func:`rlhf_core.run.pipeline.key_changes`, from the ``parts`` its
    ``stage.json`` recorded, or else ``recorded``, compared with ``parts``). ``recorded`` is the
    key record of the stage's last finished run kept elsewhere: a Prefect task's folder is
    named by its key, so it never holds another key's ``stage.json``."""
    if out is None:
        return "no run directory"
    found = finished_output(out, key)
    if found is not None:
        return f"its finished output is damaged: {found.damage}"
    marker = read_marker(out)
    if marker.get("key") == key:
        return f"its output is {marker.get('status', 'unfinished')} (resumes from its checkpoints)"
    recorded = marker.get("parts") or recorded
    if not marker and not recorded:
        return "not run yet"
    if parts is not None and recorded:
        changes = key_changes(recorded, parts)
        if changes:
            return "; ".join(changes)
    if not marker:
        return "its earlier finished output, of the same key, is gone"
    return f"its output has another key ({str(marker.get('key'))[:12]}...)"


class PlannedStage(NamedTuple):
    """One line of ``rlhf plan``: a stage, its key (:func:`rlhf_core.run.pipeline.stage_key`),
    whether its finished output will be reused (``cached``) and why it runs or where the
    output is (``reason``)."""

    name: str
    key: str
    cached: bool
    reason: str


class StageRun(NamedTuple):
    """What :func:`run_stage` did: reused a finished output (``reused``) or ran the stage for
    ``seconds``; ``metrics``, the numbers of the stage's result (or of the reused run's)."""

    name: str
    key: str
    out: Path
    reused: bool
    seconds: float
    metrics: dict[str, float]


def _numbers(result: Any) -> dict[str, float]:
    if not isinstance(result, dict):
        return {}
    return {k: float(v) for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_stage(
    name: str,
    cfg: PipelineConfig,
    inputs: list[Path],
    out: Path,
    key: str,
    record: dict[str, Any],
    tracker: Tracker,
    *,
    nproc: int = 1,
    relay: Tracker | None = None,
    overwrite: bool = False,
) -> StageRun:
    """Run stage ``name`` of ``cfg`` into ``out``, or reuse what a finished run with key ``key``
    left there.

    A finished output with the same key whose files match its manifest is reused (the times of
    files found unchanged are recorded, so a copied folder is read once); a damaged one (a
    warning names the file), one made with another key, or any with ``overwrite`` is removed
    and run again; an unfinished one with the same key resumes from its checkpoints. The stage
    runs in this process with ``tracker``, or, with ``nproc`` above 1 for a data-parallel stage
    (:data:`rlhf_core.run.launch.DATA_PARALLEL`), as a ``torchrun`` job whose rank 0 writes
    ``out/metrics.jsonl`` and whose records are relayed to ``relay``. Memory it freed is given
    back after it, failed or not. ``stage.json`` records ``key``, its parts (``record``,
    :func:`rlhf_core.run.pipeline.key_record`), and once done the time, the result's numbers and
    the manifest of every file but the checkpoints, which are then deleted.

    Raises:
        LaunchError: a ``torchrun`` job failed; whatever the stage raises.
    """
    from .launch import DATA_PARALLEL, launch_torchrun

    marker = read_marker(out)
    found = None if overwrite else finished_output(out, key)
    if found is not None and found.damage is None and found.check is not None:
        if found.check.restamped:  # unchanged files with new times (a copy): not read next time
            write_json_atomic(out / MARKER, {**marker, "manifest": found.check.restamp(marker["manifest"])})
        log.info("stage %s: finished earlier with the same config and code, reused (%s)", name, out)
        return StageRun(name, key, out, True, 0.0, marker.get("metrics", {}))
    if found is not None:
        log.warning("stage %s: its finished output in %s is damaged (%s); running it again", name, out, found.damage)
        overwrite = True
    if out.exists() and (marker.get("key") != key or overwrite):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / MARKER, {"key": key, "status": "running", "parts": record})
    log.info("stage %s: running into %s", name, out)
    start = time.perf_counter()
    try:
        if nproc > 1 and name in DATA_PARALLEL:
            result = launch_torchrun(name, cfg, inputs, out, nproc, relay or NullTracker())
        else:
            result = stage_entry(name).run(cfg, inputs, out, tracker)
    finally:
        release_free_memory(after=name)  # the next stage (or a retry) starts from what is live, not this one's peak
    seconds = time.perf_counter() - start
    metrics = _numbers(result)
    # what a later run checks before reusing the output: every file's size, time and SHA-256
    manifest = tree_manifest(out, exclude=("checkpoints", MARKER))
    done = {"key": key, "status": "done", "seconds": round(seconds, 3), "metrics": metrics, "parts": record}
    write_json_atomic(out / MARKER, {**done, "manifest": manifest})
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # finished: nothing to resume from
    log.info("stage %s: done in %.1f s", name, seconds)
    return StageRun(name, key, out, False, seconds, metrics)
