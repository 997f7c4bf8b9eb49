"""The learning checks: whether each stage learned, measured on rows its training never saw.

They are the report's first table ("Does it learn?"), read from the stages' own evaluations
(SFT's, the reward model's) and from the evaluation stage's scores of the PPO and SFT policies
on the same prompts (:mod:`rlhf_core.evaluation.stage`). Reward-model splits follow Huang et al. 2024
(arXiv:2403.17031), Detail 6; PPO's scores use the EOS trick of Detail 23.
"""

from __future__ import annotations

import math

from ..config.data_settings import IN_DISTRIBUTION_SPLIT
from ..evaluation.reward_eval import BASELINES
from ..metrics.statistics import mean_ignoring_missing, paired_difference, wilson_interval
from ..metrics.text import repetition_rate
from ..train.reward import ResponseScores

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

#: The target of PPO's objective check when the reward model it optimises failed its own check
#: (at chance, or no better than "longer wins" or "the preferred policy wins"): a gain against
#: that reward says nothing of the summaries, so it is shown and not held to a target.
NOT_GATED = "reported, not gated: the reward model failed its check (above)"

#: Check (c): a policy's greedy summaries may fall into repetition loops at most this many
#: percentage points more often than SFT's on the same prompts. SFT's own rate on the cpu-demo's
#: 64 prompts was 7.8%, 15.6% and 12.5% on three seeds (benchmarks/results/cpu-seeds.json), and
#: a rate near 10% of 64 has a 95% interval about 7 points either side: a tighter tolerance
#: would fail seeds on SFT's own spread.
REPETITION_TOLERANCE = 0.05


