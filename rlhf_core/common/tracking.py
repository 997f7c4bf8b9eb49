"""The one small interface through which stages report metrics, tables and files.

``rlhf_core`` never imports MLflow: stages take any object with the :class:`Tracker`
methods. :class:`JsonlTracker` (the command line's default) appends to a local file;
the orchestration layer passes an MLflow-backed tracker.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tracker(Protocol):
    """What a stage may report. Metric keys are flat strings such as ``eval/accuracy``."""

    def log_params(self, params: dict[str, Any]) -> None:
        """Record configuration values (flat ``{"ppo.kl_coef": 0.05}``)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record scalar metrics at an optional integer step."""

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Record a table (a list of rows with the same keys), e.g. generated samples."""

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Record a finished file (plot, report) produced by the stage."""


class NullTracker:
    """Discards everything."""

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        pass

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        pass


class JsonlTracker:
    """Appends every record as one JSON line to ``path`` (``metrics.jsonl`` in a stage directory).

    Each line is ``{"time": seconds since epoch, "kind": "params"|"metrics"|"table"|"artifact", ...}``.
    Non-finite metric values are written as strings (``"nan"``, ``"inf"``).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _write(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    def log_params(self, params: dict[str, Any]) -> None:
        self._write({"kind": "params", "params": params})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in ((k, float(v)) for k, v in metrics.items())}
        self._write({"kind": "metrics", "step": step, "metrics": clean})

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        self._write({"kind": "table", "name": name, "rows": rows})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self._write({"kind": "artifact", "path": str(path), "artifact_path": artifact_path})


#: The metric a trainer logs, at step ``s``, when it resumes from its checkpoint after ``s`` steps.
RESUME_METRIC = "resume/from_step"


def read_metrics(path: str | os.PathLike) -> list[tuple[int | None, dict[str, float]]]:
    """The ``(step, metrics)`` records of a :class:`JsonlTracker` file, in order, as the run
    that finished would have written them: at a resume (a :data:`RESUME_METRIC` record at step
    ``s``) the records of steps after ``s`` from the interrupted attempt are dropped, since the
    resumed attempt does those steps again; the marker itself is not returned."""
    out: list[tuple[int | None, dict[str, float]]] = []
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            if rec["kind"] != "metrics":
                continue
            metrics = {k: float(v) for k, v in rec["metrics"].items()}
            if RESUME_METRIC in metrics:
                resumed_at = metrics[RESUME_METRIC]
                out = [(step, m) for step, m in out if step is None or step <= resumed_at]
                continue
            out.append((rec["step"], metrics))
    return out


class TeeTracker:
    """Sends every record to each of ``trackers`` in turn (e.g. MLflow and a local ``metrics.jsonl``)."""

    def __init__(self, *trackers: Tracker):
        self.trackers = trackers

    def log_params(self, params: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for t in self.trackers:
            t.log_metrics(metrics, step=step)

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        for t in self.trackers:
            t.log_table(name, rows)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        for t in self.trackers:
            t.log_artifact(path, artifact_path)


def replay(path: str | os.PathLike, tracker: Tracker, offset: int = 0) -> int:
    """Send the records of a :class:`JsonlTracker` file, from byte ``offset`` on, to ``tracker``
    (e.g. what a ``torchrun`` job's rank 0 wrote, into MLflow). Returns the end offset."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    for line in data.decode().splitlines():
        rec = json.loads(line)
        kind = rec.get("kind")
        if kind == "params":
            tracker.log_params(rec["params"])
        elif kind == "metrics":
            tracker.log_metrics({k: float(v) for k, v in rec["metrics"].items()}, step=rec.get("step"))
        elif kind == "table":
            tracker.log_table(rec["name"], rec["rows"])
        elif kind == "artifact":
            tracker.log_artifact(rec["path"], rec.get("artifact_path"))
    return offset + len(data)
