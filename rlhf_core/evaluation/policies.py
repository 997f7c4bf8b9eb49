"""Any policy judged as the pipeline's are: the stage ``policy_eval`` of ``rlhf evaluate``.

A released checkpoint (Huang et al. 2024, arXiv:2403.17031, Appendix H: the paper's PPO, DPO and
SFT policies on the hub), another run's policy or any causal LM that reads the preset's
tokenizer is sampled on the evaluation prompts, judged against the human references with the
configured judge (Figure 1, Appendix I), measured for ROUGE-L, length and repetition and, where a
reward model is given (``eval.reward_model``), scored by it, with the reward model's agreement
with the judge (Detail 17). The policies are ``eval.policies`` (``{name: source}``);
:func:`evaluate_policies` returns an :class:`~rlhf_core.evaluation.stage.Evaluation` that
:func:`rlhf_core.report.policy_report.finish_policy_evaluation` turns into the report.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from ..common.errors import ModelSourceError
from ..common.tracking import NullTracker, Tracker
from ..config.settings import PipelineConfig, policy_key
from ..data.prepared import load_data_tokenizer
from ..models.sources import resolve_source, split_revision
from ..train.training import pick_device, precision_name
from .stage import Evaluation, load_eval_prompts, policy_measurements, sample_policies, score_policies, summary_rows
from .verdicts import judge_summaries, write_evaluation

log = logging.getLogger(__name__)

#: Architectures whose name ends so are causal language models (``LlamaForCausalLM``, ``GPT2LMHeadModel``).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def policy_directory(name: str, source: str) -> Path:
    """The local directory of policy ``name``: ``source`` itself, or a hub id's snapshot in the
    hub cache (``huggingface_hub.snapshot_download``: downloaded once, then read offline).

    Raises:
        ModelSourceError: naming the policy: the source is a GGUF file, a registered MLflow
            model (``models:/``, resolved by ``rlhf evaluate`` before the stage runs), or cannot
            be found or downloaded.
    """
    if source.startswith("models:/"):
        raise ModelSourceError(
            f"policy {name!r}: {source} is a registered MLflow model; evaluate it with `rlhf evaluate`"
        )
    location, revision = split_revision(source)
    try:
        resolved = resolve_source(location)
    except ModelSourceError as exc:
        raise ModelSourceError(f"policy {name!r}: {exc}") from None
    if resolved.kind == "gguf":
        raise ModelSourceError(f"policy {name!r}: {source} is a GGUF file; import it with `rlhf model` first")
    if resolved.kind == "local":
        return Path(resolved.location)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(resolved.location, revision=revision))
    except Exception as exc:  # offline without a cached snapshot, unknown repository or revision
        raise ModelSourceError(
            f"policy {name!r}: hub model {location} at revision {revision or 'main'} cannot be read: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None


def check_policy(name: str, path: Path, tokenizer) -> None:
    """Refuse, in one line naming policy ``name``, a directory that is no causal LM reading the
    preset's tokenizer: no ``config.json``, an architecture that is not a causal LM
    (:data:`CAUSAL_LM_SUFFIXES`), a tokenizer of its own whose vocabulary or EOS differs from
    ``tokenizer`` (the preset's, with its PAD), or fewer embedding rows than ``tokenizer`` has ids.

    Raises:
        ModelSourceError: naming the policy and what differs.
    """
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"policy {name!r}: {path} holds no config.json (not a save_pretrained model directory)")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith(CAUSAL_LM_SUFFIXES) for a in architectures):
        raise ModelSourceError(
            f"policy {name!r}: {', '.join(architectures)} is not a causal language model "
            f"(an architecture ending in {' or '.join(CAUSAL_LM_SUFFIXES)} is needed)"
        )
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        own = AutoTokenizer.from_pretrained(str(path))
        theirs, ours = own.get_vocab(), tokenizer.get_vocab()
        if theirs != ours or own.eos_token_id != tokenizer.eos_token_id:
            differing = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda item: item[1])[:1]
            example = f"; e.g. {differing[0][0]!r} (id {differing[0][1]}) is in one only" if differing else ""
            raise ModelSourceError(
                f"policy {name!r}: its tokenizer differs from the preset's ({len(theirs)} tokens, EOS id "
                f"{own.eos_token_id}, against {len(ours)} tokens, EOS id {tokenizer.eos_token_id}{example}); "
                "evaluate it with a preset whose model.tokenizer is its own"
            )
    rows = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if rows is not None and rows < len(tokenizer):
        raise ModelSourceError(
            f"policy {name!r}: {rows} embedding rows for the preset's {len(tokenizer)} token ids; "
            "it was not trained with this tokenizer"
        )


def check_policies(cfg: PipelineConfig) -> None:
    """Each policy of ``eval.policies`` found (:func:`policy_directory`) and checked against the
    preset's tokenizer (:func:`check_policy`), before any stage runs: what ``rlhf evaluate``'s
    preflight asks.

    Raises:
        ModelSourceError: the first policy refused, in one line naming it.
    """
    from ..models.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    for name, source in cfg.eval.policies.items():
        check_policy(name, policy_directory(name, source), tokenizer)


def evaluate_policies(
    cfg: PipelineConfig,
    data_dir: str | os.PathLike,
    base_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
    judgement_cache: str | os.PathLike | None = None,
) -> Evaluation:
    """Sample, judge and measure the policies of ``eval.policies`` (scored by ``eval.reward_model``
    when set) as :func:`rlhf_core.evaluation.stage.run_evaluation` does the pipeline's; write
    ``summaries.jsonl`` and ``judgements.jsonl`` to ``out_dir``.

    Args:
        cfg: reads ``cfg.eval`` (the policies, the reward model, the judge and its settings),
            ``cfg.ppo.temperature`` (diversity samples) and ``cfg.ppo.non_eos_penalty`` (the
            score of a summary without EOS, Detail 23).
        data_dir: the prepared data (prompts, references, the preset's tokenizer).
        base_model_dir: the preset's base model: the offline judge when ``eval.judge_model`` is unset.
        tracker: receives the ``eval.*`` settings and each policy's source as parameters.
        judgement_cache: a JSONL file shared across runs (default ``out_dir/judge_cache.jsonl``).

    Returns:
        An :class:`Evaluation` (no KL from SFT, no token shift) whose metrics are
        :func:`~rlhf_core.evaluation.stage.policy_measurements`' for each policy under its key
        (:func:`rlhf_core.config.settings.policy_key`), ``eval/judge/...`` and ``eval/samples``.

    Raises:
        ValueError: ``eval.policies`` is empty; ModelSourceError: a policy or the reward model
        cannot be read or is refused (:func:`check_policy`); KeyError, JudgeConfigError,
        JudgeRequestError: as :func:`~rlhf_core.evaluation.stage.run_evaluation`.
    """
    ecfg = cfg.eval
    if not ecfg.policies:
        raise ValueError("eval.policies names no policy to evaluate (rlhf evaluate --policy SOURCE)")
    tracker = tracker or NullTracker()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    prompts = load_eval_prompts(data_dir, ecfg)
    tokenizer = load_data_tokenizer(data_dir)
    labels = {policy_key(name): name for name in ecfg.policies}
    model_dirs = {policy_key(name): policy_directory(name, source) for name, source in ecfg.policies.items()}
    for key, path in model_dirs.items():
        check_policy(labels[key], path, tokenizer)
    device = pick_device()
    tracker.log_params(
        {f"eval.{k}": v for k, v in ecfg.model_dump().items() if k != "policies"}
        | {f"eval.policies.{key}": ecfg.policies[name] for key, name in labels.items()}
        | {"eval.precision": precision_name(ecfg.bf16, device)}
    )
    # 1. Summaries: near-greedy for win rates, at the training temperature for diversity.
    summaries, diverse = sample_policies(model_dirs, tokenizer, prompts, ecfg, cfg.ppo.temperature, device)
    # 2. Scores, where a reward model is given, with PPO's EOS trick (Detail 23).
    scored = None
    if ecfg.reward_model:
        reward_dir = reward_model_directory(ecfg.reward_model, out, cfg)
        scored = score_policies(
            reward_dir, data_dir, tokenizer, prompts, summaries, ecfg, cfg.ppo.non_eos_penalty, device
        )
    # 3. The judge against the references, and on human-labelled comparisons.
    judged = judge_summaries(cfg, Path(base_model_dir), data_dir, prompts, summaries, device, judgement_cache, out)
    # 4. Measurements and files.
    policies = list(labels.items())
    verdicts = judged.verdicts
    metrics, headline, curves = policy_measurements(prompts, summaries, diverse, scored, verdicts, ecfg, policies)
    rows = summary_rows(prompts, summaries, scored, verdicts)
    metrics |= write_evaluation(out, rows, judged)
    return Evaluation(
        prompts,
        rows,
        headline,
        curves,
        [],
        scored or {},
        {},
        verdicts,
        judged.judge_human,
        judged.base_name,
        metrics,
        t0,
    )


def reward_model_directory(spec: str, out: Path, cfg: PipelineConfig) -> Path:
    """The directory of reward model ``spec`` (``eval.reward_model``): a local directory as it is;
    ``model:SOURCE[@REVISION]`` imported into ``out/reward_model`` as ``ppo.reward`` would
    (:func:`rlhf_core.train.external_reward.import_reward_model`, not normalised).

    Raises:
        ModelSourceError: naming ``eval.reward_model``: no such directory.
    """
    if spec.startswith("model:"):
        from ..train.external_reward import import_reward_model

        import_reward_model(spec, out / "reward_model", append_eos=cfg.reward.external_append_eos)
        return out / "reward_model" / "model"
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"eval.reward_model {spec!r}: not a model directory (no config.json there)")
    return path
