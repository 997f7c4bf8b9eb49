"""The evaluation's judging: the configured judge, each policy's summaries judged against the
references, the same judge on human-labelled comparisons, and the files the verdicts are
written to; shared by the pipeline's evaluation (:mod:`rlhf_core.evaluation.stage`) and
``rlhf evaluate`` (:mod:`rlhf_core.evaluation.policies`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..common.errors import ModelSourceError
from ..common.io import write_jsonl_atomic
from ..config.credentials import judge_key
from ..config.settings import EvalConfig, PipelineConfig
from ..data.prepared import load_prepared
from ..metrics.statistics import judge_label_agreement
from ..models.sources import resolve_source
from ..train.generation import Summaries
from .judging import Comparison, Judge, JudgementCache, OfflineJudge, judge_comparisons, require_readable
from .judging.prompt import JUDGE_PROMPT, load_judge_prompt


class JudgedPrompts(Protocol):
    """What the judge reads of the evaluation prompts (:class:`rlhf_core.evaluation.stage.EvalPrompts`)."""

    ids: list[str]
    posts: list[str]
    references: list[str]

    def __len__(self) -> int: ...


def make_judge(cfg: EvalConfig, base_model_dir: Path, base_name: str, device: torch.device | None = None) -> Judge:
    """The configured judge: :class:`AnthropicJudge`, :class:`OpenAIJudge` on the server
    ``cfg.judge_base_url`` (with the key :func:`rlhf_core.config.credentials.judge_key` gives
    for it, and ``cfg.judge_max_tokens``), or :class:`OfflineJudge` on ``cfg.judge_model`` (a model source) or, by
    default, on the pipeline's base model, on ``device`` (default the CPU) with ``cfg.bf16``'s
    precision.

    Raises:
        JudgeConfigError: the API judge has no key; ModelSourceError: ``judge_model`` is not
        a local model directory.
    """
    if cfg.judge == "anthropic":
        from .judging.anthropic_judge import AnthropicJudge  # the SDK only when the API judge is used

        return AnthropicJudge(
            cfg.judge_model, api_key=judge_key(cfg.judge_key_variable), max_tokens=cfg.judge_max_tokens
        )
    if cfg.judge == "openai":
        from .judging.openai_judge import OpenAIJudge  # likewise

        return OpenAIJudge(
            cfg.judge_model,
            api_key=judge_key(cfg.judge_key_variable),
            base_url=cfg.judge_base_url,
            max_tokens=cfg.judge_max_tokens,
            openai_request=cfg.openai_request,
        )
    if cfg.judge_model is None:
        return OfflineJudge.from_pretrained(
            base_model_dir, name=f"offline:{base_name}", batch_size=cfg.batch_size, bf16=cfg.bf16, device=device
        )
    source = resolve_source(cfg.judge_model)
    if source.kind != "local":
        raise ModelSourceError(
            f"eval.judge_model {cfg.judge_model!r}: an offline judge is a local model directory "
            "(save_pretrained layout); import other sources with `rlhf model` first"
        )
    return OfflineJudge.from_pretrained(
        source.location, name=f"offline:{cfg.judge_model}", batch_size=cfg.batch_size, bf16=cfg.bf16, device=device
    )


@dataclass
class JudgedPolicies:
    """The judge's verdicts: ``wins[policy][i]`` is 1.0 (a win), 0.0 (a loss) or 0.5 (a tie of
    the two orders) (``None``: unreadable or not judged), ``judged[policy][i]`` whether prompt
    ``i`` was judged at all."""

    judgements: list
    comparisons: int
    wins: dict[str, list[bool | None]]
    judged: dict[str, list[bool]]
    by_id: dict[str, Any]


def judge_policies(
    judge: Judge,
    prompts: JudgedPrompts,
    summaries: dict[str, Summaries],
    ecfg: EvalConfig,
    cache: JudgementCache,
    template: str = JUDGE_PROMPT,
) -> JudgedPolicies:
    """Each policy's summary (the policies of ``summaries``) against the reference for every
    prompt, interleaved so that a spending cap (``eval.max_comparisons``) leaves every policy the
    same number of comparisons; ``template`` is the judge prompt
    (:func:`rlhf_core.evaluation.judging.prompt.load_judge_prompt`)."""
    n, ids, keys = len(prompts), prompts.ids, list(summaries)
    comparisons = [
        Comparison(
            id=f"{key}/{ids[i]}",
            post=prompts.posts[i],
            response=summaries[key].texts[i],
            reference=prompts.references[i],
            policy=key,
            template=template,
        )
        for i in range(n)
        for key in keys
    ]
    judgements = judge_comparisons(
        judge,
        comparisons,
        cache=cache,
        seed=ecfg.seed,
        max_comparisons=ecfg.max_comparisons,
        concurrency=ecfg.concurrency,
        progress=True,
        orders=ecfg.orders,
    )
    require_readable(judge.name, judgements, ecfg.max_unreadable, "the policies' summaries")
    by_id = {j.id: j for j in judgements}
    wins = {
        key: [by_id[f"{key}/{ids[i]}"].outcome if f"{key}/{ids[i]}" in by_id else None for i in range(n)]
        for key in keys
    }
    judged = {key: [f"{key}/{ids[i]}" in by_id for i in range(n)] for key in keys}
    return JudgedPolicies(judgements, len(comparisons), wins, judged, by_id)


def judge_human_labels(
    judge: Judge, data_dir: str | os.PathLike, ecfg: EvalConfig, cache: JudgementCache, template: str = JUDGE_PROMPT
) -> tuple[dict[str, Any], list]:
    """The judge on human-labelled comparisons: the first ``eval.judge_human_comparisons`` rows of
    the preference split ``eval.judge_human_split``, the human's chosen summary as the response
    and the rejected one as the reference, judged as the policies are (the post without its
    title, the same prompt, orders, cache and seed). A judge whose agreement interval includes 0.5 cannot tell the policies'
    summaries apart either.

    Returns:
        ``(figures, judgements)``: :func:`rlhf_core.metrics.statistics.judge_label_agreement` of the
        configured orders plus ``split``, or ``({}, [])`` with ``judge_human_comparisons`` 0.

    Raises:
        KeyError: ``eval.judge_human_split`` is not a preference split.
    """
    if not ecfg.judge_human_comparisons:
        return {}, []
    _, pref, _ = load_prepared(data_dir)
    if ecfg.judge_human_split not in pref:
        raise KeyError(
            f"eval.judge_human_split names {ecfg.judge_human_split!r}, not a preference split ({', '.join(pref)})"
        )
    ds = pref[ecfg.judge_human_split]
    ds = ds.select(range(min(len(ds), ecfg.judge_human_comparisons)))
    comparisons = [
        Comparison(
            id=f"human/{i}/{row['id']}",
            post=row["post"],
            response=row["chosen"],
            reference=row["rejected"],
            policy="human-chosen",
            template=template,
        )
        for i, row in enumerate(ds.select_columns(["id", "post", "chosen", "rejected"]))
    ]
    judgements = judge_comparisons(
        judge, comparisons, cache=cache, seed=ecfg.seed, concurrency=ecfg.concurrency, progress=True, orders=ecfg.orders
    )
    require_readable(judge.name, judgements, ecfg.max_unreadable, "human-labelled comparisons")
    return judge_label_agreement(judgements, ecfg.orders) | {"split": ecfg.judge_human_split}, judgements


def judge_human_metrics(figures: dict[str, Any]) -> dict[str, float]:
    """``eval/judge/human_*`` metrics of :func:`judge_human_labels`' figures (empty when not measured)."""
    if not figures:
        return {}
    metrics = {
        "eval/judge/human_agreement": float(figures["agreement"]),
        "eval/judge/human_agreement_ci_low": float(figures["agreement_ci"][0]),
        "eval/judge/human_agreement_ci_high": float(figures["agreement_ci"][1]),
        "eval/judge/human_n": float(figures["n"]),
        "eval/judge/a_share": float(figures["a_share"]),
    }
    if figures["order_consistency"] is not None:
        metrics["eval/judge/order_consistency"] = float(figures["order_consistency"])
    return metrics


