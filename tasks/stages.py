"""Prefect tasks, one per pipeline stage, each wrapping a pure ``rlhf_core`` stage function.

A task's stage key (:func:`rlhf_core.run.pipeline.key_of` its :func:`task_key_parts`) digests its stage name, the
settings it reads, what else it reads (data and model files), the digests of its upstream
artifacts, the version of the ``rlhf_core`` code and the artifact root. A task returns a small
:class:`StageRecord` (artifact key, URI and digest, MLflow run id, key metrics), never a
model. Its artifact is written to the :class:`~tasks.storage.ArtifactStore` (manifest last)
before the task returns, so Prefect's cache entry, written after the return, never points
at a half-written artifact. The stage itself runs in a local work directory named by the
cache key; its mid-stage checkpoints live there, so a stage that failed part way resumes
from its last checkpoint when the pipeline runs again. Once stored, the finished output is
not kept there a second time: its checkpoints are deleted and the rest moves into a local
store (:meth:`~tasks.storage.ArtifactStore.move_dir`). A lock beside that directory lets one
process at a time run the stage; a second run waits, then takes the first's record.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

from prefect import get_run_logger, task
from prefect.context import TaskRunContext
from pydantic import BaseModel

from rlhf_core.common.io import exclusive_lock, write_json_atomic
from rlhf_core.common.tracking import JsonlTracker, TeeTracker
from rlhf_core.config.credentials import judge_key_given
from rlhf_core.config.settings import EvalConfig, PipelineConfig, TrainerConfig
from rlhf_core.run.launch import nproc_per_node
from rlhf_core.run.pipeline import ON_DEMAND, STAGES, key_of, key_record, stage_key_parts
from rlhf_core.run.preflight import JUDGING_STAGES, check_before_stages, judge_key_missing
from rlhf_core.run.runner import PlannedStage, run_stage, why_it_runs

from .storage import ArtifactError, ArtifactStore


class StageRecord(BaseModel):
    """What a stage task returns: small, JSON-serialisable, cacheable."""

    stage: str
    key: str
    uri: str
    digest: str
    mlflow_run_id: str | None = None
    metrics: dict[str, float] = {}


def task_key_parts(
    stage: str, cfg: PipelineConfig, upstream: list[StageRecord], store: ArtifactStore | None = None
) -> dict[str, Any]:
    """The parts of ``stage``'s key (:func:`rlhf_core.run.pipeline.stage_key_parts`), its
    upstream being the content digests of its input artifacts and its context the artifact root
    (``store``'s, default ``RLHF_ARTIFACT_ROOT``): a cache entry is only as good as the store its
    artifact lives in."""
    return stage_key_parts(stage, cfg, [u.digest for u in upstream], store=(store or ArtifactStore()).uri(""))


def cache_entry(stage: str, parts: dict[str, Any]) -> str:
    """The name of the stage task's Prefect cache entry: ``rlhf-<stage>-<key>``, the key
    :func:`rlhf_core.run.pipeline.key_of` the :func:`task_key_parts` ``parts``."""
    return f"rlhf-{stage}-{key_of(parts)}"


def _cache_key_fn(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    cfg = PipelineConfig.model_validate(parameters["config"])
    upstream = [StageRecord.model_validate(u) for u in parameters.get("upstream") or []]
    return cache_entry(parameters["stage"], task_key_parts(parameters["stage"], cfg, upstream))


def provide_judge_key(ecfg: EvalConfig) -> str | None:
    """The API judge's key, for a judge that needs one (``judge_needs_key``): its environment
    variable (:attr:`~rlhf_core.config.settings.EvalConfig.judge_key_variable`) when set, else
    the Prefect Secret block :attr:`~rlhf_core.config.settings.EvalConfig.judge_key_secret`
    (``eval.api_key_secret``). The caller hands it to the stage
    (:func:`rlhf_core.config.credentials.judge_key_given`); it is never put in the process
    environment, and never logged.

    Returns:
        The key, or ``None`` when the judge needs none.

    Raises:
        JudgeConfigError: neither the variable nor the block exists
            (:func:`rlhf_core.run.preflight.judge_key_missing`).
    """
    variable = ecfg.judge_key_variable
    if not ecfg.judge_needs_key:
        return None
    if variable and os.environ.get(variable):
        return os.environ[variable]
    from prefect.blocks.system import Secret

    from rlhf_core.evaluation.judging import JudgeConfigError

    if ecfg.judge_key_secret is None:
        raise JudgeConfigError(judge_key_missing(ecfg, None))
    try:
        return str(Secret.load(ecfg.judge_key_secret).get())
    except ValueError:
        raise JudgeConfigError(judge_key_missing(ecfg, ecfg.judge_key_secret)) from None


def secret_block_exists(name: str) -> bool:
    """Whether the Prefect server has a Secret block named ``name``, asked without its value
    (``include_secrets=False``): what :func:`provide_judge_key` will load."""
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_block_document_by_name(
                name, block_type_slug=Secret.get_block_type_slug(), include_secrets=False
            )
        except ObjectNotFound:
            return False
    return True


def preflight(cfg: PipelineConfig, stages: list[str] | None = None) -> None:
    """What must hold before the first of the stages ``stages`` (default: every stage) runs,
    checked at once: the batch settings divide for this machine's process count
    (``RLHF_NPROC_PER_NODE``); the artifact store and the work directory can be written to;
    what the stages will read exists (:func:`rlhf_core.run.preflight.check_before_stages`: data
    splits, local data files, ``ppo.reward``, model sources, hub models and datasets); for an API
    judge that needs a key, that it is there: ``ANTHROPIC_API_KEY`` (``OPENAI_API_KEY``) or the
    Prefect Secret block named by ``eval.api_key_secret`` (:func:`secret_block_exists`: its
    presence, never its value); and that the OpenAI judge's server serves its model.

    Raises:
        ConfigError (PreflightError), ModelSourceError, DataError, ArtifactError, OSError:
            naming the key or the directory.
    """
    from rlhf_core.config.settings import check_world_size

    check_world_size(cfg, nproc_per_node())
    ArtifactStore().check_writable()
    root = work_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".rlhf-write-test-"):
            pass
    except OSError as exc:
        raise ArtifactError(
            f"the work directory {root} (RLHF_WORK_DIR) is not writable: {type(exc).__name__}: {exc}"
        ) from None
    # the judge's key is checked last: looking up the block may start Prefect's temporary server
    check_before_stages(cfg, stages, secret_exists=secret_block_exists)


#: A mid-stage checkpoint's size in multiples of the float32 weights a stage trains: the
#: weights and AdamW's two moments (:class:`rlhf_core.train.training.CheckpointManager`).
FREE_SPACE_FACTOR = 3
#: Free space every stage needs beyond its estimate (logs, metrics, small files), in bytes.
FREE_SPACE_MIN = 256 << 20
#: The input artifacts holding the models each trainer stage trains, saved in float32: PPO
#: trains the policy (from SFT) and the value model (from the normalised reward model).
TRAINED_INPUTS = {"sft": ("base_model",), "reward": ("sft",), "dpo": ("sft",), "ppo": ("sft", "reward_norm")}


class SpaceEstimate(NamedTuple):
    """What a stage will likely write, in bytes (:func:`estimate_stage_space`)."""

    output: int
    checkpoint: int
    checkpoints: int
    written: int
    total: int


def estimate_stage_space(model_bytes: int, keep_checkpoints: int | None, written: int = 0) -> SpaceEstimate:
    """The free space a stage needs, in bytes, from the size on disk of the models it trains.

    ``total = max(output + (keep_checkpoints + 1) x checkpoint - written, 0) + FREE_SPACE_MIN``,
    where ``output = model_bytes`` (the trained models, saved in float32 as they were read),
    ``checkpoint = FREE_SPACE_FACTOR x model_bytes`` (float32 weights and AdamW's two moments):
    ``keep_checkpoints`` complete checkpoints are kept and one more exists while a new one is
    written (:class:`rlhf_core.train.training.CheckpointManager`); ``written`` is what the stage's
    work directory already holds (an interrupted attempt's checkpoint). A stage that trains
    nothing (``keep_checkpoints=None``) writes no checkpoint and at most a model of
    ``model_bytes``: ``total = max(model_bytes - written, 0) + FREE_SPACE_MIN``.

    Args:
        model_bytes: the size on disk of the float32 models the stage trains (PPO: policy and
            value model), or of its largest input for a stage that trains nothing.
        keep_checkpoints: the stage's ``keep_checkpoints`` setting; ``None`` for no checkpoints.
        written: bytes already in the stage's work directory.
    """
    checkpoint = FREE_SPACE_FACTOR * model_bytes
    checkpoints = 0 if keep_checkpoints is None else keep_checkpoints + 1
    needed = max(model_bytes + checkpoints * checkpoint - written, 0) + FREE_SPACE_MIN
    return SpaceEstimate(model_bytes, checkpoint, checkpoints, written, needed)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def check_free_space(stage: str, inputs: list[Path], places: list[Path], cfg: PipelineConfig | None = None) -> None:
    """Fail before stage ``stage`` runs when a file system it writes to (``places``: the work
    directory, a local artifact root) has less free space than it will likely need
    (:func:`estimate_stage_space`).

    A trainer stage (:data:`TRAINED_INPUTS`) is estimated from the size on disk of the input
    artifacts holding the models it trains, when ``inputs`` are in the stage's order
    (:data:`rlhf_core.run.pipeline.STAGES`), else from its largest input, and from its
    ``keep_checkpoints`` setting in ``cfg`` (default 1); any other stage from its largest input.
    What the first place (the stage's work directory) already holds counts as written. Every
    place is held to the whole estimate.

    Raises:
        ArtifactError: naming the directory, the space free and the space needed, with its parts.
    """
    sizes = [_tree_bytes(p) for p in inputs]
    trained = TRAINED_INPUTS.get(stage)
    if trained and len(inputs) == len(STAGES[stage].inputs):
        model = sum(size for name, size in zip(STAGES[stage].inputs, sizes) if name in trained)
    else:
        model = max(sizes, default=0)
    keep = None
    if trained:
        keep = getattr(cfg, stage).keep_checkpoints if cfg is not None else TrainerConfig().keep_checkpoints
    est = estimate_stage_space(model, keep, written=_tree_bytes(places[0]) if places else 0)
    gib = 2**30
    if keep is None:
        parts = f"its largest input, {est.output / gib:.2f} GiB"
    else:
        parts = (
            f"its output {est.output / gib:.2f} GiB + ({keep} kept + 1 being written) x {est.checkpoint / gib:.2f} GiB "
            f"per checkpoint ({FREE_SPACE_FACTOR} x the float32 weights it trains: weights and AdamW's two moments)"
        )
    if est.written:
        parts += f" - {est.written / gib:.2f} GiB already written"
    for place in places:
        free = shutil.disk_usage(place).free
        if free < est.total:
            advice = f", lower {stage}.keep_checkpoints" if keep is not None and keep > 1 else ""
            raise ArtifactError(
                f"stage {stage}: {place} has {free / gib:.2f} GiB free; the stage needs about "
                f"{est.total / gib:.2f} GiB ({parts}, + {FREE_SPACE_MIN >> 20} MiB). Free some space{advice} or "
                "point RLHF_WORK_DIR / RLHF_ARTIFACT_ROOT elsewhere"
            )


def _not_retried() -> tuple[type[BaseException], ...]:
    from rlhf_core.common import errors
    from rlhf_core.config.settings import ConfigError
    from rlhf_core.evaluation.judging.errors import JudgeConfigError, JudgeRequestError, JudgeUnreadableError

    return (
        errors.DataError,
        errors.ModelSourceError,
        ConfigError,
        ArtifactError,
        JudgeConfigError,
        JudgeRequestError,
        JudgeUnreadableError,  # its answers are cached: another attempt reads the same ones
    )


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn`` for the stage tasks: retry unless the failure is one
    that another attempt cannot fix (:func:`_not_retried`); a crash, a timeout, a lost
    connection or an out-of-memory kill is retried, and the stage resumes from its checkpoint."""
    return not isinstance(state.data, _not_retried())


def result_storage(store: ArtifactStore | None = None):
    """The Prefect block where the stage tasks persist their results, i.e. their cache entries.

    ``RLHF_RESULT_STORAGE`` when set (a local path or an fsspec URL such as ``s3://b/p``),
    else ``_prefect-results`` under the artifact root (``RLHF_ARTIFACT_ROOT``): a store every
    worker reads, so a flow run in a fresh container, whose ``PREFECT_HOME`` is empty, still
    takes the finished stages from the cache. Prefect needs result storage saved as a block:
    it is saved (overwritten) as ``local-file-system/rlhf-results-<hash>`` or
    ``remote-file-system/rlhf-results-<hash>``, the hash naming the location; S3 credentials
    stay in the environment, never in the block.
    """
    import hashlib

    block, location = result_storage_block(store)
    block.save("rlhf-results-" + hashlib.sha256(location.encode()).hexdigest()[:12], overwrite=True)
    return block


def result_storage_block(store: ArtifactStore | None = None):
    """The file system of :func:`result_storage`, not saved (no Prefect server is asked), and its
    location: where a plan reads the cache entries from."""
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    location = os.environ.get("RLHF_RESULT_STORAGE") or (store or ArtifactStore()).uri("_prefect-results")
    if "://" in location and not location.startswith("file://"):
        return RemoteFileSystem(basepath=location.rstrip("/")), location
    return LocalFileSystem(basepath=str(Path(location.removeprefix("file://")).resolve())), location


#: Stages that run a model (on the accelerator, where there is one): tagged ``gpu``.
MODEL_STAGES = (frozenset(STAGES) | frozenset(ON_DEMAND)) - {"data", "base_model"}


def stage_tags(stage: str, cfg: PipelineConfig) -> set[str]:
    """The Prefect tags of stage ``stage``'s task: ``gpu`` for a stage that runs a model
    (:data:`MODEL_STAGES`), ``judge-api`` for the evaluation with an API judge (``anthropic``,
    ``openai``). A tag
    concurrency limit on the orchestrator (``prefect concurrency-limit create gpu 8``, or a
    sweep spec's ``concurrency_limits``) bounds how many such tasks run at once, across flows
    and workers."""
    tags = {"gpu"} if stage in MODEL_STAGES else set()
    if stage in JUDGING_STAGES and cfg.eval.judge != "offline":
        tags.add("judge-api")
    return tags


def stage_task(stage: str, cfg: PipelineConfig, storage: Any):
    """:func:`rlhf_stage` with the stage's orchestration settings (``cfg.orchestration``:
    retries, their delay, its time limit), tags (:func:`stage_tags`) and result storage
    (:func:`result_storage`)."""
    o = cfg.orchestration
    return rlhf_stage.with_options(
        tags=stage_tags(stage, cfg),
        retries=o.retries,
        retry_delay_seconds=o.retry_delay_seconds,
        retry_condition_fn=worth_retrying,
        timeout_seconds=o.timeout_seconds.get(stage),
        result_storage=storage,
    )


def work_root() -> Path:
    """Local scratch for running stages and their checkpoints: ``$RLHF_WORK_DIR`` or ``./.rlhf-work``."""
    return Path(os.environ.get("RLHF_WORK_DIR") or ".rlhf-work").resolve()


@task(name="rlhf-stage", cache_key_fn=_cache_key_fn, persist_result=True, task_run_name="{stage}")
def rlhf_stage(stage: str, config: dict, upstream: list[dict] | None = None, parent_run_id: str | None = None) -> dict:
    """Run one stage (or resume it from its checkpoints) and store its artifact.

    Args:
        stage: a name in :data:`rlhf_core.run.pipeline.STAGES`.
        config: the pipeline config as a dict (``PipelineConfig.model_dump()``).
        upstream: the records of the stages it reads, in the order the stage expects.
        parent_run_id: the pipeline's MLflow run; the stage logs to a nested run under it.

    Returns:
        A :class:`StageRecord` as a dict.
    """
    logging.getLogger("rlhf_core").setLevel(logging.INFO)  # progress lines reach Prefect's logs
    cfg = PipelineConfig.model_validate(config)
    with judge_key_given(provide_judge_key(cfg.eval) if stage in JUDGING_STAGES else None):
        return _reuse_or_run(stage, cfg, upstream, parent_run_id)


def _reuse_or_run(stage: str, cfg: PipelineConfig, upstream: list[dict] | None, parent_run_id: str | None) -> dict:
    """:func:`rlhf_stage`'s work: one writer per stage key, the finished record of another run,
    else the stage run and stored (:func:`_run_and_store`) and its record written."""
    records = [StageRecord.model_validate(u) for u in upstream or []]
    store = ArtifactStore()
    parts = task_key_parts(stage, cfg, records, store)  # what the key covers: read once
    key = f"{stage}/{key_of(parts)}"
    # One writer per stage key: a second run of the same stage waits here for the first, then
    # returns the record the first left beside the work directory, its artifact intact. On an
    # S3 store, workers on other machines are kept out by a claim in the store (tasks.claims).
    with exclusive_lock(work_root() / f"{key}.lock", what=f"stage {stage} ({key})"):
        done = finished_record(key, store, work_root())
        if done is not None:
            get_run_logger().info("stage %s: finished meanwhile by another run; its artifact is used", stage)
            return done.model_dump()
        with stage_claim(store, key) as claim:
            if claim is not None and claim.record is not None:
                get_run_logger().info(
                    "stage %s: finished by another worker sharing the store; its artifact is used", stage
                )
                return claim.record.model_dump()
            record = _run_and_store(stage, cfg, records, key, parts, store, parent_run_id)
            write_json_atomic(work_root() / f"{key}.record.json", record.model_dump())
            if not store.is_local:  # for workers elsewhere: before the claim is released
                store.put_text(f"{key}.record.json", record.model_dump_json())
    return record.model_dump()


def stage_claim(store: ArtifactStore, key: str):
    """The claim on stage key ``key`` in an S3 store (:class:`tasks.claims.StageClaim`, waiting
    for another worker's run or taking over its lapsed claim); on a local store, where the
    stage's lock is enough, a context that yields None."""
    if store.is_local:
        return nullcontext()
    from prefect.exceptions import MissingContextError

    from .claims import StageClaim

    try:
        logger = get_run_logger()  # the task run's log in Prefect
    except MissingContextError:
        logger = None
    return StageClaim(store.root, key, finished=lambda: finished_record(key, store, work_root()), logger=logger)


def finished_record(key: str, store: ArtifactStore, work: Path) -> StageRecord | None:
    """The record a run of stage key ``key`` (``<stage>/<key>``) left beside its
    work directory under ``work``, or, on an S3 store, beside its artifact in the store (a
    worker on another machine), when its artifact is intact in ``store``; else ``None``."""
    finished = work / f"{key}.record.json"
    text = finished.read_text() if finished.is_file() else None
    if text is None and not store.is_local:
        text = store.get_text(f"{key}.record.json")
    if text is not None:
        record = StageRecord.model_validate_json(text)
        if store.is_intact(record.key, record.digest):
            return record
    return None


def plan_run(cfg: PipelineConfig, names: list[str], store: ArtifactStore, work: Path) -> list[PlannedStage]:
    """What the flow ``rlhf`` would do with the stages ``names`` of ``cfg`` (``rlhf plan`` on a
    run directory of ``rlhf run``), stage by stage, deciding as it does: a stage is taken from
    the cache when its Prefect cache entry (:func:`cache_entry`, read from
    :func:`result_storage_block`) or the record of a finished run of it
    (:func:`finished_record`) names an artifact that is intact in ``store``
    (:meth:`ArtifactStore.damage`). A stage's key needs its inputs' artifact digests: after a
    stage that runs, the keys of those reading it are known only once it has run. Writes
    nothing; asks no Prefect server; loads no torch.
    """
    from prefect.results import ResultStore

    results = ResultStore(result_storage=result_storage_block(store)[0])
    records: dict[str, StageRecord] = {}
    planned = []
    for name in names:
        waiting = next((dep for dep in STAGES[name].inputs if dep not in records), None)
        if waiting is not None:
            planned.append(PlannedStage(name, "-", False, f"its key needs the digest of {waiting}'s new artifact"))
            continue
        upstream = [records[dep] for dep in STAGES[name].inputs]
        parts = task_key_parts(name, cfg, upstream, store)  # the data files are read once
        entry, key = cache_entry(name, parts), f"{name}/{key_of(parts)}"
        record = StageRecord.model_validate(results.read(entry).result) if results.exists(entry) else None
        damage = None if record is None else store.damage(record.key, record.digest)
        if record is not None and damage is None:
            records[name] = record
            planned.append(PlannedStage(name, key, True, f"cache entry {entry}: {record.uri}"))
        elif (done := finished_record(key, store, work)) is not None:
            records[name] = done
            planned.append(PlannedStage(name, key, True, f"finished by an earlier run: {done.uri}"))
        else:
            why = why_it_runs(work / key, key, parts, last_finished_parts(name, work))
            planned.append(PlannedStage(name, key, False, f"no cache entry: {why}" if record is None else str(damage)))
    return planned


#: The key record of a stage's last finished run on this worker, beside its work directories:
#: what the log line of a stage that runs again compares with (:func:`last_finished_parts`).
FINISHED_PARTS = "finished-parts.json"


def last_finished_parts(stage: str, work: Path) -> dict[str, Any] | None:
    """The key record (:func:`rlhf_core.run.pipeline.key_record`) of stage ``stage``'s last
    finished run on this worker (:data:`FINISHED_PARTS` under ``work``), or None, for
    :func:`rlhf_core.run.runner.why_it_runs`."""
    path = work / stage / FINISHED_PARTS
    return json.loads(path.read_text()) if path.is_file() else None


def _run_and_store(
    stage: str,
    cfg: PipelineConfig,
    records: list[StageRecord],
    key: str,
    parts: dict[str, Any],
    store: ArtifactStore,
    parent_run_id: str | None,
) -> StageRecord:
    from rlhf_core.run.runner import MARKER

    from .mlflow_tracking import MLflowTracker, start_stage_run, traced_judge_calls

    inputs = [store.local_path(r.key, work_root() / "downloads") for r in records]
    out = work_root() / key
    out.mkdir(parents=True, exist_ok=True)
    check_free_space(stage, inputs, [out] + ([Path(store.base)] if store.is_local else []), cfg)
    why = why_it_runs(out, key, parts, last_finished_parts(stage, work_root()))
    get_run_logger().info("stage %s runs: %s", stage, why)
    run_id, client = start_stage_run(parent_run_id, stage, cfg, key)
    mlflow_tracker = MLflowTracker(run_id, client=client)
    # metrics.jsonl travels with the artifact (the report draws training curves from it); on a
    # resumed stage it holds every attempt's records in order.
    tracker = TeeTracker(mlflow_tracker, JsonlTracker(out / "metrics.jsonl"))
    try:
        # an API judge's calls appear as MLflow traces of the evaluation's run
        traced = stage in JUDGING_STAGES and cfg.eval.judge != "offline"
        with traced_judge_calls(client, run_id, cfg.eval.judge) if traced else nullcontext():
            # rank 0 of a torchrun job writes metrics.jsonl; its records are relayed to MLflow
            run = run_stage(
                stage, cfg, inputs, out, key, key_record(parts), tracker, nproc=nproc_per_node(), relay=mlflow_tracker
            )
        mlflow_tracker.close()
        _log_stage_files(stage, cfg, out, mlflow_tracker, client, run_id)
        # stored whole, so nothing to resume from: the checkpoints go, and the output moves into
        # the store (a local one renames it; an S3 one leaves it as this worker's download)
        stored = store.move_dir(out, key, exclude=("checkpoints", MARKER), cache_dir=work_root() / "downloads")
        client.set_tag(run_id, "rlhf.artifact_uri", stored["uri"])
        client.set_terminated(run_id, "FINISHED")
    except BaseException:
        mlflow_tracker.close()
        client.set_terminated(run_id, "FAILED")
        raise
    write_json_atomic(work_root() / stage / FINISHED_PARTS, key_record(parts))
    return StageRecord(
        stage=stage, key=key, uri=stored["uri"], digest=stored["digest"], mlflow_run_id=run_id, metrics=run.metrics
    )


#: The files of a stage's output logged as artifacts of its MLflow run, where it has them.
LOGGED_FILES = ("metrics.json", "stats.json", "samples.jsonl", "calibration.png", "calibration.json", "import.json")


def _log_stage_files(stage: str, cfg: PipelineConfig, out: Path, tracker: Any, client: Any, run_id: str) -> None:
    """Log a finished stage's :data:`LOGGED_FILES` to its MLflow run; for the data stage also its
    figures (:func:`log_data_figures`) and the prepared splits as the run's dataset inputs
    (name, digest, source, schema)."""
    for name in LOGGED_FILES:
        if (out / name).is_file():
            tracker.log_artifact(out / name)
    if stage == "data":
        from .mlflow_tracking import dataset_inputs

        log_data_figures(out, tracker)
        client.log_inputs(run_id, datasets=dataset_inputs(out, cfg))


#: The MLflow table of the policy pairs each preference split compares (Table 2).
POLICY_PAIRS_TABLE = "policy_pairs"


def log_data_figures(out: Path, tracker: Any) -> None:
    """Log the data stage's figures, drawn or read here from its output ``out`` (the stage itself
    runs no plotting code): the policy pairs each preference split compares (Huang et al. 2024,
    Table 2; :func:`rlhf_core.data.prepared.policy_pair_figures`) as the metrics
    ``data/preference/NAME/policy_pairs`` and ``..._comparisons_per_pair_{min,median,max}`` and the
    table :data:`POLICY_PAIRS_TABLE` (one row per split and pair), then the token lengths
    (Figures 9-10) as ``token_lengths.png``."""
    from rlhf_core.data.prepared import policy_pair_figures, token_lengths
    from rlhf_core.views.plots import plot_token_lengths

    metrics, rows = policy_pair_figures(json.loads((out / "stats.json").read_text()))
    if metrics:
        tracker.log_metrics(metrics)
        tracker.log_table(POLICY_PAIRS_TABLE, rows)
    with tempfile.TemporaryDirectory() as tmp:
        tracker.log_artifact(plot_token_lengths(token_lengths(out), Path(tmp) / "token_lengths.png"))
