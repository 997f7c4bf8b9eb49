"""The evaluation stage: base, SFT, PPO and DPO summaries judged against the human references, with
length control, reward-model/judge agreement, reward-hacking diagnostics and one report.

Huang et al. 2024: win rates against the reference summaries judged by an LLM (Figure 1, the
prompt of Appendix I), win rate against ``log(summary length / reference length)``
(Figure 8), agreement between the reward model and the judge (Detail 17), the reward model's
calibration (Figure 5), and token ranks under the pre-trained model (Table 8).

Outputs in ``out_dir``: ``metrics.json``, ``summaries.jsonl`` (one row per prompt with each
policy's summary, reward score, ROUGE-L and judgement), ``judgements.jsonl``,
``length_control.png``, ``training_curves.png``, ``calibration.png`` (copied from the
reward-model evaluation), ``token_shift.html``, ``report.html`` and ``report.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import diagnostics as diag
from .config import IN_DISTRIBUTION_SPLIT, EvalConfig, PipelineConfig
from .data import load_data_tokenizer, load_prepared
from .generation import Summaries, summarize, trim_left_padding
from .io import atomic_file, write_json_atomic, write_jsonl_atomic
from .judging import Comparison, Judge, JudgementCache, OfflineJudge, judge_comparisons, win_counts
from .models import ModelSourceError, load_causal_lm, resolve_source
from .pipeline import POLICIES, REPORT_FILES
from .report import plot_training_curves, write_report
from .reward import ResponseScores, ScalarModel, score_responses
from .tracking import NullTracker, Tracker, read_metrics
from .training import pick_device, precision_name

log = logging.getLogger(__name__)


#: The policies compared with the references, in report order: (key, display name).
@torch.no_grad()
def response_token_ranks(model, queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int) -> list[list[int]]:
    """Rank of each response token under ``model`` (1 = its top prediction), per row
    (Huang et al. 2024, Table 8). PAD positions are left out.

    Args:
        queries: ``(n, query_length)`` left-padded; responses: ``(n, response_length)``.

    Returns:
        ``n`` lists of ranks, one per non-PAD response token.
    """
    device = next(model.parameters()).device
    ranks = []
    for i in range(len(queries)):
        q = trim_left_padding(queries[i : i + 1], pad_token_id)
        r = responses[i : i + 1]
        keep = int((r[0] != pad_token_id).sum())
        if keep == 0:
            ranks.append([])
            continue
        seq = torch.cat([q, r[:, :keep]], dim=1).to(device)
        logits = model(input_ids=seq).logits[0, q.size(1) - 1 : q.size(1) - 1 + keep].float().cpu()
        ranks.append(diag.token_ranks(logits, r[0, :keep]).tolist())
    return ranks


def make_judge(cfg: EvalConfig, base_model_dir: Path, base_name: str, device: torch.device | None = None) -> Judge:
    """The configured judge: :class:`AnthropicJudge`, or :class:`OfflineJudge` on ``cfg.judge_model``
    (a model source) or, by default, on the pipeline's base model, on ``device`` (default the CPU)
    with ``cfg.bf16``'s precision.

    Raises:
        JudgeConfigError: the API judge has no key; ModelSourceError: ``judge_model`` is not
        a local model directory.
    """
    if cfg.judge == "anthropic":
        from .judging.anthropic_judge import AnthropicJudge  # the SDK only when the API judge is used

        return AnthropicJudge(cfg.judge_model)
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


def _mean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


def _free(*_):
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


#: PPO metrics the report plots per update: score, KL, EOS rate and response length.
PPO_CURVE_KEYS = ["objective/scores", "objective/kl", "response/eos_rate", "response/length_mean"]


def _interval(low: float, high: float, percent: bool = False) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    return f"[{low:.1%}, {high:.1%}]" if percent else f"[{low:+.3f}, {high:+.3f}]"


#: The reward model's evaluation splits in the report, by metric prefix (``reward_eval`` and
#: ``dpo_eval`` metrics): ``(name, distribution)``, the distribution being how the split stands to
#: the reward model's training pairs: held out of them (in distribution), other policies (out of
#: distribution, Detail 6), or another task.
RM_SPLITS = {
    f"eval/{IN_DISTRIBUTION_SPLIT}": ("TL;DR comparisons held out of train", "in distribution"),
    "eval": ("TL;DR validation comparisons", "out of distribution (other policies, Detail 6)"),
    "eval/validation_cnndm": ("CNN/DM comparisons", "another task (news articles)"),
}


def learning_checks(
    sft_metrics: dict[str, float],
    sft_samples: list[dict],
    rm_metrics: dict[str, float],
    ppo_last: dict[str, float],
    ppo: ResponseScores,
    sft: ResponseScores,
    texts: dict[str, list[str]] | None = None,
) -> tuple[list[dict], dict[str, float]]:
    """Whether each stage learned, measured on rows its training never saw: the report's first table.

    - SFT (its stage's evaluation prompts): share of greedy summaries that end with EOS within
      the response length, with a 95% Wilson interval (target at least 95%), and the ROUGE-L
      gain over the base model on the same prompts, with a 95% paired interval (target +0.05).
    - Reward model: accuracy with a 95% Wilson interval on the comparisons held out of its
      training split (``eval/validation_in_dist/...``: in distribution; target: the interval lies
      above 0.5, chance), on the TL;DR validation comparisons (``eval/...``: out of distribution,
      other policies, Detail 6; reported, or the target when no comparisons were held out), and
      on the CNN/DM comparisons (reported).
    - PPO (the evaluation prompts): the mean difference between PPO's and SFT's normalised
      reward-model scores (with the EOS trick, Detail 23) on the same prompts, with a 95% paired
      interval (target: above 0); PPO's EOS rate (target at least 90%); KL to the SFT policy per
      summary and per token, from the last PPO update's samples (reported); the share of PPO's
      greedy summaries caught in a repetition loop (:func:`rlhf_core.diagnostics.repetition_loop`;
      target: no higher than SFT's on the same prompts).

    Args:
        sft_metrics: the SFT stage's ``metrics.json``; sft_samples: its ``samples.jsonl`` rows
            (``rougeL_sft``, ``rougeL_base``); rm_metrics: the reward-model evaluation's
            ``metrics.json``; ppo_last: the last PPO update's metrics (``objective/kl``,
            ``objective/kl_per_token``); ppo, sft: both policies' scores on the same prompts;
            texts: their summaries (``{"ppo": [...], "sft": [...]}``), for the repetition check.

    Returns:
        ``(rows, metrics)``: table rows (stage, check, result, 95% interval, n, target, met)
        and flat metrics (``eval/checks/...``). A check whose inputs are missing is left out.
    """
    rows: list[dict] = []
    metrics: dict[str, float] = {}

    def add(stage, check, result, interval, n, target, met):
        rows.append(
            {
                "stage": stage,
                "check": check,
                "result": result,
                "95% interval": interval,
                "n": n,
                "target": target,
                "met": met,
            }
        )

    n_sft = int(sft_metrics.get("eval/samples", 0))
    if "eval/eos_rate" in sft_metrics and n_sft:
        rate = sft_metrics["eval/eos_rate"]
        low, high = diag.wilson_interval(round(rate * n_sft), n_sft)
        base = sft_metrics.get("eval/eos_rate_base", float("nan"))
        add(
            "SFT",
            "greedy summaries that end with EOS",
            f"{rate:.1%} (base model {base:.1%})",
            _interval(low, high, True),
            n_sft,
            "≥ 95%",
            rate >= 0.95,
        )
        metrics.update(
            {
                "eval/checks/sft_eos_rate": rate,
                "eval/checks/sft_eos_rate_ci_low": low,
                "eval/checks/sft_eos_rate_ci_high": high,
            }
        )
    pairs = [(r["rougeL_sft"], r["rougeL_base"]) for r in sft_samples if "rougeL_sft" in r and "rougeL_base" in r]
    if pairs:
        gain = diag.paired_difference([a for a, _ in pairs], [b for _, b in pairs])
        add(
            "SFT",
            "ROUGE-L gain over the base model",
            f"{gain['mean']:+.3f} (SFT {_mean([a for a, _ in pairs]):.3f}, base {_mean([b for _, b in pairs]):.3f})",
            _interval(gain["ci_low"], gain["ci_high"]),
            gain["n"],
            "≥ +0.05",
            gain["mean"] >= 0.05,
        )
        metrics.update(
            {
                "eval/checks/sft_rougeL_gain": gain["mean"],
                "eval/checks/sft_rougeL_gain_ci_low": gain["ci_low"],
                "eval/checks/sft_rougeL_gain_ci_high": gain["ci_high"],
            }
        )
    # the target is the in-distribution accuracy; without held-out comparisons, the validation one
    in_dist = f"eval/{IN_DISTRIBUTION_SPLIT}"
    targeted = in_dist if f"{in_dist}/accuracy" in rm_metrics else "eval"
    for prefix, (split_name, distribution) in RM_SPLITS.items():
        name, target = f"{split_name}, {distribution}", "interval above 50%" if prefix == targeted else "reported"
        if f"{prefix}/accuracy" in rm_metrics:
            acc, n = rm_metrics[f"{prefix}/accuracy"], int(rm_metrics.get(f"{prefix}/count", 0))
            low = rm_metrics.get(f"{prefix}/accuracy_ci_low", float("nan"))
            high = rm_metrics.get(f"{prefix}/accuracy_ci_high", float("nan"))
            add(
                "reward model",
                f"accuracy, {name}",
                f"{acc:.1%}",
                _interval(low, high, True),
                n,
                target,
                bool(low > 0.5) if target != "reported" else None,
            )
    if len(ppo.scores) and len(ppo.scores) == len(sft.scores):
        diff = diag.paired_difference(ppo.scores.tolist(), sft.scores.tolist())
        add(
            "PPO",
            "RM score of PPO minus SFT summaries, same prompts",
            f"{diff['mean']:+.3f} (PPO {ppo.scores.mean().item():+.3f}, SFT {sft.scores.mean().item():+.3f})",
            _interval(diff["ci_low"], diff["ci_high"]),
            diff["n"],
            "interval above 0",
            bool(diff["ci_low"] > 0),
        )
        eos = int(ppo.has_eos.sum().item())
        low, high = diag.wilson_interval(eos, len(ppo.has_eos))
        add(
            "PPO",
            "greedy summaries that end with EOS",
            f"{eos / len(ppo.has_eos):.1%}",
            _interval(low, high, True),
            len(ppo.has_eos),
            "≥ 90%",
            eos / len(ppo.has_eos) >= 0.9,
        )
        metrics.update(
            {
                "eval/checks/ppo_minus_sft_score": diff["mean"],
                "eval/checks/ppo_minus_sft_score_ci_low": diff["ci_low"],
                "eval/checks/ppo_minus_sft_score_ci_high": diff["ci_high"],
                "eval/checks/ppo_eos_rate_ci_low": low,
                "eval/checks/ppo_eos_rate_ci_high": high,
            }
        )
    if texts and texts.get("ppo") and texts.get("sft"):
        loops = {key: diag.repetition_rate(texts[key]) for key in ("ppo", "sft")}
        add(
            "PPO",
            "greedy summaries caught in a repetition loop",
            f"{loops['ppo']['rate']:.1%} (SFT {loops['sft']['rate']:.1%})",
            _interval(loops["ppo"]["ci_low"], loops["ppo"]["ci_high"], True),
            loops["ppo"]["n"],
            "≤ SFT's",
            loops["ppo"]["rate"] <= loops["sft"]["rate"],
        )
        metrics.update(
            {
                "eval/checks/ppo_repetition_rate": loops["ppo"]["rate"],
                "eval/checks/sft_repetition_rate": loops["sft"]["rate"],
            }
        )
    if "objective/kl" in ppo_last:
        per_token = ppo_last.get("objective/kl_per_token", float("nan"))
        add(
            "PPO",
            "KL to the SFT policy, last update's samples",
            f"{ppo_last['objective/kl']:.3f} nats per summary, {per_token:.4f} per token",
            "",
            None,
            "reported",
            None,
        )
        metrics.update({"eval/checks/ppo_kl": ppo_last["objective/kl"], "eval/checks/ppo_kl_per_token": per_token})
    return rows, metrics


def _last_record_with(path: Path, key: str) -> dict[str, float]:
    """The last stepped record of a ``metrics.jsonl`` that holds ``key`` (``{}`` if none)."""
    if not path.is_file():
        return {}
    records = [m for step, m in read_metrics(path) if step is not None and key in m]
    return records[-1] if records else {}


@dataclass
class EvalPrompts:
    """The evaluation split's first ``eval.max_samples`` rows.

    Attributes:
        queries, reference_tokens: ``(n, query_length)`` and ``(n, response_length)`` long, left-
            and right-padded as prepared (Details 2-4).
        references, posts, titles, ids: ``n`` strings each (references stripped).
        max_new: tokens sampled per summary: the SFT response length (Detail 4).
        split: the split's name.
    """

    queries: torch.Tensor
    reference_tokens: torch.Tensor
    references: list[str]
    posts: list[str]
    titles: list[str]
    ids: list[str]
    max_new: int
    split: str

    def __len__(self) -> int:
        return len(self.ids)


def load_eval_prompts(data_dir: str | os.PathLike, ecfg: EvalConfig) -> EvalPrompts:
    """The prompts of ``ecfg.split``.

    Raises:
        KeyError: ``ecfg.split`` is not an SFT split.
    """
    sft_data, _, stats = load_prepared(data_dir)
    if ecfg.split not in sft_data:
        raise KeyError(f"eval.split names {ecfg.split!r}, not an SFT split ({', '.join(sft_data)})")
    ds = sft_data[ecfg.split]
    ds = ds.select(range(min(len(ds), ecfg.max_samples or len(ds))))
    return EvalPrompts(
        queries=torch.tensor(ds["query_token"]),
        reference_tokens=torch.tensor(ds["reference_response_token"]),
        references=[r.strip() for r in ds["reference_response"]],
        posts=list(ds["post"]),
        titles=list(ds["title"]),
        ids=[str(i) for i in ds["id"]],
        max_new=stats["padded_lengths"]["sft_response"],
        split=ecfg.split,
    )


def sample_policies(
    model_dirs: dict[str, Path],
    tokenizer,
    prompts: EvalPrompts,
    ecfg: EvalConfig,
    train_temperature: float,
    device: torch.device,
) -> tuple[dict[str, Summaries], dict[str, list[list[str]]]]:
    """Each policy's near-greedy summaries (``eval.temperature``) of every prompt, for the win
    rates, and ``eval.diversity_samples`` samples at the training temperature of each of the
    first ``eval.diversity_prompts`` prompts, for diversity. One model in memory at a time.

    Returns:
        ``({policy: Summaries}, {policy: [samples of prompt i]})``.
    """
    summaries: dict[str, Summaries] = {}
    diverse: dict[str, list[list[str]]] = {}
    k, q = min(ecfg.diversity_prompts, len(prompts)), prompts.queries
    for key, _ in POLICIES:
        model = load_causal_lm(model_dirs[key]).to(device)
        log.info("evaluation: %s summaries of %d %s prompts", key, len(prompts), prompts.split)
        summaries[key] = summarize(
            model, tokenizer, q, prompts.max_new, ecfg.temperature, ecfg.batch_size, ecfg.seed, ecfg.bf16
        )
        if k:
            repeated = q[:k].repeat_interleave(ecfg.diversity_samples, dim=0)
            texts = summarize(
                model,
                tokenizer,
                repeated,
                prompts.max_new,
                train_temperature,
                ecfg.batch_size,
                ecfg.seed + 1,
                ecfg.bf16,
            ).texts
            diverse[key] = [texts[i * ecfg.diversity_samples : (i + 1) * ecfg.diversity_samples] for i in range(k)]
        model = None
        _free()
    return summaries, diverse


def score_policies(
    reward_model_dir: Path,
    tokenizer,
    prompts: EvalPrompts,
    summaries: dict[str, Summaries],
    ecfg: EvalConfig,
    non_eos_penalty: float | None,
    device: torch.device,
) -> dict[str, ResponseScores]:
    """Reward-model scores of every policy's summaries and of the references, with PPO's EOS
    trick (Detail 23; :func:`rlhf_core.reward.score_responses`). Keys: the policies and ``reference``."""
    reward_model = ScalarModel.from_pretrained(str(reward_model_dir)).to(device)
    responses = {key: summaries[key].responses for key, _ in POLICIES} | {"reference": prompts.reference_tokens}
    scored = {
        key: score_responses(
            reward_model,
            prompts.queries,
            tokens,
            tokenizer.pad_token_id,
            tokenizer.eos_token_id,
            non_eos_penalty,
            ecfg.batch_size,
            ecfg.bf16,
        )
        for key, tokens in responses.items()
    }
    reward_model = None
    _free()
    return scored


def token_shift_blocks(
    base_model_dir: Path,
    tokenizer,
    prompts: EvalPrompts,
    summaries: dict[str, Summaries],
    ecfg: EvalConfig,
    device: torch.device,
) -> list[str]:
    """HTML blocks of the first ``eval.token_shift_samples`` SFT, PPO and DPO summaries, each
    token coloured by its rank under the base model (Table 8)."""
    m = min(ecfg.token_shift_samples, len(prompts))
    blocks: list[str] = []
    if not m:
        return blocks
    base = load_causal_lm(base_model_dir).to(device)
    for key in ("sft", "ppo", "dpo"):
        ranks = response_token_ranks(base, prompts.queries[:m], summaries[key].responses[:m], tokenizer.pad_token_id)
        for i in range(m):
            tokens = [tokenizer.decode([t]) for t in summaries[key].responses[i, : len(ranks[i])].tolist()]
            blocks.append(f"<h4>{dict(POLICIES)[key]}, post {i + 1}</h4>" + diag.token_shift_html(tokens, ranks[i]))
    base = None
    _free()
    return blocks


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
    judge: Judge, prompts: EvalPrompts, summaries: dict[str, Summaries], ecfg: EvalConfig, cache: JudgementCache
) -> JudgedPolicies:
    """Each policy's summary against the reference for every prompt, interleaved so that a
    spending cap (``eval.max_comparisons``) leaves every policy the same number of comparisons."""
    n, ids = len(prompts), prompts.ids
    comparisons = [
        Comparison(
            id=f"{key}/{ids[i]}",
            post=prompts.posts[i],
            response=summaries[key].texts[i],
            reference=prompts.references[i],
            policy=key,
        )
        for i in range(n)
        for key, _ in POLICIES
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
    by_id = {j.id: j for j in judgements}
    wins = {
        key: [by_id[f"{key}/{ids[i]}"].outcome if f"{key}/{ids[i]}" in by_id else None for i in range(n)]
        for key, _ in POLICIES
    }
    judged = {key: [f"{key}/{ids[i]}" in by_id for i in range(n)] for key, _ in POLICIES}
    return JudgedPolicies(judgements, len(comparisons), wins, judged, by_id)


def judge_human_labels(
    judge: Judge, data_dir: str | os.PathLike, ecfg: EvalConfig, cache: JudgementCache
) -> tuple[dict[str, Any], list]:
    """The judge on human-labelled comparisons: the first ``eval.judge_human_comparisons`` rows of
    the preference split ``eval.judge_human_split``, the human's chosen summary as the response
    and the rejected one as the reference, judged as the policies are (the post without its
    title, the same prompt, orders, cache and seed). A judge whose agreement interval includes 0.5 cannot tell the policies'
    summaries apart either.

    Returns:
        ``(figures, judgements)``: :func:`rlhf_core.diagnostics.judge_label_agreement` of the
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
        )
        for i, row in enumerate(ds.select_columns(["id", "post", "chosen", "rejected"]))
    ]
    judgements = judge_comparisons(
        judge, comparisons, cache=cache, seed=ecfg.seed, concurrency=ecfg.concurrency, progress=True, orders=ecfg.orders
    )
    return diag.judge_label_agreement(judgements, ecfg.orders) | {"split": ecfg.judge_human_split}, judgements


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


