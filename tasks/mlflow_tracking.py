"""An MLflow-backed :class:`rlhf_core.common.tracking.Tracker`.

Metrics are buffered and sent with ``log_batch`` (at most every ``flush_seconds`` or
``flush_size`` values, and on :meth:`MLflowTracker.close`), so a training loop never waits
on the tracking server step by step. Tables and files are logged as run artifacts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from rlhf_core.common.io import exclusive_lock
from rlhf_core.config.data_settings import DATA_KINDS

from .storage import ArtifactStore

#: MLflow's limit on a parameter value's length.
MAX_PARAM_LENGTH = 6000
#: Config key names (last dotted part) whose values are never sent to MLflow.
SECRET_NAMES = {"api_key", "secret", "password", "hf_token", "access_token", "aws_secret_access_key"}
SECRET_SUFFIXES = ("_api_key", "_secret", "_password", "_access_token")


#: MLflow's characters for metric and parameter names (those of every platform it runs on: no
#: colon on Windows) and its limit on their length.
_MLFLOW_NAME_CHARS = re.compile(r"[^/\w.\- ]")
MAX_NAME_LENGTH = 250


def mlflow_key(name: str) -> str:
    """``name`` as MLflow accepts a metric or parameter name, from ``name`` alone (the same in any
    run, whatever else is logged). A name MLflow accepts is returned as it is. Another is made
    acceptable: each character MLflow refuses as ``_``, read as a path, as MLflow also does,
    without empty, ``.`` or ``..`` parts, cut to fit 250 characters, then ``_`` and the first 7
    hex digits of the SHA-256 of ``name``, so that two names mapped alike stay apart
    (``train/lr(1e-3)`` is ``train/lr_1e-3__ff3dfe4``, never ``train/lr_1e-3_`` itself)."""
    mapped = _MLFLOW_NAME_CHARS.sub("_", name)
    if posixpath.normpath(mapped) != mapped or mapped.startswith(("/", "..")) or mapped in ("", "."):
        mapped = "/".join(part for part in mapped.split("/") if part not in ("", ".", "..")) or "_"
    if mapped == name and len(name) <= MAX_NAME_LENGTH:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:7]
    return f"{mapped[: MAX_NAME_LENGTH - 8]}_{digest}"


def _is_secret(key: str) -> bool:
    last = key.rsplit(".", 1)[-1].lower()
    return last in SECRET_NAMES or last.endswith(SECRET_SUFFIXES)


class MLflowTracker:
    """Sends a stage's params, metrics, tables and files to one MLflow run.

    Args:
        run_id: the (already created) MLflow run.
        client: an ``MlflowClient``; default: one for ``MLFLOW_TRACKING_URI``.
    """

    def __init__(
        self, run_id: str, client: MlflowClient | None = None, flush_seconds: float = 5.0, flush_size: int = 200
    ):
        self.run_id = run_id
        self.client = client or MlflowClient()
        self.flush_seconds = flush_seconds
        self.flush_size = flush_size
        self._buffer: list[Metric] = []
        self._last_flush = time.monotonic()
        self._names: dict[str, str] = {}  # name sent (mlflow_key) -> name given

    def _key(self, name: str) -> str:
        """The name sent for ``name`` (:func:`mlflow_key`).

        Raises:
            ValueError: another name given in this run maps to the same one (two names that
                differ only in what MLflow refuses and share the 7 hex digits of their digest).
        """
        key = mlflow_key(name)
        other = self._names.setdefault(key, name)
        if other != name:
            raise ValueError(f"metric or parameter names {other!r} and {name!r} both map to {key!r} in MLflow")
        return key

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params as strings (values cut to MLflow's limit) under names MLflow accepts
        (:func:`mlflow_key`); secret-looking keys are left out."""
        items = [Param(self._key(k), str(v)[:MAX_PARAM_LENGTH]) for k, v in params.items() if not _is_secret(k)]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100], synchronous=True)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Buffer finite metrics at ``step`` under names MLflow accepts (:func:`mlflow_key`);
        non-finite values are skipped: MLflow rejects them."""
        now_ms = int(time.time() * 1000)
        for key, value in metrics.items():
            value = float(value)
            if math.isfinite(value):
                self._buffer.append(Metric(self._key(key), value, now_ms, step or 0))
        if len(self._buffer) >= self.flush_size or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Send buffered metrics now."""
        while self._buffer:
            chunk, self._buffer = self._buffer[:1000], self._buffer[1000:]
            self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)
        self._last_flush = time.monotonic()

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Log rows as the MLflow table ``tables/{name}.json`` (``MlflowClient.log_table``: shown
        in the UI's artifact view, read back with ``mlflow.load_table``); the columns are the
        keys of the rows in first-seen order, a missing cell is null."""
        self.flush()
        columns = list(dict.fromkeys(key for row in rows for key in row))
        if columns:
            self.client.log_table(
                self.run_id, {c: [row.get(c) for row in rows] for c in columns}, f"tables/{name}.json"
            )

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Log a file or directory as run artifacts."""
        self.flush()
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_json(self, data: Any, artifact_file: str) -> None:
        """Log a JSON-serialisable object as an artifact file."""
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / Path(artifact_file).name
            target.write_text(json.dumps(data, indent=2, default=str))
            parent = str(Path(artifact_file).parent)
            self.client.log_artifact(self.run_id, str(target), None if parent == "." else parent)

    def close(self) -> None:
        """Flush what is buffered."""
        self.flush()


def tracking_client(uri: str | None = None) -> MlflowClient:
    """A client for ``uri`` (the setting ``tracking.tracking_uri``), else ``MLFLOW_TRACKING_URI``,
    else a local SQLite store ``./mlflow.db``."""
    import mlflow

    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"
    mlflow.set_tracking_uri(uri)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    # A client's stores create and migrate the database when first made: one process at a
    # time, or a second one started alongside fails in the middle of the first's migration.
    db = Path(uri[len("sqlite:///") :])
    with exclusive_lock(db.with_name(f"{db.name}.lock"), what=f"the MLflow store {db}"):
        client = MlflowClient(tracking_uri=uri)
        client.search_registered_models(max_results=1)  # the model registry's store too
    return client


#: The experiment tag that picks the MLflow UI's view: model training runs, not GenAI traces.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}

#: The query parameter of the MLflow UI's "Model training" view: the runs, their metric charts
#: and the models. MLflow 3.x's UI opens an experiment in the view the browser last chose (its
#: local storage), the GenAI overview on a first visit, whatever :data:`EXPERIMENT_KIND` says;
#: a link that carries this parameter lands on the training runs, and the UI keeps it as the
#: user moves between the experiment's pages.
TRAINING_VIEW = "workflowType=machine_learning"


def ui_link(ui_url: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI's page, at ``ui_url`` (e.g. ``http://127.0.0.1:5000``), of experiment
    ``experiment_id``'s runs, or of run ``run_id``, in its "Model training" view
    (:data:`TRAINING_VIEW`)."""
    page = f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs"
    return f"{page}/{run_id}?{TRAINING_VIEW}" if run_id else f"{page}?{TRAINING_VIEW}"


#: Where ``mlflow ui`` serves by default.
MLFLOW_UI = "http://127.0.0.1:5000"


def compare_link(ui_url: str, experiment_id: str, run_ids: list[str]) -> str:
    """The MLflow UI's compare view, at ``ui_url``, of runs ``run_ids`` of experiment
    ``experiment_id``, side by side: their parameters (with a switch that shows only those that
    differ), metrics and a parallel-coordinates plot of both. A sweep prints it for its cells."""
    runs, experiments = (quote(json.dumps(ids, separators=(",", ":"))) for ids in (run_ids, [experiment_id]))
    return f"{ui_url.rstrip('/')}/#/compare-runs?runs={runs}&experiments={experiments}&{TRAINING_VIEW}"


def ui_address(tracking_uri: str) -> tuple[str, str]:
    """Where to open the MLflow UI of the store ``tracking_uri``: ``(address, what to run
    first)``. A tracking server is its own UI, with nothing to run (its address without any user
    and password the URI holds: a link is shown and stored); a local store (SQLite, a folder) is
    served by ``mlflow ui --backend-store-uri ...`` at its default address, :data:`MLFLOW_UI`."""
    parts = urlsplit(tracking_uri)
    if parts.scheme in ("http", "https"):
        return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])), ""
    return MLFLOW_UI, f"mlflow ui --backend-store-uri {tracking_uri}"


def experiment_link(tracking_uri: str, name: str) -> str:
    """:func:`ui_link` of experiment ``name`` on the tracking server ``tracking_uri``; the UI's
    own address when the server has no such experiment yet (``make demo`` prints it)."""
    found = MlflowClient(tracking_uri).get_experiment_by_name(name)
    return ui_link(tracking_uri, found.experiment_id) if found else tracking_uri


def experiment_id(client: MlflowClient, name: str) -> str:
    """The id of experiment ``name``, created if missing, tagged :data:`EXPERIMENT_KIND` (an
    existing experiment keeps a kind it already has).

    For a local SQLite store the experiment's artifacts go to ``mlartifacts/`` beside the
    database file (``sqlite:///runs/x/mlflow.db`` -> ``runs/x/mlartifacts``).
    """
    found = client.get_experiment_by_name(name)
    if found is None:
        location = None
        if client.tracking_uri.startswith("sqlite:///"):
            db = Path(client.tracking_uri[len("sqlite:///") :])
            location = (db.resolve().parent / "mlartifacts").as_uri()
        try:
            return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
        except MlflowException:  # created meanwhile by a run started alongside
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    for key, value in EXPERIMENT_KIND.items():
        if key not in found.tags:
            client.set_experiment_tag(found.experiment_id, key, value)
    return found.experiment_id


def source_tags() -> dict[str, str]:
    """MLflow's source tags for runs of this code: ``mlflow.source.name`` (the flow's entry
    point), ``mlflow.source.type`` (``JOB``), and when the package runs from a git checkout
    ``mlflow.source.git.commit``, ``mlflow.source.git.branch`` (unless detached),
    ``mlflow.source.git.repoURL`` (the ``origin`` remote, any user and password removed) and
    ``rlhf.git.dirty`` (``true`` when tracked files differ from the commit)."""
    import git

    tags = {"mlflow.source.name": "flows/pipeline.py:rlhf", "mlflow.source.type": "JOB"}
    try:
        repo = git.Repo(Path(__file__).resolve().parents[1])
        tags["mlflow.source.git.commit"] = repo.head.commit.hexsha
        tags["rlhf.git.dirty"] = str(repo.is_dirty(untracked_files=False)).lower()
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, git.GitCommandError, ValueError):
        return tags  # an installed package: no checkout
    if not repo.head.is_detached:
        tags["mlflow.source.git.branch"] = repo.active_branch.name
    if "origin" in [r.name for r in repo.remotes]:
        url = repo.remotes.origin.url
        tags["mlflow.source.git.repoURL"] = re.sub(r"^(\w+://)[^/@]*@", r"\1", url)
    return tags


def dataset_inputs(data_dir: str | os.PathLike, cfg) -> list:
    """One MLflow ``DatasetInput`` per prepared split in ``data_dir`` (the data stage's
    output), for ``MlflowClient.log_inputs``: named ``tldr/{sft|preference}/{split}``, its
    digest the split's content digest (the first 16 hex of the ``_fingerprint`` the data stage
    writes), its source the hub dataset (id and revision) or the local file it was read from,
    its schema and row count from the split; context ``training`` for splits named ``train``,
    else ``evaluation``."""
    import warnings

    import datasets
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag

    root = Path(data_dir)
    d = cfg.data
    inputs = []
    for kind in DATA_KINDS:
        for split, spec in d.splits(kind).items():
            if not (root / kind / split).is_dir():
                continue
            ds = datasets.load_from_disk(str(root / kind / split))
            digest = json.loads((root / kind / split / "state.json").read_text())["_fingerprint"][:16]
            name = f"tldr/{kind}/{split}"
            # "source could not be resolved" (it is named as given), "integer columns cannot
            # represent missing values" (token ids and lengths have none)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if d.resolved_source() == "hub":
                    hub = d.dataset(kind)
                    dataset = mlflow.data.from_huggingface(ds, path=hub, revision=d.revision, name=name, digest=digest)
                else:
                    source = str(Path(d.resolved_local_dir() or ".") / f"{kind}_{spec.source}.jsonl")
                    dataset = mlflow.data.from_huggingface(ds, source=source, name=name, digest=digest)
                entity = dataset._to_mlflow_entity()  # infers the schema
            context = "training" if split == "train" else "evaluation"
            inputs.append(DatasetInput(entity, tags=[InputTag("mlflow.data.context", context)]))
    return inputs


def start_stage_run(parent_run_id: str | None, stage: str, cfg, key: str) -> tuple[str, MlflowClient]:
    """Create the stage's MLflow run, nested under the pipeline's run, with its config sections as params."""
    from rlhf_core.config.presets import flatten

    client = tracking_client(cfg.tracking.tracking_uri)
    if parent_run_id is not None:
        exp = client.get_run(parent_run_id).info.experiment_id
    else:
        exp = experiment_id(client, cfg.tracking.experiment_name)
    stale = client.search_runs(
        [exp], filter_string=f"tags.`rlhf.artifact_key` = '{key}' and attributes.status = 'RUNNING'"
    )
    tags = {"rlhf.stage": stage, "rlhf.artifact_key": key, **source_tags()}
    if parent_run_id is not None:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(exp, run_name=stage, tags=tags)
    # Runs of this stage key still RUNNING belong to attempts that died (a worker killed by its
    # pool never ends its run): the caller holds the stage's lock (tasks.stages.rlhf_stage), so
    # no live process is running it. Each is ended KILLED, naming the run that replaced it.
    for dead in stale:
        client.set_tag(dead.info.run_id, "rlhf.replaced_by", run.info.run_id)
        client.set_terminated(dead.info.run_id, "KILLED")
    tracker = MLflowTracker(run.info.run_id, client=client)
    from rlhf_core.run.pipeline import stage_config

    tracker.log_params(flatten(stage_config(cfg, stage)))
    return run.info.run_id, client


#: The alias given to the newest registered version.
ALIAS = "latest-pipeline"


def local_folder(uri: str) -> Path | None:
    """The folder an artifact URI names on this machine (``file://...`` or an absolute path),
    or ``None`` for any other scheme (``mlflow-artifacts:``, ``s3://``) or a folder absent here."""
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        path = Path(unquote(urlparse(uri).path))
    elif uri.startswith("/"):
        path = Path(uri)
    else:
        return None
    return path if path.is_dir() else None


def register_model_version(
    client: MlflowClient,
    name: str,
    run_id: str,
    digest: str,
    artifact_uri: str,
    save_model: Callable[[Path], None],
    alias: str = ALIAS,
    store: ArtifactStore | None = None,
) -> str:
    """Register a stage's model as a version of ``name`` and point ``alias`` at it.

    Args:
        client: the tracking client.
        name: the registered model's name.
        run_id: the stage's MLflow run, the version's source run; the MLflow model is logged
            there as the artifact ``model`` (``mlflow.pyfunc.load_model("models:/NAME@ALIAS")``).
        digest: the stage artifact's content digest, stored as the version's tag ``rlhf.digest``;
            a version with the same digest (a cached stage) is reused, not duplicated.
        artifact_uri: the stage's artifact (a local folder or a ``scheme://`` URI), stored as
            the version's tag ``rlhf.artifact_uri``.
        save_model: writes the MLflow model into the directory it is given
            (:data:`tasks.mlflow_models.MLFLOW_MODELS`); called only for a new version.
        store: the stage store; where it and the run's artifacts are local folders, each logged
            file identical to a stored one (the model's weights) becomes a hard link to it
            (:meth:`ArtifactStore.link_stored`): the model is on disk once.

    Returns:
        The version number, as a string.
    """

    try:
        client.create_registered_model(name)
    except MlflowException:
        pass  # already registered
    for existing in client.search_model_versions(f"name='{name}'"):
        if existing.tags.get("rlhf.digest") == digest:  # a cached stage: same model, same version
            client.set_registered_model_alias(name, alias, existing.version)
            return str(existing.version)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "model")
        client.log_artifacts(run_id, str(Path(tmp) / "model"), "model")
    logged = local_folder(client.get_run(run_id).info.artifact_uri)
    if store is not None and logged is not None and (logged / "model").is_dir():
        store.link_stored(logged / "model")
    version = client.create_model_version(
        name,
        source=f"{client.get_run(run_id).info.artifact_uri}/model",
        run_id=run_id,
        tags={"rlhf.digest": digest, "rlhf.artifact_uri": artifact_uri},
    )
    client.set_registered_model_alias(name, alias, version.version)
    return str(version.version)


@contextmanager
def traced_judge_calls(client: MlflowClient, run_id: str, judge: str = "anthropic") -> Iterator[None]:
    """Trace every API call of the judge ``judge`` (``eval.judge``) made inside to the experiment
    of run ``run_id``, the run active meanwhile, so its traces show beside it in the MLflow UI:
    Anthropic Messages API calls (``mlflow.anthropic.autolog``) for ``anthropic``, Chat
    Completions calls (``mlflow.openai.autolog``) for ``openai``. Each span records the model,
    the messages and the reply with its token counts. The API key is an attribute of the SDK's
    client, not an argument of a call, so no span records it. Autologging is turned off again on
    the way out.

    Raises:
        ValueError: ``judge`` is neither ``anthropic`` nor ``openai``.
    """
    import mlflow

    if judge == "anthropic":
        import mlflow.anthropic as flavor
    elif judge == "openai":
        import mlflow.openai as flavor
    else:
        raise ValueError(f"no API judge to trace: {judge!r} (anthropic or openai)")
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(client.tracking_uri)
    mlflow.set_experiment(experiment_id=client.get_run(run_id).info.experiment_id)
    flavor.autolog(log_traces=True)
    try:
        with mlflow.start_run(run_id=run_id):
            yield
    finally:
        flavor.autolog(disable=True)
        mlflow.set_tracking_uri(before)
        if before is not None:
            os.environ["MLFLOW_TRACKING_URI"] = before
