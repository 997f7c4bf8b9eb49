"""The pipeline's stage table: the stages in order, what each reads, its config sections and function.

Each stage's entry names what it reads, which config sections it depends on, and the
``rlhf_core`` function that runs it. The command line (``rlhf run``) and the Prefect
tasks (``tasks/stages.py``) both run stages from this one table. What a stage key reads of the
data and of the model sources comes from :mod:`rlhf_core.models.sources`, which loads neither torch,
transformers nor datasets: a command whose stages are all finished finds so at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..common.io import json_digest
from ..common.stage_code import StageCode, stage_code
from ..common.tracking import Tracker
from ..config.presets import flatten
from ..config.settings import PipelineConfig
from ..data.files import data_fingerprint
from ..models.sources import (
    external_reward_fingerprint,
    external_reward_source,
    judge_prompt_fingerprint,
    policy_fingerprint,
    resolve_source,
    reward_code_digest,
    source_fingerprint,
)


@dataclass(frozen=True)
class Stage:
    """One stage.

    ``inputs`` names the stages whose output directories it reads, in the order ``run``
    takes them. ``keys`` are the config values it depends on itself: a whole section
    (``"sft"``), one field (``"reward.eval_max_samples"``) or a top-level value (``"name"``);
    ``ignore`` names fields of those sections it does not read (so changing an evaluation
    setting does not re-train), and ``unread(cfg)`` those it does not read in this
    configuration (``ppo.scale_rewards`` but under GRPO); :data:`RUN_ONLY` is in no key.
    Upstream settings reach a stage through its inputs. ``reads(cfg)`` fingerprints what else
    it reads that is not a setting (data files, a model's files, a reward function's source),
    so that a change there re-runs it too. ``run(cfg, input_dirs, out_dir, tracker)`` writes
    the stage's output into ``out_dir`` and returns its metrics or record. ``branch`` names
    the method a stage belongs to when the pipeline trains two from the same SFT policy
    (``"ppo"``: the reward model and PPO; ``"dpo"``): a run that stops at a stage of one branch
    skips the other (:func:`stages_until`).
    """

    name: str
    inputs: tuple[str, ...]
    keys: tuple[str, ...]
    run: Callable[[PipelineConfig, list[Path], Path, Tracker], dict[str, Any]]
    ignore: tuple[str, ...] = ()
    reads: Callable[[PipelineConfig], dict[str, Any]] | None = None
    branch: str | None = None
    unread: Callable[[PipelineConfig], tuple[str, ...]] | None = None

    @property
    def sections(self) -> tuple[str, ...]:
        """The config sections the stage reads from (whole or in part)."""
        return tuple(dict.fromkeys(k.split(".", 1)[0] for k in self.keys))


def _data_reads(cfg: PipelineConfig) -> dict[str, Any]:
    return {
        "data": data_fingerprint(cfg.data),
        "tokenizer": source_fingerprint(cfg.model.tokenizer_source, cfg.model.revision),
    }


def _base_model_reads(cfg: PipelineConfig) -> dict[str, Any]:
    m = cfg.model
    return {
        "tokenizer": source_fingerprint(m.tokenizer_source, m.revision),
        "base": None if m.random_init is not None else source_fingerprint(m.base, m.revision),  # type: ignore[arg-type]
    }


def _reward_reads(cfg: PipelineConfig) -> dict[str, Any]:
    # ppo.reward model:SOURCE: the existing reward model's files (or hub id and revision) and spec
    return {"external_reward": external_reward_fingerprint(cfg.ppo.reward)}


def _ppo_reads(cfg: PipelineConfig) -> dict[str, Any]:
    # a reward function may live outside rlhf_core
    return {"reward_code": reward_code_digest(cfg.ppo.reward)}


def _evaluation_reads(cfg: PipelineConfig) -> dict[str, Any]:
    local_judge = cfg.eval.judge == "offline" and cfg.eval.judge_model  # default: the base model, an input
    reads = {"judge": source_fingerprint(cfg.eval.judge_model) if local_judge else None}  # type: ignore[arg-type]
    if cfg.eval.judge_prompt:  # the template file, by content (unset: the prompt is in the code)
        reads["judge_prompt"] = judge_prompt_fingerprint(cfg.eval.judge_prompt)
    return reads


def _policy_eval_reads(cfg: PipelineConfig) -> dict[str, Any]:
    # the policies and the reward model by their files (or hub id and revision), beside the judge
    return _evaluation_reads(cfg) | {
        "policies": {name: policy_fingerprint(source) for name, source in cfg.eval.policies.items()},
        "reward_model": policy_fingerprint(cfg.eval.reward_model) if cfg.eval.reward_model else None,
    }


def _data(cfg, inputs, out, tracker):
    from ..data.prepare import prepare_data

    return prepare_data(cfg, out, overwrite=True)


def _base_model(cfg, inputs, out, tracker):
    from ..models.base import import_base_model

    return import_base_model(cfg.model, out, overwrite=True)


def _sft(cfg, inputs, out, tracker):
    from ..train.sft import run_sft

    data, base = inputs
    return run_sft(cfg.sft, data, base, out, tracker)


def _reward(cfg, inputs, out, tracker):
    from ..train.external_reward import import_reward_model
    from ..train.reward import run_reward_training

    if external_reward_source(cfg.ppo.reward) is not None:  # ppo.reward model:SOURCE: none trained
        return import_reward_model(cfg.ppo.reward, out, append_eos=cfg.reward.external_append_eos)
    data, sft = inputs
    return run_reward_training(cfg.reward, data, sft / "model", out, tracker)


def _reward_norm(cfg, inputs, out, tracker):
    from ..train.reward import normalize_reward_model

    data, reward = inputs
    return normalize_reward_model(cfg.reward, data, reward / "model", out, tracker)


def _reward_eval(cfg, inputs, out, tracker):
    from ..evaluation.reward_eval import evaluate_reward_model

    data, reward_norm = inputs
    return evaluate_reward_model(cfg.reward, data, reward_norm / "model", out, tracker)


def _ppo(cfg, inputs, out, tracker):
    from ..ppo.trainer import run_ppo

    data, sft, reward_norm = inputs
    return run_ppo(cfg.ppo, data, sft / "model", reward_norm / "model", out, tracker)


#: Fields of the ``reward`` section that only the evaluation and normalisation stages read.
REWARD_EVAL_KEYS = ("reward.eval_splits", "reward.eval_max_samples", "reward.calibration_bins")
REWARD_NORM_KEYS = ("reward.normalize", "reward.normalization_split", "reward.normalization_max_samples")
#: Settings that change how a model is run but not what it computes beyond float rounding.
REWARD_RUN_KEYS = ("reward.micro_batch_size", "reward.bf16")


def _dpo(cfg, inputs, out, tracker):
    from ..train.dpo import run_dpo

    data, sft = inputs
    return run_dpo(cfg.dpo, data, sft / "model", out, tracker)


def _dpo_eval(cfg, inputs, out, tracker):
    from ..evaluation.dpo_eval import evaluate_dpo_reward

    data, sft, dpo = inputs
    return evaluate_dpo_reward(cfg.dpo, cfg.reward, data, dpo / "model", sft / "model", out, tracker)


def _evaluation(cfg, inputs, out, tracker):
    from ..evaluation.stage import run_evaluation
    from ..report.run_report import StageOutputs, finish_evaluation

    data, base, sft, reward, reward_norm, reward_eval, ppo, dpo, dpo_eval = inputs
    # Judgements are shared by every run of the stage beside this one: never paid for twice.
    cache = Path(os.environ.get("RLHF_JUDGE_CACHE") or out.parent / "judge_cache.jsonl")
    policies = {"sft": sft / "model", "ppo": ppo / "model", "dpo": dpo / "model"}
    evaluation = run_evaluation(cfg, data, base, policies, reward_norm / "model", out, tracker, cache)
    # the report, after the evaluation: the learning checks and every stage's own figures
    stages = StageOutputs(data, sft, reward, reward_eval, ppo, dpo, dpo_eval)
    return finish_evaluation(cfg, evaluation, stages, out, tracker)


def _policy_eval(cfg, inputs, out, tracker):
    from ..evaluation.policies import evaluate_policies
    from ..report.policy_report import finish_policy_evaluation

    data, base = inputs
    cache = Path(os.environ.get("RLHF_JUDGE_CACHE") or out.parent / "judge_cache.jsonl")
    evaluation = evaluate_policies(cfg, data, base, out, tracker, cache)
    return finish_policy_evaluation(cfg, evaluation, out, tracker)


#: The settings of the ``eval`` section that only ``policy_eval`` reads.
POLICY_EVAL_KEYS = ("eval.policies", "eval.reward_model")
#: Settings that change how a stage runs (how many requests at once, where a key is kept), never
#: what it computes: in no stage's key.
RUN_ONLY = ("eval.concurrency", "eval.api_key_secret", "eval.api_key_variable")
#: The ``data`` settings that name hub datasets, read only when the rows come from the hub.
DATA_HUB_KEYS = (
    "data.sft_dataset",
    "data.preference_dataset",
    "data.preference_config",
    "data.prompt_dataset",
    "data.revision",
)


#: The ``data`` settings that only TRL-format rows read.
DATA_TRL_KEYS = ("data.columns", "data.max_query_length", "data.prompt_truncation")


def _revision_unread(source: str) -> bool:
    """Whether ``model.revision`` goes unread for ``source``: it pins hub ids only."""
    return resolve_source(source).kind != "hub"


def _data_unread(cfg: PipelineConfig) -> tuple[str, ...]:
    # the tokenizer is all the data stage reads of the model section
    unread = ["model.dtype", "model.random_init"] + (["model.base"] if cfg.model.tokenizer else [])
    if _revision_unread(cfg.model.tokenizer_source):
        unread.append("model.revision")
    if cfg.data.format != "trl":
        unread += DATA_TRL_KEYS
    if cfg.data.resolved_source() == "local":  # a folder, or the subset's rows fetched into one
        unread += DATA_HUB_KEYS
        if cfg.data.subset_in_use() is None:
            unread.append("data.hub_subset")
    return tuple(unread)


def _base_model_unread(cfg: PipelineConfig) -> tuple[str, ...]:
    # a random-init model is built from the tokenizer alone: the base model is not read
    if cfg.model.random_init is not None:
        return ("model.base",) + (("model.revision",) if _revision_unread(cfg.model.tokenizer_source) else ())
    hub = not _revision_unread(cfg.model.base) or not _revision_unread(cfg.model.tokenizer_source)  # type: ignore[arg-type]
    return () if hub else ("model.revision",)


def _reward_unread(cfg: PipelineConfig) -> tuple[str, ...]:
    # an existing reward model is imported untrained: only whether its plain texts end with EOS
    if external_reward_source(cfg.ppo.reward) is None:
        return ("reward.external_append_eos",)
    return tuple(f"reward.{name}" for name in type(cfg.reward).model_fields if name != "external_append_eos")


def _ppo_unread(cfg: PipelineConfig) -> tuple[str, ...]:
    return tuple(f"ppo.{name}" for name in cfg.ppo.unread_settings())


def _dpo_unread(cfg: PipelineConfig) -> tuple[str, ...]:
    return tuple(f"dpo.{name}" for name in cfg.dpo.unread_settings())


def _judge_unread(cfg: PipelineConfig) -> tuple[str, ...]:
    # the API judges' own settings, unread by the others
    unread = () if cfg.eval.judge == "openai" else ("eval.judge_base_url", "eval.judge_request")
    return unread + (("eval.judge_max_tokens",) if cfg.eval.judge == "offline" else ())


def _policy_eval_unread(cfg: PipelineConfig) -> tuple[str, ...]:
    # an existing reward model scoring the policies reads whether its plain texts end with EOS
    external = external_reward_source(cfg.eval.reward_model or "") is not None
    # no token-shift table: the policies have no SFT model of the pipeline's to compare with
    return _judge_unread(cfg) + ("eval.token_shift_samples",) + (() if external else ("reward.external_append_eos",))


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("data", (), ("data", "model"), _data, reads=_data_reads, unread=_data_unread),
        Stage("base_model", (), ("model",), _base_model, reads=_base_model_reads, unread=_base_model_unread),
        Stage("sft", ("data", "base_model"), ("sft",), _sft),
        Stage(
            "reward",
            ("data", "sft"),
            ("reward",),
            _reward,
            ignore=REWARD_EVAL_KEYS + REWARD_NORM_KEYS,
            reads=_reward_reads,
            branch="ppo",
            unread=_reward_unread,
        ),
        Stage("reward_norm", ("data", "reward"), REWARD_NORM_KEYS + REWARD_RUN_KEYS, _reward_norm, branch="ppo"),
        Stage("reward_eval", ("data", "reward_norm"), REWARD_EVAL_KEYS + REWARD_RUN_KEYS, _reward_eval, branch="ppo"),
        Stage(
            "ppo", ("data", "sft", "reward_norm"), ("ppo",), _ppo, reads=_ppo_reads, branch="ppo", unread=_ppo_unread
        ),
        # DPO's implicit reward model is evaluated on the reward model's validation pairs, with
        # its settings (reward.eval_*), so that the report compares the two pair for pair.
        Stage("dpo", ("data", "sft"), ("dpo",), _dpo, branch="dpo", unread=_dpo_unread),
        Stage("dpo_eval", ("data", "sft", "dpo"), REWARD_EVAL_KEYS, _dpo_eval, branch="dpo"),
        Stage(
            "evaluation",
            ("data", "base_model", "sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval"),
            ("eval", "ppo.temperature", "ppo.non_eos_penalty", "model.base", "name"),  # the judge's and report's names
            _evaluation,
            ignore=POLICY_EVAL_KEYS,
            reads=_evaluation_reads,
            unread=_judge_unread,
        ),
    )
}

#: Stages that no pipeline run holds, each run by a command of its own from the stages it reads:
#: ``policy_eval``, the evaluation of policies from elsewhere (``eval.policies``) by ``rlhf evaluate``.
ON_DEMAND: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage(
            "policy_eval",
            ("data", "base_model"),
            ("eval", "ppo.temperature", "ppo.non_eos_penalty", "reward.external_append_eos", "model.base", "name"),
            _policy_eval,
            ignore=POLICY_EVAL_KEYS,  # the policies and the reward model enter by name and files: reads
            reads=_policy_eval_reads,
            unread=_policy_eval_unread,
        ),
    )
}


def stage_entry(name: str) -> Stage:
    """Stage ``name`` of :data:`STAGES` or :data:`ON_DEMAND`.

    Raises:
        KeyError: no stage has that name.
    """
    if name in STAGES:
        return STAGES[name]
    if name in ON_DEMAND:
        return ON_DEMAND[name]
    raise KeyError(f"no stage {name!r}; the stages are {', '.join([*STAGES, *ON_DEMAND])}")


def stage_settings(name: str, cfg: PipelineConfig) -> set[str]:
    """The settings stage ``name`` reads itself in ``cfg``, dotted (``ppo.kl_coef``; ``name``):
    its keys' fields less ``ignore``, ``unread(cfg)`` and :data:`RUN_ONLY`.

    Raises:
        KeyError: ``name`` is not a stage.
    """
    stage = stage_entry(name)
    dropped = {*stage.ignore, *(stage.unread(cfg) if stage.unread else ()), *RUN_ONLY}
    settings: set[str] = set()
    for key in stage.keys:
        section, _, field = key.partition(".")
        value = getattr(cfg, section)
        if field or not isinstance(value, BaseModel):
            settings.add(key)
        else:
            settings |= {f"{section}.{f}" for f in type(value).model_fields}
    return settings - dropped


def stage_config(cfg: PipelineConfig, name: str) -> dict[str, Any]:
    """The config values stage ``name`` depends on itself (:func:`stage_settings`), as
    ``{key: value}`` (JSON-serialisable): a whole section's dump less the fields it does not
    read, or one field's value.

    Raises:
        KeyError: ``name`` is not a stage.
    """
    stage = stage_entry(name)
    settings = stage_settings(name, cfg)
    values: dict[str, Any] = {}
    for key in stage.keys:
        section, _, field = key.partition(".")
        value = getattr(cfg, section)
        if not isinstance(value, BaseModel):
            if key in settings:
                values[key] = value
            continue
        dumped = value.model_dump(mode="json")
        if field:
            if key in settings:
                values[key] = dumped[field]
        else:
            values[key] = {k: v for k, v in dumped.items() if f"{section}.{k}" in settings}
    return values


#: The directory of the ``rlhf_core`` package, whose sources the stage keys digest.
SOURCE_ROOT = Path(__file__).parents[1]


def code_version(name: str) -> StageCode:
    """The code stage ``name`` runs, read once per process
    (:func:`rlhf_core.common.stage_code.stage_code` of :data:`SOURCE_ROOT`, this module holding the
    stage table): its run function in :data:`STAGES` (with the definitions of this module it
    names) and the source of every ``rlhf_core`` module that function imports, transitively, at
    module level or inside functions (``judging/`` included): ``digest`` over them all and
    ``modules``, each module's own digest. An edit re-runs the stages whose code it touches,
    and, through their keys or artifacts, the stages after them; not the whole pipeline
    (``benchmarks/stage_keys.py`` lists, for every module, the stages an edit to it re-runs).

    The trade-off: a module imported inside any function of a covered module counts, whether
    or not the stage calls that function, so some edits re-run a stage that would not have run
    the edited code. Code reached by a dynamic import outside ``rlhf_core`` is not covered
    here: a rule reward ``python:MODULE:FUNCTION`` is covered by its own source's digest in the
    PPO stage's ``reads`` (:func:`rlhf_core.models.sources.reward_code_digest`).

    Raises:
        KeyError: ``name`` has no entry in the stage table.
    """
    return stage_code(SOURCE_ROOT, __name__, name)


def stage_key_parts(name: str, cfg: PipelineConfig, upstream: list[str], **context: str) -> dict[str, Any]:
    """What the cache key of stage ``name`` digests (:func:`stage_key`), as JSON: ``config``, the
    settings the stage reads itself (:func:`stage_config`); ``upstream``, one string per input
    stage in ``Stage.inputs`` order that changes whenever that stage's output may (its key, or
    its artifact's content digest); ``code``, the digest of the code it runs
    (:func:`code_version`: its run function and the ``rlhf_core`` modules that imports, not the
    whole package); ``reads``, what else it reads (``Stage.reads``: the data files' contents,
    the model source's files, a rule reward's source); and ``context`` (for example where the
    artifacts are stored).

    Raises:
        KeyError: ``name`` is not a stage.
        DataError, ModelSourceError: what the stage reads cannot be found.
    """
    stage = stage_entry(name)
    payload: dict[str, Any] = {
        "stage": name,
        "config": stage_config(cfg, name),
        "upstream": list(upstream),
        "code": code_version(name).digest,
        **context,
    }
    if stage.reads is not None:
        payload["reads"] = stage.reads(cfg)
    return payload


def key_of(parts: dict[str, Any]) -> str:
    """The cache key (24 hex) of a stage's key parts (:func:`stage_key_parts`): the SHA-256 of
    their canonical JSON (:func:`rlhf_core.common.io.json_digest`)."""
    return json_digest(parts, length=24)


def stage_key(name: str, cfg: PipelineConfig, upstream: list[str], **context: str) -> str:
    """The cache key of stage ``name`` (24 hex): :func:`key_of` its :func:`stage_key_parts`, the
    one key scheme of ``rlhf run`` and of the Prefect tasks (``tasks.stages.task_key_parts``).

    Raises:
        KeyError: ``name`` is not a stage.
        DataError, ModelSourceError: what the stage reads cannot be found.
    """
    return key_of(stage_key_parts(name, cfg, upstream, **context))


def key_record(parts: dict[str, Any]) -> dict[str, Any]:
    """What a finished stage records of its key (``stage.json``'s ``parts``): its parts
    (:func:`stage_key_parts`) with the settings' digest (``config_digest``) and the digest of
    each module its code covers (``code_modules``, by path), so that a later plan can say which
    part changed (:func:`key_changes`)."""
    return {
        **parts,
        "config_digest": json_digest(parts["config"]),
        "code_modules": code_version(parts["stage"]).modules,
    }


def key_changes(recorded: dict[str, Any], parts: dict[str, Any]) -> list[str]:
    """Why stage ``parts["stage"]``'s key differs from the one a finished output recorded: one
    phrase per part that changed, naming the settings (with old and new values), the code's
    modules, the inputs, and what else it reads; empty when ``recorded`` (a
    :func:`key_record`) matches ``parts`` (:func:`stage_key_parts`).
    """
    reasons = []
    old, new = flatten(recorded.get("config", {})), flatten(parts["config"])
    settings = [k for k in sorted(set(old) | set(new), key=str) if old.get(k, "unset") != new.get(k, "unset")]
    if settings:
        shown = [f"{k} {old.get(k, 'unset')!r} -> {new.get(k, 'unset')!r}" for k in settings[:4]]
        more = f" and {len(settings) - 4} more" if len(settings) > 4 else ""
        reasons.append(f"its settings changed: {', '.join(shown)}{more}")
    if recorded.get("code") != parts["code"]:
        was, now = recorded.get("code_modules", {}), code_version(parts["stage"]).modules
        modules = [m for m in sorted(set(was) | set(now)) if was.get(m) != now.get(m)]
        where = ", ".join(modules) if modules else "its run function in the stage table (rlhf_core/run/pipeline.py)"
        reasons.append(f"its code changed: {where}")
    inputs = stage_entry(parts["stage"]).inputs
    was_up = recorded.get("upstream", [])
    changed = [s for i, s in enumerate(inputs) if i >= len(was_up) or was_up[i] != parts["upstream"][i]]
    if changed:
        reasons.append(f"its input{'s' if len(changed) > 1 else ''} {', '.join(changed)} changed")
    was_reads, reads = recorded.get("reads") or {}, parts.get("reads") or {}
    files = [k for k in sorted(set(was_reads) | set(reads)) if was_reads.get(k) != reads.get(k)]
    if files:
        reasons.append(f"what it reads changed: {', '.join(files)}")
    known = {"stage", "config", "upstream", "code", "reads", "config_digest", "code_modules"}
    context = [k for k in sorted((set(recorded) | set(parts)) - known) if recorded.get(k) != parts.get(k)]
    if context:
        reasons.append(f"its context changed: {', '.join(context)}")
    return reasons


def needed_stages(name: str) -> set[str]:
    """Stage ``name`` and every stage it reads, directly or through others."""
    needed, todo = set(), [name]
    while todo:
        s = todo.pop()
        if s not in needed:
            needed.add(s)
            todo.extend(STAGES[s].inputs)
    return needed


def stages_until(until: str | None = None) -> list[str]:
    """The stages a run that stops after ``until`` runs, in order: every stage up to it in
    :data:`STAGES`, except those of another branch (``Stage.branch``) that it does not read.
    So ``until="dpo"`` trains no reward model and ``until="ppo"`` no DPO policy; ``None``:
    every stage.

    Raises:
        KeyError: ``until`` is not a stage.
    """
    names = list(STAGES)
    if until is None:
        return names
    if until not in STAGES:
        raise KeyError(f"no stage {until!r}; the stages are {', '.join(STAGES)}")
    needed, branch = needed_stages(until), STAGES[until].branch
    return [
        s
        for s in names[: names.index(until) + 1]
        if s in needed or STAGES[s].branch is None or STAGES[s].branch == branch
    ]


def key_parts(cfg: PipelineConfig, until: str | None = None) -> dict[str, dict[str, Any]]:
    """``{stage: stage_key_parts}`` for the stages of :func:`stages_until` (default: all), each
    stage's upstream being its inputs' keys: the keys ``rlhf run`` compares with a finished
    stage's marker (:func:`stage_keys`) and what it records of them (:func:`key_record`).

    Raises:
        KeyError: ``until`` is not a stage.
        DataError, ModelSourceError: what a stage reads cannot be found.
    """
    parts: dict[str, dict[str, Any]] = {}
    keys: dict[str, str] = {}
    for name in stages_until(until):
        parts[name] = stage_key_parts(name, cfg, [keys[dep] for dep in STAGES[name].inputs])
        keys[name] = key_of(parts[name])
    return parts


def stage_keys(cfg: PipelineConfig, until: str | None = None) -> dict[str, str]:
    """``{stage: stage_key}`` for the stages of :func:`stages_until` (default: all), each
    stage's upstream being its inputs' keys (:func:`key_parts`): what ``rlhf run`` compares with
    a finished stage's marker.

    Raises:
        KeyError: ``until`` is not a stage.
    """
    return {name: key_of(parts) for name, parts in key_parts(cfg, until).items()}