def judge_note(judge_name: str, ecfg: EvalConfig, n: int, judge_human: dict[str, Any]) -> str:
    """The report's sentence on how win rates were judged and how far the judge can be trusted:
    its agreement with human labels in words ("at chance on human labels" when the interval
    includes 0.5, "below chance" when it lies under it), its share of "A" verdicts and its order
    consistency."""
    orders = (
        "each comparison judged in both A/B orders (a split verdict is a tie, or for an offline judge "
        "the two orders' letter margins are summed)"
        if ecfg.orders == "both"
        else "A/B order randomised per comparison"
    )
    text = (
        f"Win rates: share of valid judgements preferring the policy's summary to the human reference "
        f"(a tie counts half), judged by {judge_name} with the prompt of Huang et al. (2024), Appendix I, "
        f"{orders}; 95% Wilson intervals; {n} {ecfg.split} prompts."
    )
    if not judge_human:
        return text + " The judge's agreement with human labels was not measured (eval.judge_human_comparisons: 0)."
    low, high = judge_human["agreement_ci"]
    measured = (
        f"it agreed with the human label on {judge_human['agreement']:.1%} [{low:.1%}, {high:.1%}] of "
        f"{judge_human['n']} human-labelled comparisons of the {judge_human['split']} preference split, "
        f"chose the summary shown as A {judge_human['a_share']:.1%} of the time"
    )
    if judge_human["order_consistency"] is not None:
        measured += f", and picked the same summary in both orders {judge_human['order_consistency']:.1%} of the time"
    if judge_at_chance(judge_human):
        return (
            text + f" The judge is at chance on human labels: {measured}. Its win rates do not tell the policies' "
            "summaries apart; read the reward-model scores and the learning checks instead."
        )
    if high < 0.5:
        return (
            text + f" The judge is below chance on human labels: {measured}; it prefers the summary the human "
            "rejected more often than not, so its win rates do not measure quality; read the reward-model "
            "scores and the learning checks instead."
        )
    return text + f" The judge is better than chance on human labels: {measured}."


