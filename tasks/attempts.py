"""Pipeline runs whose process died (``kill -9``, a lost machine): ended on the next run.

A running ``rlhf`` flow holds a lock file named by its MLflow parent run and Prefect flow
run under ``$RLHF_WORK_DIR/attempts/``. The next flow on the same work directory takes every
lock no live process holds and ends what the dead attempt left open: its MLflow parent run
becomes ``KILLED`` and its Prefect flow run ``Crashed``. (Stage runs are ended the same way
by the stage that runs again: :func:`tasks.mlflow_tracking.start_stage_run`.)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from rlhf_core.common.io import LockHeldError, exclusive_lock

log = logging.getLogger(__name__)


def _path(root: Path, mlflow_run_id: str, flow_run_id: str | None) -> Path:
    return root / "attempts" / f"{mlflow_run_id}__{flow_run_id or 'none'}.lock"


@contextlib.contextmanager
def attempt(root: Path, mlflow_run_id: str, flow_run_id: str | None) -> Iterator[None]:
    """Mark this pipeline run as alive for the ``with`` block (a lock only its process holds)."""
    path = _path(root, mlflow_run_id, flow_run_id)
    with exclusive_lock(path, what=f"pipeline run {mlflow_run_id}", wait=False):
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # while still held: no one can take it for a dead run


def end_dead_attempts(root: Path, client: MlflowClient) -> list[str]:
    """End the runs of attempts whose process died; returns their MLflow run ids."""
    ended = []
    for path in sorted((root / "attempts").glob("*.lock")):
        mlflow_run_id, _, flow_run_id = path.stem.partition("__")
        try:
            with exclusive_lock(path, what=f"pipeline run {mlflow_run_id}", wait=False):
                if not path.exists():  # its run finished and removed it while we waited to look
                    continue
                try:
                    if client.get_run(mlflow_run_id).info.status == "RUNNING":
                        client.set_terminated(mlflow_run_id, "KILLED")
                except MlflowException:  # tracked elsewhere (another tracking URI): not ours to end
                    pass
                if flow_run_id != "none":
                    _crash_flow_run(flow_run_id)
                path.unlink(missing_ok=True)
                ended.append(mlflow_run_id)
                log.warning("pipeline run %s (flow run %s) had died; marked KILLED", mlflow_run_id, flow_run_id)
        except LockHeldError:
            continue  # alive: another run on this work directory
    return ended


def _crash_flow_run(flow_run_id: str) -> None:
    from prefect import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and not run.state.is_final():
            client.set_flow_run_state(
                flow_run_id, Crashed(message="its process died; ended by the next run"), force=True
            )
