"""What the stages of a run will read, checked before the first of them starts.

A setting that names something absent (a model directory, a hub repository, a reward
function, a data split, the judge's key) is accepted when the configuration loads and would
otherwise fail only when the stage that reads it starts, possibly hours later.
:func:`check_before_stages` runs, for the stages that will run, one check per kind of setting;
each failure is one line naming the setting's key and what to do, raised as an error the
``rlhf`` command prints in one line (:class:`PreflightError`, a
:class:`~rlhf_core.config.settings.ConfigError`; :class:`~rlhf_core.common.errors.ModelSourceError`;
:class:`~rlhf_core.common.errors.DataError`).

The hub checks ask the hub for each repository's metadata (one request per repository and
revision, answers kept for the process) unless ``HF_HUB_OFFLINE`` is set; offline, or when the
hub cannot be reached, a repository passes only if the local hub cache holds it. The OpenAI
judge's server is asked for its model list (one request). No check reads a key's value but that
request, which sends ``OPENAI_API_KEY`` as the judge will, never showing it. Importing this
module loads neither torch, transformers nor datasets: a check imports what it needs when it
runs.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

from ..common.errors import DataError, ModelSourceError
from ..config.credentials import judge_key
from ..config.data_settings import DATA_KINDS
from ..config.settings import ConfigError, DataConfig, EvalConfig, PipelineConfig
from ..data.files import local_split_files
from ..models.sources import (
    RewardSpecError,
    external_reward_source,
    parse_reward_spec,
    resolve_source,
    split_revision,
)
from .pipeline import ON_DEMAND, STAGES, stages_until


class PreflightError(ConfigError):
    """A setting names something that the stages will not find (a reward function, a data split)
    or cannot use (the judge's key); the message names the setting's key and what to do."""


#: Seconds a hub metadata request may take before the hub counts as unreachable.
HUB_TIMEOUT = 10.0
#: Seconds the OpenAI judge's server may take to list its models before it counts as unreachable.
JUDGE_SERVER_TIMEOUT = 10.0

SplitKind = Literal["sft", "preference", "prompt"]

#: The split settings and the stages that read them: ``(stage, key, kind)``; the value of ``key``
#: is a split name or a list of them, of the data's ``kind`` splits.
SPLIT_SETTINGS: tuple[tuple[str, str, SplitKind], ...] = (
    ("sft", "sft.eval_split", "sft"),
    ("reward_norm", "reward.normalization_split", "sft"),
    ("reward_eval", "reward.eval_splits", "preference"),
    ("dpo_eval", "reward.eval_splits", "preference"),
    ("evaluation", "eval.split", "sft"),
    ("evaluation", "eval.judge_human_split", "preference"),
    ("policy_eval", "eval.split", "sft"),
    ("policy_eval", "eval.judge_human_split", "preference"),
)
#: The stages that judge summaries (``eval.judge``): the pipeline's evaluation and ``rlhf evaluate``'s.
JUDGING_STAGES = frozenset({"evaluation", "policy_eval"})
#: The splits that stages read by a fixed name: ``(stage, kind, split)``.
FIXED_SPLITS: tuple[tuple[str, SplitKind, str], ...] = (
    ("sft", "sft", "train"),
    ("reward", "preference", "train"),
    ("dpo", "preference", "train"),
    ("ppo", "sft", "train"),
    ("ppo", "sft", "validation"),
)


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _setting(cfg: PipelineConfig, key: str):
    section, _, field = key.partition(".")
    return getattr(getattr(cfg, section), field)


# ------------------------------------------------------------------------ splits


def split_names(data: DataConfig, kind: SplitKind) -> list[str]:
    """The splits of ``kind`` that the data stage writes: those of ``data.{kind}_splits`` (under
    ``data.format: trl`` the data's own: :meth:`rlhf_core.config.settings.DataConfig.splits`) and the
    splits held out of them (``data.{kind}_splits.*.holdout.split``)."""
    specs = data.splits(kind)
    return [*specs, *(spec.holdout.split for spec in specs.values() if spec.holdout is not None)]


def check_splits(cfg: PipelineConfig, stages: Iterable[str]) -> None:
    """Check that every split a stage of ``stages`` reads is one the data stage writes
    (:func:`split_names`): the split settings of :data:`SPLIT_SETTINGS` (``sft.eval_split``,
    ``reward.normalization_split``, ``reward.eval_splits``, ``eval.split``, and
    ``eval.judge_human_split`` when ``eval.judge_human_comparisons`` is not 0) and the splits
    read by a fixed name (:data:`FIXED_SPLITS`: ``train``, PPO's ``validation``).

    Raises:
        PreflightError: naming the setting's key (or ``data.sft_splits`` /
            ``data.preference_splits`` for a fixed name), the unknown split and the known ones.
    """
    stages = set(stages)
    for stage, kind, split in FIXED_SPLITS:
        known = split_names(cfg.data, kind)
        if stage in stages and split not in known:
            raise PreflightError(
                f"data.{kind}_splits: stage {stage} reads the {kind} split {split!r}, which the data does not have "
                f"({', '.join(known) or 'none'}); add it to data.{kind}_splits"
            )
    for stage, key, kind in SPLIT_SETTINGS:
        if stage not in stages or (key == "eval.judge_human_split" and not cfg.eval.judge_human_comparisons):
            continue
        value = _setting(cfg, key)
        known = split_names(cfg.data, kind)
        for split in [value] if isinstance(value, str) else value:
            if split not in known:
                raise PreflightError(
                    f"{key}: {split!r} is not one of the data's {kind} splits ({', '.join(known) or 'none'}); "
                    f"name one of them, or add it to data.{kind}_splits"
                )


# ------------------------------------------------------------------------ reward


def check_reward_function(spec: str) -> None:
    """Check that ``ppo.reward`` names a function PPO can call: ``model``, or
    ``python:MODULE:FUNCTION`` whose module imports and has a callable ``FUNCTION``, loaded as
    PPO loads it (:func:`rlhf_core.train.rule_rewards.load_reward_function`, which runs the module).

    Raises:
        PreflightError: naming ``ppo.reward``, the spec and why it cannot be loaded.
    """
    if parse_reward_spec(spec) is None:
        return
    from ..train.rule_rewards import load_reward_function  # imports torch

    try:
        load_reward_function(spec)
    except RewardSpecError as exc:
        raise PreflightError(
            _one_line(
                f"{exc}; set ppo.reward to 'model' or python:MODULE:FUNCTION naming an importable module and "
                "a function in it (e.g. python:rlhf_core.train.rule_rewards:word_count_12)"
            )
        ) from exc


# ------------------------------------------------------------------------ data


def check_local_data(data: DataConfig) -> None:
    """Check, for a local data source (``data.source`` local, or auto with a local directory or
    ``data.hub_subset``), that the directory exists and holds every split's JSONL file
    (:func:`rlhf_core.data.files.local_split_files`). The rows of ``data.hub_subset``, when they are
    what is read, are fetched into their cache folder first if they are not there yet
    (:func:`rlhf_core.data.hub_subset.ensure_local_rows`).

    Raises:
        DataError: naming ``data.local_dir`` (unset or missing), or the split's
            ``data.{kind}_splits.NAME.source`` key and the file looked for; or, for the subset's
            rows, neither cached nor fetchable (one line naming both ways out).
    """
    if data.resolved_source() != "local":
        return
    from ..data.hub_subset import ensure_local_rows

    ensure_local_rows(data)
    local_dir = data.resolved_local_dir()
    if not local_dir or not Path(local_dir).is_dir():
        where = f"{local_dir} does not exist" if local_dir else "neither it nor RLHF_TLDR_DIR is set"
        raise DataError(f"data.local_dir: the data source is local but {where}; set data.local_dir or RLHF_TLDR_DIR")
    for kind in DATA_KINDS:
        for name, spec in data.splits(kind).items():
            try:
                local_split_files(local_dir, kind, spec.source, data.format == "trl")
            except DataError as exc:
                key = "data.local_dir" if data.format == "trl" else f"data.{kind}_splits.{name}.source"
                raise DataError(f"{key}: {exc}") from None


def check_hub_datasets(data: DataConfig) -> None:
    """Check, for hub data (``data.source`` hub, or auto without a local directory), that
    ``data.sft_dataset`` and ``data.preference_dataset`` can be read: a local directory, or a
    dataset id that the hub has at ``data.revision`` or, offline or when the hub cannot be
    reached, that the local hub cache holds (:func:`check_hub_repo`).

    Raises:
        DataError: naming the key and the id: a path that does not exist, an id the hub does
            not have or denies access to, or one neither reachable nor cached.
    """
    if data.resolved_source() != "hub":
        return
    datasets = [("data.sft_dataset", data.sft_dataset), ("data.preference_dataset", data.preference_dataset)]
    if data.splits("prompt"):
        datasets.append(("data.prompt_dataset", data.dataset("prompt")))
    for key, name in datasets:
        path = Path(name).expanduser()
        if path.is_dir():
            continue
        if name.startswith(("/", ".", "~")):
            raise DataError(f"{key}: {name!r} is neither an existing directory nor a hub dataset id")
        check_hub_repo(key, name, "dataset", data.revision)


# ------------------------------------------------------------------------ models


def model_sources(cfg: PipelineConfig, stages: Iterable[str]) -> list[tuple[str, str, str | None]]:
    """The model and tokenizer sources the stages of ``stages`` read, as ``(key, source,
    revision)``, each source once: ``model.tokenizer`` (else ``model.base``) for the data and
    base model stages, ``model.base`` for the base model stage unless ``model.random_init`` is
    set, ``ppo.reward``'s existing reward model (``model:SOURCE[@REVISION]``) for the reward
    stage, ``eval.judge_model`` for the evaluation with the offline judge, and for ``policy_eval``
    the policies of ``eval.policies`` (hub ids with their ``@REVISION``) and ``eval.reward_model``."""
    stages, m = set(stages), cfg.model
    sources: dict[str, tuple[str, str, str | None]] = {}
    if stages & {"data", "base_model"}:
        key = "model.tokenizer" if m.tokenizer else "model.base"
        sources[m.tokenizer_source] = (key, m.tokenizer_source, m.revision)
    if "base_model" in stages and m.random_init is None and m.base:
        sources.setdefault(m.base, ("model.base", m.base, m.revision))
    external = external_reward_source(cfg.ppo.reward)
    if "reward" in stages and external is not None:
        sources.setdefault(external[0], ("ppo.reward", *external))
    if stages & JUDGING_STAGES and cfg.eval.judge == "offline" and cfg.eval.judge_model:
        sources.setdefault(cfg.eval.judge_model, ("eval.judge_model", cfg.eval.judge_model, None))
    if "policy_eval" in stages:
        for name, source in cfg.eval.policies.items():
            if not source.startswith("models:/"):  # a registered model: `rlhf evaluate` downloads it first
                sources.setdefault(source, (f"eval.policies[{name!r}]", *split_revision(source)))
        reward = cfg.eval.reward_model
        if reward and not reward.startswith("models:/"):
            location, revision = external_reward_source(reward) or (reward, None)
            sources.setdefault(location, ("eval.reward_model", location, revision))
    return list(sources.values())


def check_model_source(key: str, spec: str, revision: str | None = None) -> None:
    """Check that the model source ``spec`` of setting ``key`` exists: a ``pkg:`` path in its
    installed package, a ``configs:`` path in the presets folder, a local directory or GGUF file
    (:func:`rlhf_core.models.sources.resolve_source`), or a hub id the hub has at ``revision`` (or, offline or unreachable, the hub cache holds:
    :func:`check_hub_repo`). ``eval.judge_model`` (the offline judge) must be a local directory.

    Raises:
        ModelSourceError: naming ``key``, the source and what to do.
    """
    try:
        source = resolve_source(spec)
    except ModelSourceError as exc:
        kinds = {
            "eval.judge_model": "a local model directory",
            "ppo.reward": "model: and a directory or a hub id",
        }.get(key, "a directory, a .gguf file or a hub id")
        raise ModelSourceError(f"{key}: {exc}; set {key} to {kinds} that exists, or to pkg:PACKAGE/PATH") from None
    if key == "eval.judge_model" and source.kind != "local":
        raise ModelSourceError(
            f"eval.judge_model {spec!r}: an offline judge is a local model directory (save_pretrained layout); "
            "import other sources with `rlhf model` first"
        )
    if source.kind == "hub":
        check_hub_repo(key, spec, "model", revision)


# ------------------------------------------------------------------------ the hub


def hub_offline_setting() -> str | None:
    """``HF_HUB_OFFLINE=1`` when ``huggingface_hub`` is kept off the hub
    (``huggingface_hub.constants.HF_HUB_OFFLINE``), else ``None``."""
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else None


@functools.lru_cache(maxsize=256)
def _ask_hub(endpoint: str, repo_type: str, repo_id: str, revision: str | None) -> tuple[str, str] | None:
    """One metadata request for a repository at ``revision``: ``None`` when the hub has it,
    ``("unreachable", why)`` when the hub cannot be reached or fails, ``(kind, why)`` for a
    repository the hub does not give (``missing``, ``gated``, ``revision``, ``denied``). Kept
    for the process (a sweep checks every cell's settings)."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        HfApi(endpoint=endpoint).repo_info(repo_id, repo_type=repo_type, revision=revision, timeout=HUB_TIMEOUT)
    except GatedRepoError:
        return "gated", "gated"
    except RepositoryNotFoundError:
        return "missing", "not found"
    except RevisionNotFoundError:
        return "revision", "revision not found"
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status is not None and (status >= 500 or status == 429):
            return "unreachable", f"HTTP {status} from {endpoint}"
        return "denied", f"HTTP {status} from {endpoint}"
    except (httpx2.TransportError, OfflineModeIsEnabled) as exc:
        return "unreachable", _one_line(f"{type(exc).__name__}: {exc}")
    return None


def hub_cache_has(repo_id: str, repo_type: Literal["model", "dataset"], revision: str | None) -> bool:
    """Whether the local hub cache (``huggingface_hub.constants.HF_HUB_CACHE``) holds a snapshot
    of the repository at ``revision`` (default ``main``), found as ``huggingface_hub`` finds it
    offline (``snapshot_download(local_files_only=True)``). A partial snapshot counts: loaders
    fetch only the files they read."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, repo_type=repo_type, revision=revision, local_files_only=True)
    except IncompleteSnapshotError:
        return True
    except LocalEntryNotFoundError:
        return False
    return True


def check_hub_repo(key: str, repo_id: str, repo_type: Literal["model", "dataset"], revision: str | None = None) -> None:
    """Check that hub repository ``repo_id`` (named by setting ``key``) can be read at
    ``revision``. Online (``HF_HUB_OFFLINE`` unset), one metadata request (``HfApi.repo_info``,
    :data:`HUB_TIMEOUT`) settles it; offline, or when the hub cannot be reached, the repository
    passes only if the local hub cache, which the model loaders and the data stage then read,
    holds it (:func:`hub_cache_has`).

    Raises:
        ModelSourceError (a model), DataError (a dataset): naming ``key`` and the id, when the id
            is not a valid hub id, the hub does not have it or its revision (``model.revision``,
            ``data.revision``), denies access to it (gated or private), or it is neither
            reachable nor cached.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    error = ModelSourceError if repo_type == "model" else DataError
    revision_key = "model.revision" if repo_type == "model" else "data.revision"
    what = f"hub {repo_type} {repo_id!r}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise error(f"{key}: {repo_id!r} is not a valid hub id ({_one_line(str(exc))})") from None
    reason = hub_offline_setting()
    if reason is None:
        answer = _ask_hub(constants.ENDPOINT, repo_type, repo_id, revision)
        if answer is None:
            return
        kind, why = answer
        if kind == "missing":
            raise error(
                f"{key}: {what} does not exist on {constants.ENDPOINT}, or is private and HF_TOKEN gives no access "
                f"to it: check the id, or log in (hf auth login) with an account that can read it"
            )
        if kind == "gated":
            raise error(
                f"{key}: {what} is gated: accept its terms on its hub page and log in (hf auth login, or HF_TOKEN) "
                "with that account"
            )
        if kind == "revision":
            raise error(
                f"{revision_key}: {what} ({key}) has no revision {revision!r}; name an existing branch, tag or commit"
            )
        if kind == "denied":
            raise error(f"{key}: the hub refused to describe {what} ({why}); check HF_TOKEN's access to it")
        reason = why
    if hub_cache_has(repo_id, repo_type, revision):
        return
    at = f" at revision {revision!r}" if revision else ""
    download = f"hf download {repo_id}" + (" --repo-type dataset" if repo_type == "dataset" else "")
    raise error(
        f"{key}: {what}{at} is not in the local hub cache ({constants.HF_HUB_CACHE}) and the hub cannot be reached "
        f"({reason}): download it once with network access ({download}), or set {key} to a local copy"
    )


# ------------------------------------------------------------------------ the judge's key and server


def judge_key_missing(ecfg: EvalConfig, secret_block: str | None) -> str:
    """The one-line message for an API judge without the key it needs
    (:attr:`EvalConfig.judge_needs_key`): where a key may come from, its variable
    (``ANTHROPIC_API_KEY``, ``OPENAI_API_KEY``) and, when ``secret_block`` is given, the Prefect
    Secret block of that name (``eval.api_key_secret``). Never holds a key."""
    variable = ecfg.judge_key_variable
    judge = f"eval.judge is {ecfg.judge}" + (f" on {ecfg.judge_base_url}" if ecfg.judge == "openai" else "")
    other = " or point eval.judge_base_url at a server that needs no key," if ecfg.judge == "openai" else ""
    if variable is None and secret_block is None:  # a block named, and no way to look it up here
        return (
            f"{judge} and its key is in the Prefect Secret block {ecfg.api_key_secret!r} (eval.api_key_secret), "
            "which only a run with a Prefect server reads: run it with `rlhf run` or a deployment, or name the "
            "environment variable holding the key (eval.api_key_variable)"
        )
    if variable is None:  # another server, its key named as a Secret block only
        return (
            f"{judge} but no Prefect Secret block named {secret_block!r} exists (eval.api_key_secret): save the "
            "server's key in that block (prefect block create secret), or name the environment variable holding "
            "it (eval.api_key_variable)"
        )
    if secret_block is None:
        return f"{judge} but {variable} is not set: export {variable},{other} or set eval.judge=offline"
    return (
        f"{judge} but neither is {variable} set nor does a Prefect Secret block named {secret_block!r} exist "
        f"(eval.api_key_secret): export {variable}, or save the key in that block (prefect block create secret), "
        f"or set eval.api_key_secret to the name of yours"
    )


def check_judge_key(cfg: PipelineConfig, secret_exists: Callable[[str], bool] | None = None) -> None:
    """Check that an API judge that needs a key (:attr:`EvalConfig.judge_needs_key`: the Anthropic
    judge, the OpenAI judge on the OpenAI API) will have one: its environment variable
    (``ANTHROPIC_API_KEY``, ``OPENAI_API_KEY``), or, when ``secret_exists`` is given (a lookup of
    a secret's name, such as the Prefect Secret block lookup of :mod:`tasks.stages`), the secret
    named by ``eval.api_key_secret`` (:attr:`EvalConfig.judge_key_secret`). Only whether a key is
    there is checked; its value is never read.

    Raises:
        PreflightError: naming the variable and, with ``secret_exists``, ``eval.api_key_secret``
            (:func:`judge_key_missing`).
    """
    ecfg = cfg.eval
    if not ecfg.judge_needs_key or os.environ.get(ecfg.judge_key_variable or ""):
        return
    secret = ecfg.judge_key_secret
    if secret is not None and secret_exists is not None and secret_exists(secret):
        return
    raise PreflightError(judge_key_missing(ecfg, secret if secret_exists is not None else None))


def check_judge_server(cfg: PipelineConfig) -> None:
    """Check that the OpenAI judge's server (``eval.judge`` openai) answers and serves
    ``eval.judge_model``: one request for its model list (``GET {eval.judge_base_url}/models``,
    :data:`JUDGE_SERVER_TIMEOUT`, no retry), sent with the key the judge will send
    (:func:`rlhf_core.config.credentials.judge_key`: ``OPENAI_API_KEY`` to the OpenAI API's hosts
    only, ``eval.api_key_variable``'s to another server), never shown
    (:func:`rlhf_core.evaluation.judging.openai_judge.served_models`).
    A model listed as ``NAME:latest`` (Ollama) counts for ``NAME``. Not asked when the key the
    server needs is still in a Prefect Secret block (:func:`check_judge_key` found it there).

    Raises:
        PreflightError: one line naming ``eval.judge_base_url`` (the server cannot be reached,
            times out, has no model list or answers with an error), the key's variable (the
            server refuses the key or wants one) or ``eval.judge_model`` (not listed: the models
            it serves, the first ten), and what to do.
    """
    ecfg = cfg.eval
    key = judge_key(ecfg.judge_key_variable)
    if ecfg.judge != "openai" or (ecfg.judge_needs_key and not key):
        return
    from ..evaluation.judging import JudgeRequestError
    from ..evaluation.judging.openai_judge import served_models

    url = ecfg.judge_base_url
    try:
        models = served_models(url, api_key=key, timeout=JUDGE_SERVER_TIMEOUT)
    except JudgeRequestError as exc:
        why = _one_line(str(exc))
        if exc.status in (401, 403):
            variable = ecfg.judge_key_variable or "eval.api_key_variable"
            given = f"refused the key in {variable}" if key else "wants a key"
            where = variable if ecfg.judge_key_variable else "an environment variable named by eval.api_key_variable"
            raise PreflightError(
                f"{variable}: the judge's server {url} (eval.judge_base_url) {given} ({why}): export the key "
                f"it accepts as {where}"
            ) from None
        if exc.status is None and why.startswith(("connection failed", "timed out")):
            raise PreflightError(
                f"eval.judge_base_url: the judge's server {url} cannot be reached ({why}): start the server "
                "(vLLM, llama.cpp, Ollama serve an OpenAI-compatible API), or set eval.judge_base_url to its "
                "address, e.g. http://127.0.0.1:8000/v1"
            ) from None
        raise PreflightError(
            f"eval.judge_base_url: {url} gave no model list at {url.rstrip('/')}/models ({why}): set "
            "eval.judge_base_url to the server's OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1"
        ) from None
    if ecfg.judge_model not in models and f"{ecfg.judge_model}:latest" not in models:
        listed = ", ".join(models[:10]) + (f" and {len(models) - 10} more" if len(models) > 10 else "")
        raise PreflightError(
            f"eval.judge_model: {ecfg.judge_model!r} is not among the models the judge's server {url} serves "
            f"({listed or 'none'}): set eval.judge_model to one of them, or load it on the server"
        )


# ------------------------------------------------------------------------ entry point


def check_judge_prompt(cfg: PipelineConfig) -> None:
    """Check that ``eval.judge_prompt``, when set, is a readable template naming ``{prompt}``,
    ``{a}`` and ``{b}`` (:func:`rlhf_core.evaluation.judging.prompt.load_judge_prompt`).

    Raises:
        PreflightError: naming ``eval.judge_prompt``, the file and what is wrong.
    """
    from ..evaluation.judging.prompt import load_judge_prompt

    try:
        load_judge_prompt(cfg.eval.judge_prompt, cfg.data.format)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


def check_before_stages(
    cfg: PipelineConfig,
    stages: Iterable[str] | None = None,
    secret_exists: Callable[[str], bool] | None = None,
) -> None:
    """Check what the stages ``stages`` (default: every stage, :data:`rlhf_core.run.pipeline.STAGES`;
    ``stages_until(until)`` for a run that stops early) will read, before the first starts,
    cheapest first: the split settings (:func:`check_splits`), the local data files
    (:func:`check_local_data`) and ``ppo.reward`` (:func:`check_reward_function`), then the
    model and tokenizer sources (:func:`model_sources`, :func:`check_model_source`) and the hub
    datasets (:func:`check_hub_datasets`), for ``policy_eval`` the policies themselves
    (:func:`rlhf_core.evaluation.policies.check_policies`), then the judge's key
    (:func:`check_judge_key`, with ``secret_exists``) and the OpenAI judge's server
    (:func:`check_judge_server`). Each check applies only where a stage of ``stages`` reads its
    settings.

    Raises:
        PreflightError, ModelSourceError, DataError: the first failure, naming the setting's key.
        KeyError: ``stages`` names something that is not a stage.
    """
    names = stages_until() if stages is None else list(stages)
    unknown = [s for s in names if s not in STAGES and s not in ON_DEMAND]
    if unknown:
        raise KeyError(f"not stages: {', '.join(unknown)}; the stages are {', '.join([*STAGES, *ON_DEMAND])}")
    check_splits(cfg, names)
    if "data" in names:
        check_local_data(cfg.data)
    if "ppo" in names:
        check_reward_function(cfg.ppo.reward)
    for key, spec, revision in model_sources(cfg, names):
        check_model_source(key, spec, revision)
    if "data" in names:
        check_hub_datasets(cfg.data)
    if "policy_eval" in names:  # each policy a causal LM reading the preset's tokenizer
        from ..evaluation.policies import check_policies

        check_policies(cfg)
    if JUDGING_STAGES & set(names):
        check_judge_prompt(cfg)
        check_judge_key(cfg, secret_exists)
        check_judge_server(cfg)