def judge_at_chance(figures: dict[str, Any]) -> bool:
    """Whether the judge's agreement interval on human labels includes 0.5 (or nothing was measured)."""
    low, high = figures.get("agreement_ci", [float("nan")] * 2)
    return not (math.isfinite(low) and math.isfinite(high)) or low <= 0.5 <= high


def policy_measurements(
    prompts: EvalPrompts,
    summaries: dict[str, Summaries],
    diverse: dict[str, list[list[str]]],
    scored: dict[str, ResponseScores],
    verdicts: JudgedPolicies,
    ecfg: EvalConfig,
) -> tuple[dict[str, float], list[dict], dict[str, tuple[list[float], list]]]:
    """Win rate, ROUGE-L, reward-model scores, EOS rate, title copying, diversity and RM-judge
    agreement of each policy, and the references' scores.

    Returns:
        ``(metrics, headline rows for the report, length-control curves per policy label)``.
    """
    n, references, titles, ids = len(prompts), prompts.references, prompts.titles, prompts.ids
    wins, by_id = verdicts.wins, verdicts.by_id
    scores = {key: s.scores for key, s in scored.items()}
    metrics: dict[str, float] = {}
    headline, curves = [], {}
    reward_agree, judge_agree = [], []
    for key, label in POLICIES:
        texts = summaries[key].texts
        sel = [i for i in range(n) if verdicts.judged[key][i]]
        wr = diag.win_rate([wins[key][i] for i in sel])
        counts = win_counts([by_id[f"{key}/{ids[i]}"] for i in sel])
        rouge = diag.rouge_l(texts, references)
        title = diag.title_copy_rate(texts, titles, ecfg.title_copy_threshold)
        repetition = diag.repetition_rate(texts)
        div = diag.diversity(diverse[key]) if key in diverse else {"mean": float("nan")}
        rm_prefers = [bool(scores[key][i] > scores["reference"][i]) for i in sel]
        agree = diag.agreement(rm_prefers, [wins[key][i] for i in sel])
        reward_agree += rm_prefers
        judge_agree += [wins[key][i] for i in sel]
        curves[label] = (
            [diag.length_log_ratio([texts[i]], [references[i]])[0] for i in sel],
            [wins[key][i] for i in sel],
        )
        metrics.update(
            {
                f"eval/{key}/win_rate": wr["win_rate"],
                f"eval/{key}/win_rate_ci_low": wr["ci_low"],
                f"eval/{key}/win_rate_ci_high": wr["ci_high"],
                f"eval/{key}/win_rate_n_valid": float(wr["n_valid"]),
                f"eval/{key}/win_rate_invalid": float(counts["invalid"]),
                f"eval/{key}/win_rate_errors": float(counts["errors"]),
                f"eval/{key}/rougeL": _mean(rouge),
                f"eval/{key}/score": scores[key].mean().item(),
                f"eval/{key}/raw_score": scored[key].raw_scores.mean().item(),
                f"eval/{key}/eos_rate": scored[key].has_eos.double().mean().item(),
                f"eval/{key}/title_copy_rate": float(title["rate"]),
                f"eval/{key}/repetition_rate": float(repetition["rate"]),
                f"eval/{key}/win_rate_ties": float(counts["ties"]),
                f"eval/{key}/diversity": float(div["mean"]),
                f"eval/{key}/agreement": float(agree["agreement"]),
                f"eval/{key}/response_words": _mean([len(diag.words(t)) for t in texts]),
            }
        )
        headline.append(
            {
                "policy": label,
                "win rate vs reference": wr,
                "ROUGE-L": _mean(rouge),
                "RM score": scores[key].mean().item(),
                "RM raw score": scored[key].raw_scores.mean().item(),
                "EOS rate": scored[key].has_eos.double().mean().item(),
                "title copy": float(title["rate"]),
                "repetition loops": float(repetition["rate"]),
                "diversity": float(div["mean"]),
                "RM-judge agreement": float(agree["agreement"]),
                "words": _mean([len(diag.words(t)) for t in texts]),
            }
        )
    ref_title = diag.title_copy_rate(references, titles, ecfg.title_copy_threshold)
    metrics.update(
        {
            "eval/reference/score": scores["reference"].mean().item(),
            "eval/reference/title_copy_rate": float(ref_title["rate"]),
            "eval/agreement": float(diag.agreement(reward_agree, judge_agree)["agreement"]),
            "eval/samples": float(n),
        }
    )
    headline.append(
        {
            "policy": "human reference",
            "RM score": scores["reference"].mean().item(),
            "RM raw score": scored["reference"].raw_scores.mean().item(),
            "EOS rate": scored["reference"].has_eos.double().mean().item(),
            "title copy": float(ref_title["rate"]),
            "repetition loops": float(diag.repetition_rate(references)["rate"]),
            "words": _mean([len(diag.words(t)) for t in references]),
        }
    )
    return metrics, headline, curves


