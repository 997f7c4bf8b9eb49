"""The evaluation: base, SFT, PPO and DPO summaries of the evaluation prompts, scored by the
reward model, judged against the human references, and measured.

Huang et al. 2024 (arXiv:2403.17031): win rates against the reference summaries judged by an
LLM (Figure 1, the prompt of Appendix I), win rate against ``log(summary length / reference
length)`` (Figure 8), agreement between the reward model and the judge (Detail 17), and token
ranks under the pre-trained model (Table 8).

:func:`run_evaluation` writes ``summaries.jsonl`` (one row per prompt with each policy's
summary, reward score and judgement) and ``judgements.jsonl`` to the stage's output and returns
an :class:`Evaluation`; the report and the stage's ``metrics.json`` follow from it
(:func:`rlhf_core.report.run_report.finish_evaluation`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..common.tracking import NullTracker, Tracker
from ..config.settings import EvalConfig, PipelineConfig
from ..data.prepared import load_data_tokenizer, load_prepared, require_prompts
from ..metrics.statistics import (
    NAN,
    agreement,
    length_log_ratio,
    mean_ignoring_missing,
    wilson_interval,
    win_rate,
)
from ..metrics.text import diversity, repetition_rate, rouge_l, title_copy_rate, words
from ..models.saved import load_causal_lm
from ..ppo.rollout import summary_logprobs
from ..train.generation import Summaries, summarize
from ..train.reward import ResponseScores, load_reward_model, score_responses
from ..train.training import autocast, pick_device, precision_name
from .judging import (
    win_counts,
)
from .token_shift import token_shift_blocks
from .verdicts import JudgedPolicies, judge_summaries, write_evaluation

log = logging.getLogger(__name__)

#: The policies compared with the references, in report order: ``(key, display name)``, the key
#: being the stage that trains the policy (``base``: the base model).
POLICIES = (("base", "base"), ("sft", "SFT"), ("ppo", "PPO"), ("dpo", "DPO"))


def _free(*_):
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class EvalPrompts:
    """The evaluation split's first ``eval.max_samples`` rows.

    Attributes:
        queries, reference_tokens: ``(n, query_length)`` and ``(n, response_length)`` long, left-
            and right-padded as prepared (Details 2-4).
        references, posts, titles, ids: ``n`` strings each (references stripped).
        max_new: tokens sampled per summary: the SFT response length (Detail 4).
        split: the split's name.
        reference_lengths: ``(n,)`` long, each reference's tokens up to and including its EOS
            (counted as :attr:`Summaries.lengths` counts a summary's).
    """

    queries: torch.Tensor
    reference_tokens: torch.Tensor
    references: list[str]
    posts: list[str]
    titles: list[str]
    ids: list[str]
    max_new: int
    split: str
    reference_lengths: torch.Tensor

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
    require_prompts(stats, ecfg.split, "eval.split")
    ds = sft_data[ecfg.split]
    ds = ds.select(range(min(len(ds), ecfg.max_samples or len(ds))))
    reference_tokens = torch.tensor(ds["reference_response_token"])
    return EvalPrompts(
        queries=torch.tensor(ds["query_token"]),
        reference_tokens=reference_tokens,
        references=[r.strip() for r in ds["reference_response"]],
        posts=list(ds["post"]),
        titles=list(ds["title"]),
        ids=[str(i) for i in ds["id"]],
        max_new=stats["padded_lengths"]["sft_response"],
        split=ecfg.split,
        reference_lengths=(reference_tokens != stats["tokenizer"]["pad_token_id"]).sum(dim=1),
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

    Args:
        model_dirs: ``{policy key: model directory}``, in report order.

    Returns:
        ``({policy: Summaries}, {policy: [samples of prompt i]})``.
    """
    summaries: dict[str, Summaries] = {}
    diverse: dict[str, list[list[str]]] = {}
    k, q = min(ecfg.diversity_prompts, len(prompts)), prompts.queries
    for key, model_dir in model_dirs.items():
        model = load_causal_lm(model_dir).to(device)
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


#: The policies whose summaries' KL from the SFT policy is measured (:func:`kl_from_sft`).
KL_POLICIES = ("ppo", "dpo")


@torch.no_grad()
def kl_from_sft(
    model_dirs: dict[str, Path],
    tokenizer,
    prompts: EvalPrompts,
    summaries: dict[str, Summaries],
    ecfg: EvalConfig,
    temperature: float,
    device: torch.device,
) -> dict[str, list[float]]:
    """The KL of each PPO and DPO summary from the SFT policy: ``log pi(y|x) - log pi_sft(y|x)``
    at the sampling temperature PPO trains with (:func:`rlhf_core.ppo.rollout.summary_logprobs`,
    the k1 estimate of PPO's KL penalty for that summary), in nats. One model in memory at a time.

    Returns:
        ``{"ppo": [n floats], "dpo": [n floats]}``, in prompt order.
    """
    pad = tokenizer.pad_token_id

    def logprobs(key: str, of: tuple[str, ...]) -> dict[str, torch.Tensor]:
        model = load_causal_lm(model_dirs[key]).to(device).eval()
        out = {}
        for policy in of:
            parts = []
            for start in range(0, len(prompts), ecfg.batch_size):
                end = start + ecfg.batch_size
                with autocast(device, ecfg.bf16):
                    queries, responses = prompts.queries[start:end], summaries[policy].responses[start:end]
                    parts.append(summary_logprobs(model, queries, responses, pad, temperature))
            out[policy] = torch.cat(parts) if parts else torch.zeros(0)
        model = None
        _free()
        return out

    sft = logprobs("sft", KL_POLICIES)
    log.info("evaluation: KL from the SFT policy of the %s summaries", " and ".join(KL_POLICIES))
    return {key: (logprobs(key, (key,))[key] - sft[key]).tolist() for key in KL_POLICIES}


def score_policies(
    reward_model_dir: Path,
    data_dir: str | os.PathLike,
    tokenizer,
    prompts: EvalPrompts,
    summaries: dict[str, Summaries],
    ecfg: EvalConfig,
    non_eos_penalty: float | None,
    device: torch.device,
) -> dict[str, ResponseScores]:
    """Reward-model scores of every policy's summaries and of the references, with PPO's EOS
    trick (Detail 23; :func:`rlhf_core.train.reward.score_responses`). Keys: the policies of
    ``summaries`` and ``reference``. An existing reward model reads conversational rows as their
    messages (``data_dir``'s data)."""
    reward_model = load_reward_model(reward_model_dir, tokenizer, data_dir).to(device)
    responses = {key: s.responses for key, s in summaries.items()} | {"reference": prompts.reference_tokens}
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


def policy_measurements(
    prompts: EvalPrompts,
    summaries: dict[str, Summaries],
    diverse: dict[str, list[list[str]]],
    scored: dict[str, ResponseScores] | None,
    verdicts: JudgedPolicies,
    ecfg: EvalConfig,
    policies: Sequence[tuple[str, str]] = POLICIES,
) -> tuple[dict[str, float], list[dict], dict[str, tuple[list[float], list]]]:
    """Win rate, ROUGE-L, length, reward-model scores, EOS rate, title copying, diversity and
    RM-judge agreement of each policy (:func:`measure_policy`), and the references' figures.

    Args:
        scored: :func:`score_policies`' scores; ``None`` when no reward model scored the
            summaries (no score, raw score or agreement figures then).
        policies: ``(key, report label)`` of each policy in ``summaries``, in report order.

    Returns:
        ``(metrics, headline rows for the report, length-control curves per policy label)``;
        besides each policy's ``eval/{key}/...`` metrics, ``eval/agreement`` (with
        ``_ci_low``, ``_ci_high`` and ``_n``: the reward model's agreement with the judge over
        every policy's judged pairs, Detail 17), ``eval/reference/...`` and ``eval/samples``.
    """
    references, n = prompts.references, len(prompts)
    metrics: dict[str, float] = {}
    headline, curves = [], {}
    reward_agree: list[bool] = []
    judge_agree: list = []
    for key, label in policies:
        figures, row, curves[label], agree = measure_policy(
            key, prompts, summaries[key], diverse, scored, verdicts, ecfg
        )
        metrics |= {f"eval/{key}/{name}": value for name, value in figures.items()}
        headline.append({"policy": label} | row)
        reward_agree += agree[0]
        judge_agree += agree[1]
    ref_title = title_copy_rate(references, prompts.titles, ecfg.title_copy_threshold)
    metrics |= {"eval/reference/title_copy_rate": float(ref_title["rate"]), "eval/samples": float(n)}
    reference: dict[str, Any] = {"policy": "human reference"}
    if scored is not None:
        together = agreement(reward_agree, judge_agree)
        low, high = (
            wilson_interval(together["agreement"] * together["n"], together["n"]) if together["n"] else (NAN, NAN)
        )
        metrics |= {
            "eval/reference/score": scored["reference"].scores.mean().item(),
            "eval/agreement": float(together["agreement"]),
            "eval/agreement_ci_low": low,
            "eval/agreement_ci_high": high,
            "eval/agreement_n": float(together["n"]),
        }
        reference |= {
            "RM score": scored["reference"].scores.mean().item(),
            "RM raw score": scored["reference"].raw_scores.mean().item(),
            "EOS rate": scored["reference"].has_eos.double().mean().item(),
        }
    headline.append(
        reference
        | {
            "title copy": float(ref_title["rate"]),
            "repetition loops": float(repetition_rate(references)["rate"]),
            "words": mean_ignoring_missing([len(words(t)) for t in references]),
            "tokens": float(prompts.reference_lengths.double().mean().item()),
        }
    )
    metrics["eval/reference/response_tokens"] = float(prompts.reference_lengths.double().mean().item())
    return metrics, headline, curves


def measure_policy(
    key: str,
    prompts: EvalPrompts,
    summaries: Summaries,
    diverse: dict[str, list[list[str]]],
    scored: dict[str, ResponseScores] | None,
    verdicts: JudgedPolicies,
    ecfg: EvalConfig,
) -> tuple[dict[str, float], dict[str, Any], tuple[list[float], list], tuple[list[bool], list]]:
    """One policy's figures (:func:`policy_measurements`).

    Returns:
        ``(metrics without the eval/{key}/ prefix, its headline row without the label, its
        length-control curve: log length ratios and wins of the judged prompts, (the reward
        model's and the judge's preferences of its judged pairs: the policy's summary over the
        reference) for the RM-judge agreement, empty without scores)``.
    """
    n, texts, ids = len(prompts), summaries.texts, prompts.ids
    sel = [i for i in range(n) if verdicts.judged[key][i]]
    wins = [verdicts.wins[key][i] for i in sel]
    wr = win_rate(wins)
    counts = win_counts([verdicts.by_id[f"{key}/{ids[i]}"] for i in sel])
    rouge = mean_ignoring_missing(rouge_l(texts, prompts.references))
    title = float(title_copy_rate(texts, prompts.titles, ecfg.title_copy_threshold)["rate"])
    repetition = float(repetition_rate(texts)["rate"])
    div = float(diversity(diverse[key])["mean"]) if key in diverse else float("nan")
    n_words = mean_ignoring_missing([len(words(t)) for t in texts])
    tokens = float(summaries.lengths.double().mean().item()) if n else float("nan")
    metrics = {
        "win_rate": wr["win_rate"],
        "win_rate_ci_low": wr["ci_low"],
        "win_rate_ci_high": wr["ci_high"],
        "win_rate_n_valid": float(wr["n_valid"]),
        "win_rate_invalid": float(counts["invalid"]),
        "win_rate_errors": float(counts["errors"]),
        "win_rate_ties": float(counts["ties"]),
        "rougeL": rouge,
        "title_copy_rate": title,
        "repetition_rate": repetition,
        "diversity": div,
        "response_words": n_words,
        "response_tokens": tokens,
    }
    row: dict[str, Any] = {"win rate vs reference": wr, "ROUGE-L": rouge}
    rm_prefers: list[bool] = []
    if scored is not None:
        scores, reference = scored[key].scores, scored["reference"].scores
        rm_prefers = [bool(scores[i] > reference[i]) for i in sel]
        agree = float(agreement(rm_prefers, wins)["agreement"])
        metrics |= {
            "score": scores.mean().item(),
            "raw_score": scored[key].raw_scores.mean().item(),
            "eos_rate": scored[key].has_eos.double().mean().item(),
            "agreement": agree,
        }
        row |= {
            "RM score": metrics["score"],
            "RM raw score": metrics["raw_score"],
            "EOS rate": metrics["eos_rate"],
        }
    else:
        metrics["eos_rate"] = summaries.has_eos.double().mean().item()
        row["EOS rate"] = metrics["eos_rate"]
    row |= {"title copy": title, "repetition loops": repetition, "diversity": div}
    if scored is not None:
        row["RM-judge agreement"] = metrics["agreement"]
    row |= {"words": n_words, "tokens": tokens}
    curve = ([length_log_ratio([texts[i]], [prompts.references[i]])[0] for i in sel], wins)
    return metrics, row, curve, (rm_prefers, wins if scored is not None else [])


def summary_rows(
    prompts: EvalPrompts,
    summaries: dict[str, Summaries],
    scored: dict[str, ResponseScores] | None,
    verdicts: JudgedPolicies,
    kl: dict[str, list[float]] | None = None,
) -> list[dict]:
    """One row per prompt for ``summaries.jsonl``: the post, the reference and each policy's
    (those of ``summaries``) summary with its length in tokens, EOS, judgement and, where a
    reward model scored them (``scored``), its scores with and without the EOS trick, and the
    KL from SFT of PPO's and DPO's (``{policy}_kl_vs_sft``, :func:`kl_from_sft`)."""
    rows = []
    for i in range(len(prompts)):
        row = {
            "id": prompts.ids[i],
            "title": prompts.titles[i],
            "post": prompts.posts[i],
            "reference": prompts.references[i],
        }
        if scored is not None:
            row["reference_score"] = scored["reference"].scores[i].item()
        for key, summary in summaries.items():
            row[key] = summary.texts[i]
            if scored is not None:
                row[f"{key}_score"] = scored[key].scores[i].item()
                row[f"{key}_raw_score"] = scored[key].raw_scores[i].item()
            row[f"{key}_tokens"] = int(summary.lengths[i])
            row[f"{key}_has_eos"] = bool(summary.has_eos[i])
            row[f"{key}_wins"] = verdicts.wins[key][i]
            if kl and key in kl:
                row[f"{key}_kl_vs_sft"] = kl[key][i]
        rows.append(row)
    return rows


@dataclass
class Evaluation:
    """What :func:`run_evaluation` measured, for the report
    (:func:`rlhf_core.report.run_report.finish_evaluation`).

    Attributes:
        prompts: the evaluation prompts; rows: ``summaries.jsonl``'s rows (:func:`summary_rows`).
        headline: the report's headline rows, one per policy and one for the references;
            curves: ``{policy label: (log length ratios, wins)}`` of the judged prompts, for
            the length-control plot (both from :func:`policy_measurements`).
        shift_blocks: HTML of the token-shift page (:func:`token_shift_blocks`).
        scored: each policy's and the references' reward-model scores (:func:`score_policies`).
        kl: PPO's and DPO's summaries' KL from the SFT policy (:func:`kl_from_sft`).
        verdicts: the judge's verdicts; judge_human: the judge on human labels
            (:func:`judge_human_labels`' figures, ``{}`` when not measured).
        base_name: the base model's name in the report.
        metrics: the flat metrics measured so far (:func:`run_evaluation`).
        started: :func:`time.perf_counter` at the stage's start, in seconds.
    """

    prompts: EvalPrompts
    rows: list[dict]
    headline: list[dict]
    curves: dict[str, tuple[list[float], list]]
    shift_blocks: list[str]
    scored: dict[str, ResponseScores]
    kl: dict[str, list[float]]
    verdicts: JudgedPolicies
    judge_human: dict[str, Any]
    base_name: str
    metrics: dict[str, float]
    started: float


def run_evaluation(
    cfg: PipelineConfig,
    data_dir: str | os.PathLike,
    base_model_dir: str | os.PathLike,
    policy_dirs: dict[str, str | os.PathLike],
    reward_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
    judgement_cache: str | os.PathLike | None = None,
) -> Evaluation:
    """Sample, score, judge and measure the base, SFT, PPO and DPO policies; write
    ``summaries.jsonl`` and ``judgements.jsonl`` to ``out_dir``.

    Args:
        cfg: the pipeline config; reads ``cfg.eval``, ``cfg.ppo.temperature`` (the training
            temperature, for diversity) and ``cfg.ppo.non_eos_penalty`` (the score of a summary
            without EOS, as in PPO: Detail 23).
        data_dir, base_model_dir: stage outputs (the prepared data, the base model).
        policy_dirs: ``{"sft": ..., "ppo": ..., "dpo": ...}``: each trained policy's model
            directory (``save_pretrained`` layout).
        reward_model_dir: the normalised reward model, which scores every summary.
        tracker: receives the ``eval.*`` settings as parameters.
        judgement_cache: a JSONL file shared across runs (default ``out_dir/judge_cache.jsonl``):
            a comparison already judged by the same judge with the same prompt is not sent again.

    Returns:
        An :class:`Evaluation` whose flat metrics are ``eval/{policy}/win_rate`` (and
        ``_ci_low``, ``_ci_high``, ``_n_valid``, ``_invalid``, ``_errors``),
        ``eval/{policy}/rougeL``, ``eval/{policy}/score`` (mean reward-model score with the EOS
        trick), ``eval/{policy}/raw_score`` (without it), ``eval/{policy}/eos_rate`` (share of
        summaries ending with EOS), ``eval/{policy}/title_copy_rate``,
        ``eval/{policy}/diversity``, ``eval/{policy}/agreement``, ``eval/{policy}/repetition_rate``
        (share of summaries with a :func:`rlhf_core.metrics.text.repetition_loop`),
        ``eval/{policy}/win_rate_ties`` for base, sft, ppo and dpo; ``eval/ppo/kl_vs_sft`` and
        ``eval/dpo/kl_vs_sft`` (mean KL from SFT per summary, nats); ``eval/reference/score``,
        ``eval/reference/title_copy_rate``, ``eval/agreement``, ``eval/samples``; with
        ``eval.judge_human_comparisons`` > 0, the judge on human labels:
        ``eval/judge/human_agreement`` (``_ci_low``, ``_ci_high``), ``eval/judge/human_n``,
        ``eval/judge/a_share`` and, with both orders judged, ``eval/judge/order_consistency``.

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
    model_dirs = {"base": Path(base_model_dir)} | {key: Path(path) for key, path in policy_dirs.items()}

    # 1. Summaries: near-greedy for win rates, at the training temperature for diversity.
    summaries, diverse = sample_policies(model_dirs, tokenizer, prompts, ecfg, cfg.ppo.temperature, device)
    # 2. Reward-model scores of every summary and of the references, with PPO's EOS trick (Detail 23).
    scored = score_policies(
        Path(reward_model_dir), data_dir, tokenizer, prompts, summaries, ecfg, cfg.ppo.non_eos_penalty, device
    )
    # 2b. The KL of PPO's and DPO's summaries from the SFT policy, for the RLHF objective.
    kl = kl_from_sft(model_dirs, tokenizer, prompts, summaries, ecfg, cfg.ppo.temperature, device)
    # 3. Token ranks of SFT, PPO and DPO summaries under the base model (Table 8).
    shift_blocks = token_shift_blocks(model_dirs["base"], tokenizer, prompts.queries, summaries, ecfg, device)
    # 4. The judge: each policy's summary against the reference, and on human-labelled comparisons.
    judged = judge_summaries(cfg, model_dirs["base"], data_dir, prompts, summaries, device, judgement_cache, out)
    _free()
    # 5. Measurements per policy.
    metrics, headline, curves = policy_measurements(prompts, summaries, diverse, scored, judged.verdicts, ecfg)
    # 6. Files: summaries and judgements.
    metrics |= {f"eval/{key}/kl_vs_sft": sum(values) / max(len(values), 1) for key, values in kl.items()}
    rows = summary_rows(prompts, summaries, scored, judged.verdicts, kl)
    metrics |= write_evaluation(out, rows, judged)
    return Evaluation(
        prompts,
        rows,
        headline,
        curves,
        shift_blocks,
        scored,
        kl,
        judged.verdicts,
        judged.judge_human,
        judged.base_name,
        metrics,
        t0,
    )