def learning_checks(
    sft_metrics: dict[str, float],
    sft_samples: list[dict],
    rm_metrics: dict[str, float],
    ppo_last: dict[str, float],
    ppo: ResponseScores,
    sft: ResponseScores,
    texts: dict[str, list[str]] | None = None,
    data_format: str = "tldr",
    dpo: ResponseScores | None = None,
    kl: dict[str, list[float]] | None = None,
    kl_coef: float | None = None,
    dpo_metrics: dict[str, float] | None = None,
) -> Checks:
    """Whether each stage learned, measured on rows its training never saw: the report's first table.

    - SFT (its stage's evaluation prompts): share of greedy summaries that end with EOS within
      the response length, with a 95% Wilson interval (target at least 95%), and the ROUGE-L
      gain over the base model on the same prompts, with a 95% paired interval (target +0.05).
    - Reward model (:func:`reward_model_checks`): accuracy with a 95% Wilson interval per
      evaluation split; on the targeted split (held out of train, in distribution; else the
      validation split) the interval must lie above 50% and above the best baseline's accuracy
      on the same pairs ("longer wins", "the preferred policy wins",
      :func:`rlhf_core.evaluation.reward_eval.baseline_accuracies`). DPO's implicit reward model likewise,
      from ``dpo_metrics``.
    - PPO and DPO (the evaluation prompts, :func:`policy_checks`): (a) the RLHF objective, the
      reward-model score (with the EOS trick, Detail 23) minus ``kl_coef`` times the summary's
      KL from the SFT policy, minus SFT's score on the same prompt, with a 95% paired t interval
      (PPO's target: above 0, Huang et al. 2024: "our PPO implementation at least optimizes the
      RLHF objective", unless the reward model failed its own check: PPO against it is then
      reported, not gated, :data:`NOT_GATED`; DPO's reported: it optimises its own); (b) the EOS rate (target at least
      90%); (c) the share of greedy summaries in a repetition loop
      (:func:`rlhf_core.metrics.text.repetition_loop`; target: at most SFT's plus
      :data:`REPETITION_TOLERANCE`); (d) the score gain over SFT and the KL from SFT (reported);
      and PPO's KL from its last update's samples (reported).

    Args:
        sft_metrics: the SFT stage's ``metrics.json``; sft_samples: its ``samples.jsonl`` rows
            (``rougeL_sft``, ``rougeL_base``); rm_metrics: the reward-model evaluation's
            ``metrics.json``; ppo_last: the last PPO update's metrics (``objective/kl``,
            ``objective/kl_per_token``); ppo, sft, dpo: the policies' scores on the same prompts
            (``(n,)`` float tensors; dpo None when not evaluated); texts: their summaries
            (``{"ppo": [...], "sft": [...], "dpo": [...]}``), for the repetition check; kl:
            ``{"ppo": [n nats], "dpo": [...]}``, each summary's ``log pi(y|x) - log pi_sft(y|x)``
            (:func:`rlhf_core.ppo.rollout.summary_logprobs`); kl_coef: ``ppo.kl_coef``;
            dpo_metrics: DPO's implicit reward model's evaluation ``metrics.json``;
            data_format: ``data.format``, which names the reward model's splits (:func:`rm_splits`).

    Returns:
        ``(rows, metrics)``: table rows (stage, check, result, 95% interval, n, target, met)
        and flat metrics (``eval/checks/...``). A check whose inputs are missing is left out.
    """
    rows: list[dict] = []
    metrics: dict[str, float] = {}
    kl = kl or {}
    rm_step = reward_model_checks(rm_metrics, data_format)
    rm_failed = any(row["met"] is False for row in rm_step[0])  # its targeted split, below a baseline or chance
    steps = [
        sft_checks(sft_metrics, sft_samples),
        rm_step,
        policy_checks("PPO", ppo, sft, texts, kl.get("ppo"), kl_coef, ppo_last, gated=not rm_failed),
    ]
    if dpo_metrics:
        steps.append(reward_model_checks(dpo_metrics, data_format, "DPO"))
    if dpo is not None:
        steps.append(policy_checks("DPO", dpo, sft, texts, kl.get("dpo"), kl_coef))
    for step_rows, step_metrics in steps:
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
        low, high = wilson_interval(round(rate * n_sft), n_sft)
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
        gain = paired_difference(sft_rouge, base_rouge)
        result = (
            f"{gain['mean']:+.3f} (SFT {mean_ignoring_missing(sft_rouge):.3f}, "
            f"base {mean_ignoring_missing(base_rouge):.3f})"
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


def reward_model_checks(rm_metrics: dict[str, float], data_format: str = "tldr", stage: str = "reward model") -> Checks:
    """The reward-model rows of :func:`learning_checks`, one per split of :func:`rm_splits` it
    was evaluated on (``stage`` "DPO": DPO's implicit reward model, from its ``dpo_eval``
    metrics). The targeted split is the in-distribution one or, without held-out comparisons,
    the validation one: its accuracy's interval must lie above 50% and above the best
    baseline's accuracy on the same pairs (``.../baseline/{name}/accuracy``), said in words
    when it does not; the other splits are reported. No metrics of their own."""
    rows = []
    in_dist = f"eval/{IN_DISTRIBUTION_SPLIT}"
    targeted = in_dist if f"{in_dist}/accuracy" in rm_metrics else "eval"
    model = "implicit reward model accuracy" if stage == "DPO" else "accuracy"
    for prefix, (split_name, distribution) in rm_splits(data_format).items():
        if f"{prefix}/accuracy" not in rm_metrics:
            continue
        acc, n = rm_metrics[f"{prefix}/accuracy"], int(rm_metrics.get(f"{prefix}/count", 0))
        low = rm_metrics.get(f"{prefix}/accuracy_ci_low", float("nan"))
        high = rm_metrics.get(f"{prefix}/accuracy_ci_high", float("nan"))
        baselines = {
            label: rm_metrics[f"{prefix}/baseline/{name}/accuracy"]
            for name, label in BASELINES.items()
            if f"{prefix}/baseline/{name}/accuracy" in rm_metrics
        }
        result = f"{acc:.1%}"
        if baselines:
            result += " (" + ", ".join(f"{label}: {value:.1%}" for label, value in baselines.items()) + ")"
        target, met = "reported", None
        if prefix == targeted:
            best = max(baselines.items(), key=lambda item: item[1], default=None)
            if best is None or best[1] < 0.5:
                target, met = "interval above 50%", bool(low > 0.5)
            else:
                target, met = f"interval above 50% and '{best[0]}' ({best[1]:.1%})", bool(low > best[1])
                if not met:
                    result += f"; no better than '{best[0]}' here"
        check = f"{model}, {split_name}, {distribution}"
        rows.append(_row(stage, check, result, _interval(low, high, True), n, target, met))
    return rows, {}


def policy_checks(
    stage: str,
    policy: ResponseScores,
    sft: ResponseScores,
    texts: dict[str, list[str]] | None,
    kl: list[float] | None,
    kl_coef: float | None,
    last_update: dict[str, float] | None = None,
    gated: bool = True,
) -> Checks:
    """The rows of :func:`learning_checks` of one policy (``stage`` "PPO" or "DPO") against
    SFT's summaries of the same prompts: (a) the RLHF objective's gain (with ``kl``, the
    summaries' KL from SFT, and ``kl_coef``; PPO's target when ``gated``, else
    :data:`NOT_GATED`), (b) its EOS rate, (c) its
    repetition loops against SFT's, (d) its score gain and mean KL (reported), and PPO's KL
    from its ``last_update``'s samples (reported). Metrics ``eval/checks/{ppo|dpo}_...``."""
    rows, metrics = [], {}
    key = stage.lower()
    if len(policy.scores) and len(policy.scores) == len(sft.scores):
        scores, sft_scores = policy.scores.tolist(), sft.scores.tolist()
        if kl is not None and kl_coef is not None and len(kl) == len(scores):
            objective = [s - kl_coef * k for s, k in zip(scores, kl)]
            diff = paired_difference(objective, sft_scores)
            check = f"RLHF objective (RM score - {kl_coef:g} x KL from SFT) minus SFT's, same prompts"
            result = f"{diff['mean']:+.3f} (KL {sum(kl) / len(kl):.2f} nats a summary)"
            if stage != "PPO":
                target, met = "reported", None
            else:
                target, met = ("interval above 0", bool(diff["ci_low"] > 0)) if gated else (NOT_GATED, None)
            rows.append(_row(stage, check, result, _interval(diff["ci_low"], diff["ci_high"]), diff["n"], target, met))
            metrics |= {
                f"eval/checks/{key}_objective_gain": diff["mean"],
                f"eval/checks/{key}_objective_gain_ci_low": diff["ci_low"],
                f"eval/checks/{key}_objective_gain_ci_high": diff["ci_high"],
                f"eval/checks/{key}_kl_vs_sft": sum(kl) / len(kl),
            }
        diff = paired_difference(scores, sft_scores)
        result = (
            f"{diff['mean']:+.3f} ({stage} {policy.scores.mean().item():+.3f}, SFT {sft.scores.mean().item():+.3f})"
        )
        check = f"RM score of {stage} minus SFT summaries, same prompts"
        interval = _interval(diff["ci_low"], diff["ci_high"])
        rows.append(_row(stage, check, result, interval, diff["n"], "reported", None))
        eos, n = int(policy.has_eos.sum().item()), len(policy.has_eos)
        low, high = wilson_interval(eos, n)
        interval = _interval(low, high, True)
        rows.append(
            _row(stage, "greedy summaries that end with EOS", f"{eos / n:.1%}", interval, n, "≥ 90%", eos / n >= 0.9)
        )
        metrics |= {
            f"eval/checks/{key}_minus_sft_score": diff["mean"],
            f"eval/checks/{key}_minus_sft_score_ci_low": diff["ci_low"],
            f"eval/checks/{key}_minus_sft_score_ci_high": diff["ci_high"],
            f"eval/checks/{key}_eos_rate_ci_low": low,
            f"eval/checks/{key}_eos_rate_ci_high": high,
        }
    if texts and texts.get(key) and texts.get("sft"):
        loops = {name: repetition_rate(texts[name]) for name in (key, "sft")}
        own, sft_loops = loops[key], loops["sft"]
        result = f"{own['rate']:.1%} (SFT {sft_loops['rate']:.1%})"
        interval = _interval(own["ci_low"], own["ci_high"], True)
        met = own["rate"] <= sft_loops["rate"] + REPETITION_TOLERANCE + 1e-12
        check = "greedy summaries caught in a repetition loop"
        target = f"≤ SFT's + {REPETITION_TOLERANCE:.0%} points"
        rows.append(_row(stage, check, result, interval, own["n"], target, met))
        metrics |= {
            f"eval/checks/{key}_repetition_rate": own["rate"],
            "eval/checks/sft_repetition_rate": sft_loops["rate"],
        }
    if last_update and "objective/kl" in last_update:
        per_token = last_update.get("objective/kl_per_token", float("nan"))
        result = f"{last_update['objective/kl']:.3f} nats per summary, {per_token:.4f} per token"
        rows.append(_row(stage, "KL to the SFT policy, last update's samples", result, "", None, "reported", None))
        metrics |= {f"eval/checks/{key}_kl": last_update["objective/kl"], f"eval/checks/{key}_kl_per_token": per_token}
    return rows, metrics