def summary_rows(
    prompts: EvalPrompts, summaries: dict[str, Summaries], scored: dict[str, ResponseScores], verdicts: JudgedPolicies
) -> list[dict]:
    """One row per prompt for ``summaries.jsonl``: the post, the reference and each policy's
    summary with its scores (with and without the EOS trick), EOS and judgement."""
    rows = []
    for i in range(len(prompts)):
        row = {
            "id": prompts.ids[i],
            "title": prompts.titles[i],
            "post": prompts.posts[i],
            "reference": prompts.references[i],
            "reference_score": scored["reference"].scores[i].item(),
        }
        for key, _ in POLICIES:
            row.update(
                {
                    key: summaries[key].texts[i],
                    f"{key}_score": scored[key].scores[i].item(),
                    f"{key}_raw_score": scored[key].raw_scores[i].item(),
                    f"{key}_has_eos": bool(scored[key].has_eos[i]),
                    f"{key}_wins": verdicts.wins[key][i],
                }
            )
        rows.append(row)
    return rows


def run_evaluation(
    cfg: PipelineConfig,
    data_dir: str | os.PathLike,
    base_model_dir: str | os.PathLike,
    sft_dir: str | os.PathLike,
    reward_dirs: dict[str, str | os.PathLike],
    ppo_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
    judgement_cache: str | os.PathLike | None = None,
    *,
    dpo_dirs: dict[str, str | os.PathLike],
) -> dict[str, float]:
    """Evaluate the base, SFT, PPO and DPO policies and write the run's report.

    Args:
        cfg: the pipeline config; reads ``cfg.eval``, ``cfg.ppo.temperature`` (the training
            temperature, for diversity) and ``cfg.ppo.non_eos_penalty`` (the score of a summary
            without EOS, as in PPO: Detail 23).
        data_dir, base_model_dir, sft_dir, ppo_dir: stage outputs (``sft_dir/model``,
            ``ppo_dir/model``; their ``metrics.jsonl`` give the training curves).
        reward_dirs: ``{"reward": ..., "reward_norm": ..., "reward_eval": ...}`` stage outputs:
            the normalised reward model scores summaries; training curves, accuracy and the
            calibration plot come from the others.
        judgement_cache: a JSONL file shared across runs (default ``out_dir/judge_cache.jsonl``):
            a comparison already judged by the same judge with the same prompt is not sent again.
        dpo_dirs: ``{"dpo": ..., "dpo_eval": ...}`` stage outputs: the DPO policy
            (``dpo/model``, its ``metrics.jsonl``) and its implicit reward model's accuracy,
            reported beside the reward model's (Detail 19).

    Returns:
        Flat metrics: ``eval/{policy}/win_rate`` (and ``_ci_low``, ``_ci_high``, ``_n_valid``,
        ``_invalid``, ``_errors``), ``eval/{policy}/rougeL``, ``eval/{policy}/score`` (mean
        reward-model score with the EOS trick), ``eval/{policy}/raw_score`` (without it),
        ``eval/{policy}/eos_rate`` (share of summaries ending with EOS),
        ``eval/{policy}/title_copy_rate``, ``eval/{policy}/diversity``,
        ``eval/{policy}/agreement``, ``eval/{policy}/repetition_rate`` (share of summaries with
        a :func:`rlhf_core.diagnostics.repetition_loop`), ``eval/{policy}/win_rate_ties`` for
        base, sft, ppo and dpo; ``eval/reference/score``, ``eval/reference/title_copy_rate``,
        ``eval/agreement``, ``eval/samples``, ``eval/seconds``; with
        ``eval.judge_human_comparisons`` > 0, the judge on human labels: ``eval/judge/human_agreement``
        (``_ci_low``, ``_ci_high``), ``eval/judge/human_n``, ``eval/judge/a_share`` and, with both
        orders judged, ``eval/judge/order_consistency``.

    Raises:
        KeyError: ``cfg.eval.split`` is not an SFT split; JudgeConfigError: no API key;
        JudgeRequestError: the API refused the requests (bad key or model).
    """
    ecfg = cfg.eval
    tracker = tracker or NullTracker()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    prompts = load_eval_prompts(data_dir, ecfg)
    tokenizer = load_data_tokenizer(data_dir)
    device = pick_device()
    tracker.log_params(
        {f"eval.{k}": v for k, v in ecfg.model_dump().items()} | {"eval.precision": precision_name(ecfg.bf16, device)}
    )
    model_dirs = {
        "base": Path(base_model_dir),
        "sft": Path(sft_dir) / "model",
        "ppo": Path(ppo_dir) / "model",
        "dpo": Path(dpo_dirs["dpo"]) / "model",
    }

    # 1. Summaries: near-greedy for win rates, at the training temperature for diversity.
    summaries, diverse = sample_policies(model_dirs, tokenizer, prompts, ecfg, cfg.ppo.temperature, device)
    # 2. Reward-model scores of every summary and of the references, with PPO's EOS trick (Detail 23).
    scored = score_policies(
        Path(reward_dirs["reward_norm"]) / "model", tokenizer, prompts, summaries, ecfg, cfg.ppo.non_eos_penalty, device
    )
    # 3. Token ranks of SFT, PPO and DPO summaries under the base model (Table 8).
    shift_blocks = token_shift_blocks(model_dirs["base"], tokenizer, prompts, summaries, ecfg, device)
    # 4. The judge: each policy's summary against the reference.
    base_name = cfg.model.base or f"random-init model with the tokenizer {cfg.model.tokenizer}"
    judge = make_judge(ecfg, model_dirs["base"], base_name, device)
    cache = JudgementCache(judgement_cache or out / "judge_cache.jsonl")
    verdicts = judge_policies(judge, prompts, summaries, ecfg, cache)
    # 4b. The same judge on human-labelled comparisons: is it better than chance at all?
    judge_human, human_judgements = judge_human_labels(judge, data_dir, ecfg, cache)
    judge = None
    _free()
    # 5. Measurements per policy.
    metrics, headline, curves = policy_measurements(prompts, summaries, diverse, scored, verdicts, ecfg)
    # 6. Files: summaries, judgements, plots, report.
    rows = summary_rows(prompts, summaries, scored, verdicts)
    write_jsonl_atomic(out / "summaries.jsonl", rows)
    write_jsonl_atomic(out / "judgements.jsonl", (j.to_dict() for j in verdicts.judgements + human_judgements))
    metrics |= judge_human_metrics(judge_human)
    metrics |= _write_report(
        cfg,
        out,
        prompts,
        rows,
        headline,
        curves,
        shift_blocks,
        scored,
        verdicts,
        base_name,
        Path(sft_dir),
        reward_dirs,
        Path(ppo_dir),
        {k: Path(v) for k, v in dpo_dirs.items()},
        judge_human=judge_human,
    )
    metrics["eval/seconds"] = time.perf_counter() - t0
    write_json_atomic(out / "metrics.json", metrics)
    tracker.log_metrics(metrics)
    tracker.log_table("evaluation_samples", rows[:32])
    for name in REPORT_FILES:
        if (out / name).is_file():
            tracker.log_artifact(out / name)
    log.info("evaluation: win rates %s", {key: round(metrics[f"eval/{key}/win_rate"], 3) for key, _ in POLICIES})
    return metrics


