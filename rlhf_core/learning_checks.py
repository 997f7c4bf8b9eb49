"""The learning checks: whether each stage learned, measured on rows its training never saw.

They are the report's first table ("Does it learn?"), read from the stages' own evaluations
(SFT's, the reward model's) and from the evaluation stage's scores of the PPO and SFT policies
on the same prompts (:mod:`rlhf_core.evaluation`). Reward-model splits follow Huang et al. 2024
(arXiv:2403.17031), Detail 6; PPO's scores use the EOS trick of Detail 23.
"""

from __future__ import annotations

import math

from . import diagnostics as diag
from .config_data import IN_DISTRIBUTION_SPLIT
from .reward import ResponseScores

#: The reward model's evaluation splits in the report, by metric prefix (``reward_eval`` and
#: ``dpo_eval`` metrics): ``(name, distribution)``, the distribution being how the split stands to
#: the reward model's training pairs: held out of them (in distribution), other policies (out of
#: distribution, Detail 6), or another task.
RM_SPLITS = {
    f"eval/{IN_DISTRIBUTION_SPLIT}": ("TL;DR comparisons held out of train", "in distribution"),
    "eval": ("TL;DR validation comparisons", "out of distribution (other policies, Detail 6)"),
    "eval/validation_cnndm": ("CNN/DM comparisons", "another task (news articles)"),
}
#: The same under ``data.format: trl``: the data's own splits, of no known policies or task.
TRL_RM_SPLITS = {
    f"eval/{IN_DISTRIBUTION_SPLIT}": ("comparisons held out of train", "in distribution"),
    "eval": ("the data's validation comparisons", "the validation split"),
}


def rm_splits(data_format: str = "tldr") -> dict[str, tuple[str, str]]:
    """The reward-model evaluation splits the report names, ``{metric prefix: (name,
    distribution)}``: :data:`RM_SPLITS` for TL;DR data, :data:`TRL_RM_SPLITS` for ``trl``."""
    return TRL_RM_SPLITS if data_format == "trl" else RM_SPLITS


Checks = tuple[list[dict], dict[str, float]]


