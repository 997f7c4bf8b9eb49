"""Prefect tasks, one per pipeline stage, each wrapping a pure ``rlhf_core`` stage function.

A task's cache key digests its stage name, the settings it reads
(:func:`rlhf_core.pipeline.stage_config`), the digests of its upstream artifacts, the version
of the ``rlhf_core`` code and the artifact root. A task returns a small
:class:`StageRecord` (artifact key, URI and digest, MLflow run id, key metrics), never a
model. Its artifact is written to the :class:`~tasks.storage.ArtifactStore` (manifest last)
before the task returns, so Prefect's cache entry, written after the return, never points
at a half-written artifact. The stage itself runs in a local work directory named by the
cache key; its mid-stage checkpoints live there, so a stage that failed part way resumes
from its last checkpoint when the pipeline runs again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from collections import deque
from functools import lru_cache
from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext
from pydantic import BaseModel

import rlhf_core
from rlhf_core.config import PipelineConfig
from rlhf_core.pipeline import STAGES, stage_config
from rlhf_core.rule_rewards import reward_code_digest
from rlhf_core.launch import DATA_PARALLEL
from rlhf_core.tracking import JsonlTracker, TeeTracker, Tracker, replay

from .storage import ArtifactStore

class StageRecord(BaseModel):
    """What a stage task returns: small, JSON-serialisable, cacheable."""

    stage: str
    key: str
    uri: str
    digest: str
    mlflow_run_id: str | None = None
    metrics: dict[str, float] = {}


@lru_cache(maxsize=1)
def code_version() -> str:
    """SHA-256 (16 hex) of the ``rlhf_core`` sources, so a code change invalidates cached stages."""
    root = Path(rlhf_core.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def stage_cache_key(stage: str, cfg: PipelineConfig, upstream: list[StageRecord]) -> str:
    """The cache key of ``stage``: the settings it reads, its upstream digests, the code version and
    the artifact root (``RLHF_ARTIFACT_ROOT``). For PPO with a rule reward (``ppo.reward:
    python:MODULE:FUNCTION``, part of the settings) also the source of that module, which may
    live outside ``rlhf_core``."""
    payload = {
        "stage": stage,
        "config": stage_config(cfg, stage),
        "upstream": [u.digest for u in upstream],
        "code": code_version(),
        # a cache entry is only as good as the store its artifact lives in
        "store": ArtifactStore().uri(""),
    }
    reward_code = reward_code_digest(cfg.ppo.reward) if stage == "ppo" else None
    if reward_code is not None:  # absent otherwise: the keys of the reward model's runs are unchanged
        payload["reward_code"] = reward_code
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _cache_key_fn(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    cfg = PipelineConfig.model_validate(parameters["config"])
    upstream = [StageRecord.model_validate(u) for u in parameters.get("upstream") or []]
    return f"rlhf-{parameters['stage']}-{stage_cache_key(parameters['stage'], cfg, upstream)}"


def provide_judge_key(secret_block: str) -> None:
    """Make the Anthropic API key available to the judge as ``ANTHROPIC_API_KEY``.

    A key already in the environment wins; otherwise it is read from the Prefect Secret block
    ``secret_block``. The key is never logged.

    Raises:
        JudgeConfigError: neither the variable nor the block exists.
    """
    if os.environ.get("ANTHROPIC_API_KEY"):
        return
    from prefect.blocks.system import Secret

    from rlhf_core.judging import JudgeConfigError

    try:
        key = Secret.load(secret_block).get()
    except ValueError:
        raise JudgeConfigError(f"the Anthropic judge needs ANTHROPIC_API_KEY or a Prefect Secret block named "
                               f"{secret_block!r} (eval.api_key_secret); neither exists") from None
    os.environ["ANTHROPIC_API_KEY"] = str(key)


def work_root() -> Path:
    """Local scratch for running stages and their checkpoints: ``$RLHF_WORK_DIR`` or ``./.rlhf-work``."""
    return Path(os.environ.get("RLHF_WORK_DIR") or ".rlhf-work").resolve()


def nproc_per_node() -> int:
    """Training processes per machine: ``$RLHF_NPROC_PER_NODE``, which the GPU work pools set from
    their ``gpus`` job variable (infra/gpu-pool/); 1 (a single process) when unset.

    Raises:
        ValueError: not a positive integer.
    """
    text = os.environ.get("RLHF_NPROC_PER_NODE", "1").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"RLHF_NPROC_PER_NODE must be a positive integer, not {text!r}")
    return int(text)


class LaunchError(RuntimeError):
    """A ``torchrun`` job of a stage failed; the message carries its exit code and last output lines."""


def launch_torchrun(stage: str, cfg: PipelineConfig, inputs: list[Path], out: Path, nproc: int,
                    tracker: Tracker) -> dict:
    """Run ``stage`` as a ``torchrun`` job of ``nproc`` processes on this machine
    (:mod:`rlhf_core.launch`) and relay what its rank 0 records to ``tracker``.

    The whole config travels as JSON (``out/launch_config.json``). ``$RLHF_TORCHRUN_ARGS``
    replaces the default rendezvous ``--standalone`` (e.g. ``--nnodes=2 --node_rank=0
    --rdzv_backend=c10d --rdzv_endpoint=host:29400`` for several machines). The job's output is
    logged line by line.

    Returns:
        The stage's metrics, as rank 0 returned them.

    Raises:
        LaunchError: the job exited non-zero.
    """
    log = logging.getLogger("rlhf_core.launch")
    config_path, result_path = out / "launch_config.json", out / "launch_result.json"
    config_path.write_text(cfg.model_dump_json(indent=1))
    result_path.unlink(missing_ok=True)
    rendezvous = shlex.split(os.environ.get("RLHF_TORCHRUN_ARGS", "")) or ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={nproc}",
           "-m", "rlhf_core.launch", stage, "--preset", str(config_path), "--inputs", *map(str, inputs),
           "--out", str(out), "--result", str(result_path)]
    metrics_file = out / "metrics.jsonl"
    offset = metrics_file.stat().st_size if metrics_file.exists() else 0
    log.info("%s: %d processes: %s", stage, nproc, shlex.join(cmd))
    tail: deque[str] = deque(maxlen=20)  # the ranks' own last lines, not torchrun's
    errors: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            log.info("%s", line)
            if line.startswith("[rank"):
                tail.append(line)
                if re.match(r"\[rank\d+\]: [\w.]*(Error|Exception)\b", line):
                    errors.append(line)
    if metrics_file.exists():
        replay(metrics_file, tracker, offset)
    if proc.returncode != 0:
        cause = errors[0] if errors else "(no error line from the ranks)"
        raise LaunchError(f"stage {stage}: torchrun with {nproc} processes exited with code {proc.returncode}: "
                          f"{cause}\nlast lines of the ranks:\n" + "\n".join(tail))
    return json.loads(result_path.read_text())


@task(name="rlhf-stage", cache_key_fn=_cache_key_fn, persist_result=True, task_run_name="{stage}")
def run_stage(stage: str, config: dict, upstream: list[dict] | None = None, parent_run_id: str | None = None) -> dict:
    """Run one stage (or resume it from its checkpoints) and store its artifact.

    Args:
        stage: a name in :data:`rlhf_core.pipeline.STAGES`.
        config: the pipeline config as a dict (``PipelineConfig.model_dump()``).
        upstream: the records of the stages it reads, in the order the stage expects.
        parent_run_id: the pipeline's MLflow run; the stage logs to a nested run under it.

    Returns:
        A :class:`StageRecord` as a dict.
    """
    from .mlflow_tracking import MLflowTracker, start_stage_run

    logging.getLogger("rlhf_core").setLevel(logging.INFO)  # progress lines reach Prefect's logs
    cfg = PipelineConfig.model_validate(config)
    if stage == "evaluation" and cfg.eval.judge == "anthropic":
        provide_judge_key(cfg.eval.api_key_secret)
    records = [StageRecord.model_validate(u) for u in upstream or []]
    key = f"{stage}/{stage_cache_key(stage, cfg, records)}"
    store = ArtifactStore()
    inputs = [store.local_path(r.key, work_root() / "downloads") for r in records]
    out = work_root() / key
    out.mkdir(parents=True, exist_ok=True)
    run_id, client = start_stage_run(parent_run_id, stage, cfg, key)
    mlflow_tracker = MLflowTracker(run_id, client=client)
    # metrics.jsonl travels with the artifact (the report draws training curves from it); on a
    # resumed stage it holds every attempt's records in order.
    tracker = TeeTracker(mlflow_tracker, JsonlTracker(out / "metrics.jsonl"))
    nproc = nproc_per_node()
    try:
        if nproc > 1 and stage in DATA_PARALLEL:  # rank 0 writes metrics.jsonl; relayed to MLflow
            result = launch_torchrun(stage, cfg, inputs, out, nproc, mlflow_tracker)
        else:
            result = STAGES[stage].run(cfg, inputs, out, tracker) or {}
        mlflow_tracker.close()
        for name in ("metrics.json", "stats.json", "samples.jsonl", "token_lengths.png", "calibration.png",
                     "calibration.json", "import.json"):
            if (out / name).is_file():
                mlflow_tracker.log_artifact(out / name)
        stored = store.put_dir(out, key, exclude=("checkpoints",))
        client.set_tag(run_id, "rlhf.artifact_uri", stored["uri"])
        client.set_terminated(run_id, "FINISHED")
    except BaseException:
        mlflow_tracker.close()
        client.set_terminated(run_id, "FAILED")
        raise
    metrics = {k: float(v) for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return StageRecord(stage=stage, key=key, uri=stored["uri"], digest=stored["digest"], mlflow_run_id=run_id,
                       metrics=metrics).model_dump()