def _write_report(
    cfg: PipelineConfig,
    out: Path,
    prompts: EvalPrompts,
    rows: list[dict],
    headline: list[dict],
    curves: dict,
    shift_blocks: list[str],
    scored: dict[str, ResponseScores],
    verdicts: JudgedPolicies,
    base_name: str,
    sft_dir: Path,
    reward_dirs: dict[str, str | os.PathLike],
    ppo_dir: Path,
    dpo_dirs: dict[str, Path],
    *,
    judge_human: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Plots, token-shift page, learning checks and ``report.html``/``report.md``; returns the
    learning checks' metrics. ``judge_human``: :func:`judge_human_labels`' figures."""
    ecfg, n, max_new = cfg.eval, len(prompts), prompts.max_new
    plots = {
        "Win rate against summary length": diag.plot_length_control(
            curves, out / "length_control.png", bins=ecfg.length_bins
        )
    }
    reward_eval = Path(reward_dirs["reward_eval"])
    if (reward_eval / "calibration.png").is_file():
        shutil.copyfile(reward_eval / "calibration.png", out / "calibration.png")
        plots["Reward model calibration"] = out / "calibration.png"
    token_plots, token_tables = per_token_sections(reward_eval, ppo_dir, out)
    plots |= token_plots
    metric_files = {
        "SFT": sft_dir / "metrics.jsonl",
        "reward model": Path(reward_dirs["reward"]) / "metrics.jsonl",
        "PPO": ppo_dir / "metrics.jsonl",
        "DPO": dpo_dirs["dpo"] / "metrics.jsonl",
    }
    if any(p.is_file() for p in metric_files.values()):
        plots["Training curves"] = plot_training_curves(
            {k: v for k, v in metric_files.items() if v.is_file()}, out / "training_curves.png"
        )
    shift_html = "\n".join(shift_blocks)
    if shift_html:
        with atomic_file(out / "token_shift.html") as fh:
            fh.write(f"<!doctype html><meta charset='utf-8'>{shift_html}")
    rm_metrics = _read_json(reward_eval / "metrics.json")
    tables = {
        "Reward model accuracy: the reward model (RM) and DPO's implicit one": reward_model_rows(
            rm_metrics, _read_json(dpo_dirs["dpo_eval"] / "metrics.json")
        )
    }
    sft_samples_file = sft_dir / "samples.jsonl"
    sft_samples = [json.loads(line) for line in sft_samples_file.open()] if sft_samples_file.is_file() else []
    checks, check_metrics = learning_checks(
        _read_json(sft_dir / "metrics.json"),
        sft_samples,
        rm_metrics,
        _last_record_with(metric_files["PPO"], "objective/kl"),
        scored["ppo"],
        scored["sft"],
        texts={key: [r[key] for r in rows] for key in ("ppo", "sft")},
    )
    if metric_files["PPO"].is_file():
        try:
            plots = {
                "PPO per update": plot_training_curves(
                    {"PPO": metric_files["PPO"]}, out / "ppo_curves.png", keys={"PPO": PPO_CURVE_KEYS}, max_columns=4
                )
            } | plots
        except ValueError:  # no stepped PPO record: nothing to plot
            pass
    by_id = verdicts.by_id
    judge_name = by_id and next(iter(by_id.values())).judge or (ecfg.judge_model or ecfg.judge)
    notes = [judge_note(judge_name, ecfg, n, judge_human or {})]
    if ecfg.judge == "offline":
        notes.append(
            f"The judge is a small offline language model ({judge_name}) choosing A or B by the "
            "probabilities of those letters: its win rates are not comparable with GPT-3.5 or Claude win rates."
        )
    total = win_counts(verdicts.judgements)
    if total["invalid"] or total["errors"] or len(verdicts.judgements) < verdicts.comparisons:
        notes.append(
            f"Judgements: {len(verdicts.judgements)} of {verdicts.comparisons} comparisons made "
            f"({total['invalid']} unreadable answers, {total['errors']} request errors)."
        )
    k = min(ecfg.diversity_prompts, n)
    notes.append(
        f"Title copy: share of summaries whose longest common word subsequence with the post title covers "
        f"at least {ecfg.title_copy_threshold:.0%} of the title. Diversity: mean pairwise normalised edit "
        f"distance among {ecfg.diversity_samples} samples per prompt at temperature {cfg.ppo.temperature} "
        f"({k} prompts). Repetition loops: share of summaries in which a run of words is immediately "
        "repeated over at least 6 words (a policy caught in a loop). RM-judge agreement: share of judged pairs where "
        "the reward model and the judge prefer the same summary, a tie counting half (Detail 17)."
    )
    if cfg.ppo.non_eos_penalty is None:
        notes.append(
            "RM score: the normalised reward model's output at the summary's last token, EOS or not "
            "(ppo.non_eos_penalty: null, no EOS trick), the same as RM raw score. EOS rate: share of "
            "summaries that end with EOS."
        )
    else:
        notes.append(
            f"RM score: the normalised reward model's score with PPO's EOS trick (Detail 23): a summary "
            f"that does not end with EOS within {max_new} tokens scores {cfg.ppo.non_eos_penalty:g} "
            f"(ppo.non_eos_penalty). RM raw score: the reward model's output at the summary's last token, "
            f"EOS or not. EOS rate: share of summaries that end with EOS."
        )
    samples = [
        {
            "post": r["post"],
            "reference": r["reference"],
            "reference_score": r["reference_score"],
            **{key: r[key] for key, _ in POLICIES},
            **{f"{key}_score": r[f"{key}_score"] for key, _ in POLICIES},
            **{f"{key}_raw_score": r[f"{key}_raw_score"] for key, _ in POLICIES},
        }
        for r in rows[: ecfg.report_samples]
    ]
    write_report(
        out,
        title=f"RLHF on TL;DR: {cfg.name}",
        intro=f"Base model: {base_name}; evaluation on {n} {ecfg.split} prompts at temperature {ecfg.temperature}.",
        summary=checks,
        headline=headline,
        tables=tables,
        plots=plots,
        figure_tables=token_tables,
        samples=samples,
        html_blocks={
            "Token shift (Table 8): SFT, PPO and DPO summaries coloured by rank under the base model": shift_html
        }
        if shift_html
        else None,
        notes=notes,
    )
    return check_metrics


def reward_model_rows(rm_metrics: dict[str, float], dpo_metrics: dict[str, float]) -> list[dict[str, str]]:
    """The report's reward-model table (Detail 19, Figure 6): per evaluation split of
    :data:`RM_SPLITS` (held out of train, validation, CNN/DM), the accuracy of the reward model
    and of DPO's implicit reward model on the same pairs (``reward_eval`` and ``dpo_eval``
    metrics), with 95% Wilson intervals, the pair count, and the split's distribution (in or
    out of distribution); "-" where a stage did not evaluate the split."""

    def cell(m: dict[str, float], prefix: str) -> str:
        if f"{prefix}/accuracy" not in m:
            return "-"
        text = f"{m[f'{prefix}/accuracy']:.1%}"
        if f"{prefix}/accuracy_ci_low" in m and f"{prefix}/accuracy_ci_high" in m:
            text += f" [{m[f'{prefix}/accuracy_ci_low']:.1%}, {m[f'{prefix}/accuracy_ci_high']:.1%}]"
        return text

    rows = []
    for prefix, (name, distribution) in RM_SPLITS.items():
        if f"{prefix}/accuracy" in rm_metrics or f"{prefix}/accuracy" in dpo_metrics:
            count = rm_metrics.get(f"{prefix}/count", dpo_metrics.get(f"{prefix}/count", float("nan")))
            rows.append(
                {
                    "split": name,
                    "pairs": f"{count:.0f}",
                    "RM": cell(rm_metrics, prefix),
                    "DPO": cell(dpo_metrics, prefix),
                    "distribution": distribution,
                }
            )
    return rows


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


#: Report headings of the per-token plots (Details 13 and 22).
REWARD_LOGITS_HEADING = "Reward logits per token (Detail 13)"
VALUE_VS_REWARD_HEADING = "Value model as a per-token reward model (Detail 22)"


def _before_eos(row: dict[str, Any], key: str) -> list[float]:
    return [v for t, v in enumerate(row[key]) if t != row["eos_index"]]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def reward_logit_rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's table under the reward-logit plot (Detail 13), one row per response of
    ``reward_logits.json`` (:func:`rlhf_core.reward_eval.write_reward_logits`): its token count,
    the score (the logit at the EOS), the mean of the other logits and the share of them that
    are negative."""
    rows = []
    for r in table.get("responses", []):
        others = _before_eos(r, "reward_logits")
        rows.append(
            {
                "response": f"pair {r['pair']}, {r['response']}",
                "tokens": len(r["tokens"]),
                "ends with EOS": r["ends_with_eos"],
                "score (logit at EOS)": r["score"],
                "mean of the other logits": _mean(others),
                "other logits < 0": f"{sum(v < 0 for v in others)}/{len(others)}",
            }
        )
    return rows