@dataclass
class Judged:
    """What :func:`judge_summaries` gives: the policies' verdicts, the judge on human labels
    (:func:`judge_human_labels`' figures and judgements) and the base model's name."""

    verdicts: JudgedPolicies
    judge_human: dict[str, Any]
    human_judgements: list
    base_name: str


def judge_summaries(
    cfg: PipelineConfig,
    base_model_dir: Path,
    data_dir: str | os.PathLike,
    prompts: JudgedPrompts,
    summaries: dict[str, Summaries],
    device: torch.device,
    judgement_cache: str | os.PathLike | None,
    out: Path,
) -> Judged:
    """The configured judge (:func:`make_judge`) on each policy's summaries against the
    references (:func:`judge_policies`), then on human-labelled comparisons, with the judge
    prompt of ``eval.judge_prompt`` (or the data format's) and the judgement cache
    ``judgement_cache`` (default ``out/judge_cache.jsonl``).

    Raises:
        JudgeConfigError, JudgeRequestError, JudgeUnreadableError: as the judge raises them.
    """
    ecfg = cfg.eval
    base_name = cfg.model.base or f"random-init model with the tokenizer {cfg.model.tokenizer}"
    judge = make_judge(ecfg, base_model_dir, base_name, device)
    cache = JudgementCache(judgement_cache or out / "judge_cache.jsonl")
    template = load_judge_prompt(ecfg.judge_prompt, cfg.data.format)
    verdicts = judge_policies(judge, prompts, summaries, ecfg, cache, template)
    # the same judge on human-labelled comparisons: is it better than chance at all?
    judge_human, human_judgements = judge_human_labels(judge, data_dir, ecfg, cache, template)
    return Judged(verdicts, judge_human, human_judgements, base_name)


def write_evaluation(out: Path, rows: list[dict], judged: Judged) -> dict[str, float]:
    """Write ``summaries.jsonl`` (``rows``) and ``judgements.jsonl`` (the policies' and the human
    labels' judgements) to ``out``. Returns the judge's ``eval/judge/human_*`` metrics."""
    write_jsonl_atomic(out / "summaries.jsonl", rows)
    judgements = judged.verdicts.judgements + judged.human_judgements
    write_jsonl_atomic(out / "judgements.jsonl", (j.to_dict() for j in judgements))
    return judge_human_metrics(judged.judge_human)