def learning_checks(
    sft_metrics: dict[str, float],
    sft_samples: list[dict],
    rm_metrics: dict[str, float],
    ppo_last: dict[str, float],
    ppo: ResponseScores,
    sft: ResponseScores,
    texts: dict[str, list[str]] | None = None,
    data_format: str = "tldr",
) -> Checks:
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
            ``objective/kl_per_token``); ppo, sft: both policies' scores on the same prompts
            (``(n,)`` float tensors); texts: their summaries (``{"ppo": [...], "sft": [...]}``),
            for the repetition check; data_format: ``data.format``, which names the
            reward model's splits (:func:`rm_splits`).

    Returns:
        ``(rows, metrics)``: table rows (stage, check, result, 95% interval, n, target, met)
        and flat metrics (``eval/checks/...``). A check whose inputs are missing is left out.
    """
    rows: list[dict] = []
    metrics: dict[str, float] = {}
    for step_rows, step_metrics in (
        sft_checks(sft_metrics, sft_samples),
        reward_model_checks(rm_metrics, data_format),
        ppo_checks(ppo, sft, texts, ppo_last),
    ):
        rows += step_rows
        metrics |= step_metrics
    return rows, metrics


def _row(stage: str, check: str, result: str, interval: str, n: int | None, target: str, met: bool | None) -> dict:
    return {
        "stage": stage,
        "check": check,
        "result": result,
        "95% interval": interval,
        "n": n,
        "target": target,
        "met": met,
    }


def _interval(low: float, high: float, percent: bool = False) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    return f"[{low:.1%}, {high:.1%}]" if percent else f"[{low:+.3f}, {high:+.3f}]"


def sft_checks(sft_metrics: dict[str, float], sft_samples: list[dict]) -> Checks:
    """The SFT rows of :func:`learning_checks`: its EOS rate and its ROUGE-L gain over the base model."""
    rows, metrics = [], {}
    n_sft = int(sft_metrics.get("eval/samples", 0))
    if "eval/eos_rate" in sft_metrics and n_sft:
        rate = sft_metrics["eval/eos_rate"]
        low, high = diag.wilson_interval(round(rate * n_sft), n_sft)
        base = sft_metrics.get("eval/eos_rate_base", float("nan"))
        result = f"{rate:.1%} (base model {base:.1%})"
        rows.append(
            _row(
                "SFT",
                "greedy summaries that end with EOS",
                result,
                _interval(low, high, True),
                n_sft,
                "≥ 95%",
                rate >= 0.95,
            )
        )
        metrics |= {
            "eval/checks/sft_eos_rate": rate,
            "eval/checks/sft_eos_rate_ci_low": low,
            "eval/checks/sft_eos_rate_ci_high": high,
        }
    pairs = [(r["rougeL_sft"], r["rougeL_base"]) for r in sft_samples if "rougeL_sft" in r and "rougeL_base" in r]
    if pairs:
        sft_rouge, base_rouge = [a for a, _ in pairs], [b for _, b in pairs]
        gain = diag.paired_difference(sft_rouge, base_rouge)
        result = (
            f"{gain['mean']:+.3f} (SFT {diag.mean_ignoring_missing(sft_rouge):.3f}, "
            f"base {diag.mean_ignoring_missing(base_rouge):.3f})"
        )
        interval = _interval(gain["ci_low"], gain["ci_high"])
        rows.append(
            _row(
                "SFT", "ROUGE-L gain over the base model", result, interval, gain["n"], "≥ +0.05", gain["mean"] >= 0.05
            )
        )
        metrics |= {
            "eval/checks/sft_rougeL_gain": gain["mean"],
            "eval/checks/sft_rougeL_gain_ci_low": gain["ci_low"],
            "eval/checks/sft_rougeL_gain_ci_high": gain["ci_high"],
        }
    return rows, metrics


def reward_model_checks(rm_metrics: dict[str, float], data_format: str = "tldr") -> Checks:
    """The reward-model rows of :func:`learning_checks`, one per split of :func:`rm_splits` it
    was evaluated on: the target is the in-distribution accuracy or, without held-out
    comparisons, the validation one; the others are reported. No metrics of their own."""
    rows = []
    in_dist = f"eval/{IN_DISTRIBUTION_SPLIT}"
    targeted = in_dist if f"{in_dist}/accuracy" in rm_metrics else "eval"
    for prefix, (split_name, distribution) in rm_splits(data_format).items():
        if f"{prefix}/accuracy" not in rm_metrics:
            continue
        target = "interval above 50%" if prefix == targeted else "reported"
        acc, n = rm_metrics[f"{prefix}/accuracy"], int(rm_metrics.get(f"{prefix}/count", 0))
        low = rm_metrics.get(f"{prefix}/accuracy_ci_low", float("nan"))
        high = rm_metrics.get(f"{prefix}/accuracy_ci_high", float("nan"))
        met = bool(low > 0.5) if target != "reported" else None
        check = f"accuracy, {split_name}, {distribution}"
        rows.append(_row("reward model", check, f"{acc:.1%}", _interval(low, high, True), n, target, met))
    return rows, {}


def ppo_checks(
    ppo: ResponseScores, sft: ResponseScores, texts: dict[str, list[str]] | None, ppo_last: dict[str, float]
) -> Checks:
    """The PPO rows of :func:`learning_checks`: its score against SFT's on the same prompts and
    its EOS rate, its repetition loops against SFT's, and its KL to the SFT policy."""
    rows, metrics = [], {}
    if len(ppo.scores) and len(ppo.scores) == len(sft.scores):
        diff = diag.paired_difference(ppo.scores.tolist(), sft.scores.tolist())
        result = f"{diff['mean']:+.3f} (PPO {ppo.scores.mean().item():+.3f}, SFT {sft.scores.mean().item():+.3f})"
        check = "RM score of PPO minus SFT summaries, same prompts"
        interval = _interval(diff["ci_low"], diff["ci_high"])
        rows.append(_row("PPO", check, result, interval, diff["n"], "interval above 0", bool(diff["ci_low"] > 0)))
        eos, n = int(ppo.has_eos.sum().item()), len(ppo.has_eos)
        low, high = diag.wilson_interval(eos, n)
        interval = _interval(low, high, True)
        rows.append(
            _row("PPO", "greedy summaries that end with EOS", f"{eos / n:.1%}", interval, n, "≥ 90%", eos / n >= 0.9)
        )
        metrics |= {
            "eval/checks/ppo_minus_sft_score": diff["mean"],
            "eval/checks/ppo_minus_sft_score_ci_low": diff["ci_low"],
            "eval/checks/ppo_minus_sft_score_ci_high": diff["ci_high"],
            "eval/checks/ppo_eos_rate_ci_low": low,
            "eval/checks/ppo_eos_rate_ci_high": high,
        }
    if texts and texts.get("ppo") and texts.get("sft"):
        loops = {key: diag.repetition_rate(texts[key]) for key in ("ppo", "sft")}
        ppo_loops, sft_loops = loops["ppo"], loops["sft"]
        result = f"{ppo_loops['rate']:.1%} (SFT {sft_loops['rate']:.1%})"
        interval = _interval(ppo_loops["ci_low"], ppo_loops["ci_high"], True)
        met = ppo_loops["rate"] <= sft_loops["rate"]
        check = "greedy summaries caught in a repetition loop"
        rows.append(_row("PPO", check, result, interval, ppo_loops["n"], "≤ SFT's", met))
        metrics |= {
            "eval/checks/ppo_repetition_rate": ppo_loops["rate"],
            "eval/checks/sft_repetition_rate": sft_loops["rate"],
        }
    if "objective/kl" in ppo_last:
        per_token = ppo_last.get("objective/kl_per_token", float("nan"))
        result = f"{ppo_last['objective/kl']:.3f} nats per summary, {per_token:.4f} per token"
        rows.append(_row("PPO", "KL to the SFT policy, last update's samples", result, "", None, "reported", None))
        metrics |= {"eval/checks/ppo_kl": ppo_last["objective/kl"], "eval/checks/ppo_kl_per_token": per_token}
    return rows, metrics