def value_reward_rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's table under the value-against-reward plot (Detail 22), one row per summary of
    ``value_vs_reward.json`` (:meth:`rlhf_core.ppo_trainer.PPOTrainer.value_vs_reward`): the
    score (the reward logit at the EOS), the value there, and the means of the values and of the
    reward logits over the other tokens."""
    return [
        {
            "evaluation prompt": r["row"],
            "tokens": len(r["tokens"]),
            "ends with EOS": r["ends_with_eos"],
            "score (reward logit at EOS)": r["score"],
            "value at EOS": r["value_at_eos"],
            "mean value, other tokens": _mean(_before_eos(r, "values")),
            "mean reward logit, other tokens": _mean(_before_eos(r, "reward_logits")),
        }
        for r in table.get("responses", [])
    ]


def per_token_sections(
    reward_eval_dir: Path, ppo_dir: Path, out: Path
) -> tuple[dict[str, Path], dict[str, list[dict[str, Any]]]]:
    """The report's per-token plots, those the stages wrote: ``reward_logits.png`` of the
    reward model's evaluation (Detail 13) and ``value_vs_reward.png`` of PPO (Detail 22), each
    copied to ``out`` with its table (:func:`reward_logit_rows`, :func:`value_reward_rows`,
    from the JSON beside it).

    Returns:
        ``({heading: plot in out}, {heading: table rows})`` for ``write_report``'s ``plots``
        and ``figure_tables``.
    """
    plots: dict[str, Path] = {}
    tables: dict[str, list[dict[str, Any]]] = {}
    for heading, src, name, rows in (
        (REWARD_LOGITS_HEADING, Path(reward_eval_dir), "reward_logits", reward_logit_rows),
        (VALUE_VS_REWARD_HEADING, Path(ppo_dir), "value_vs_reward", value_reward_rows),
    ):
        if (src / f"{name}.png").is_file():
            shutil.copyfile(src / f"{name}.png", out / f"{name}.png")
            plots[heading] = out / f"{name}.png"
            tables[heading] = rows(_read_json(src / f"{name}.json"))
    return plots, tables
