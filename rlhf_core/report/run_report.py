"""The run's report: the evaluation's results beside every stage's own figures, written to the
evaluation stage's output as ``report.html`` and ``report.md`` (laid out by
:func:`rlhf_core.views.page.write_report`), with the stage's ``metrics.json``.

It runs after :func:`rlhf_core.evaluation.stage.run_evaluation` (the pipeline's evaluation stage calls
both) and reads the other stages' outputs: their training curves (``metrics.jsonl``), the
learning checks' inputs (:mod:`rlhf_core.report.learning_checks`), the reward model's calibration
(Huang et al. 2024, arXiv:2403.17031, Figure 5), the per-token plots of Details 13 and 22 and the
policy pairs the preference data compares (Table 2, from the data stage's ``stats.json``).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common.io import METRICS_FILE, METRICS_LOG, SAMPLES_FILE, atomic_file, write_json_atomic
from ..common.tracking import NullTracker, Tracker, read_metrics
from ..config.settings import EvalConfig, PipelineConfig, PPOConfig
from ..evaluation.judging import unreadable_answers, win_counts
from ..evaluation.reward_eval import BASELINES, CALIBRATION_PLOT, REWARD_LOGITS
from ..evaluation.stage import POLICIES, Evaluation
from ..metrics.statistics import mean_ignoring_missing
from ..views.page import plot_training_curves, write_report
from ..views.plots import WIN_RATE_BY_LENGTH, plot_length_control, plot_value_vs_reward, plot_win_rate_by_length
from .learning_checks import NOT_GATED, learning_checks, rm_splits

log = logging.getLogger(__name__)

#: The files of the report in the evaluation stage's output that are logged as artifacts
#: (those present).
REPORT_FILES = (
    "report.html",
    "report.md",
    "length_control.png",
    f"{WIN_RATE_BY_LENGTH}.png",
    "training_curves.png",
    "ppo_curves.png",
    CALIBRATION_PLOT,
    f"{REWARD_LOGITS}.png",
    "value_vs_reward.png",
    "token_shift.html",
)

#: PPO metrics the report plots per update: score, KL, EOS rate and response length.
PPO_CURVE_KEYS = ["objective/scores", "objective/kl", "response/eos_rate", "response/length_mean"]

#: Report headings of the per-token plots (Details 13 and 22, Figure 11).
REWARD_LOGITS_HEADING = "Reward logits per token (Detail 13)"
VALUE_VS_REWARD_HEADING = "Value model as a per-token reward model; PPO's rewards and values (Detail 22, Figure 11)"

#: The file stem of PPO's value-against-reward plot and its JSON
#: (:func:`rlhf_core.ppo.trainer.write_value_vs_reward`).
VALUE_VS_REWARD = "value_vs_reward"


#: Huang et al. 2024, Table 2 and Appendix L (Tables 21-27): per split of the full preference
#: dataset (``openai/summarize_from_feedback``), the distinct policy pairs compared, the comparisons,
#: the comparisons per pair (min, median, max) and the most compared pair with its count.
PAPER_POLICY_PAIRS: dict[str, dict[str, Any]] = {
    "train": {"unique": 47, "comparisons": 92858, "per_pair": (53, 470, 18065), "top": ("ref, sup2", 18065)},
    "validation": {
        "unique": 241,
        "comparisons": 83802,
        "per_pair": (2, 183, 3252),
        "top": ("ref, sup4_t0.7", 3252),
    },
    "validation_cnndm": {
        "unique": 7,
        "comparisons": 2284,
        "per_pair": (140, 148, 1410),
        "top": ("supcnndm3_6b_t.3, supcnndm3_6b_t.3", 1410),
    },
}

#: Report headings of the data stage's tables (Table 2, Appendix L).
POLICY_PAIRS_HEADING = "Preference data: policy pairs compared per split (Table 2)"
TOP_PAIRS_HEADING = "Preference data: the most compared policy pairs (Appendix L)"
#: The most compared pairs of each split that the report lists.
TOP_PAIRS = 5


@dataclass(frozen=True)
class StageOutputs:
    """The output directories of the stages the report reads beside the evaluation's."""

    data: Path
    sft: Path
    reward: Path
    reward_eval: Path
    ppo: Path
    dpo: Path
    dpo_eval: Path


def finish_evaluation(
    cfg: PipelineConfig, evaluation: Evaluation, stages: StageOutputs, out_dir: Path, tracker: Tracker | None = None
) -> dict[str, float]:
    """The evaluation stage's end: the report (:func:`write_run_report`), then ``metrics.json``
    (the evaluation's metrics, the learning checks' ``eval/checks/...`` and ``eval/seconds``, the
    stage's wall time), and to ``tracker`` those metrics, the first 32 summary rows as the
    table ``evaluation_samples`` and the :data:`REPORT_FILES` present as artifacts.

    Returns:
        The metrics written.
    """
    tracker = tracker or NullTracker()
    out = Path(out_dir)
    metrics = evaluation.metrics | write_run_report(cfg, evaluation, stages, out)
    metrics["eval/seconds"] = time.perf_counter() - evaluation.started
    write_json_atomic(out / METRICS_FILE, metrics)
    tracker.log_metrics(metrics)
    tracker.log_table("evaluation_samples", evaluation.rows[:32])
    for name in REPORT_FILES:
        if (out / name).is_file():
            tracker.log_artifact(out / name)
    log.info("evaluation: win rates %s", {key: round(metrics[f"eval/{key}/win_rate"], 3) for key, _ in POLICIES})
    return metrics


def write_run_report(cfg: PipelineConfig, evaluation: Evaluation, stages: StageOutputs, out: Path) -> dict[str, float]:
    """Plots, token-shift page, learning checks and ``report.html``/``report.md`` in ``out``.

    Returns:
        The learning checks' metrics (``eval/checks/...``).
    """
    ecfg = cfg.eval
    plots, token_tables = report_plots(ecfg, evaluation, stages, out)
    shift_html = "\n".join(evaluation.shift_blocks)
    if shift_html:
        with atomic_file(out / "token_shift.html") as fh:
            fh.write(f"<!doctype html><meta charset='utf-8'>{shift_html}")
    rm_metrics = _read_json(stages.reward_eval / METRICS_FILE)
    tables = {
        "Reward model accuracy: the reward model (RM) and DPO's implicit one": reward_model_rows(
            rm_metrics, _read_json(stages.dpo_eval / METRICS_FILE), cfg.data.format
        )
    }
    data_stats = _read_json(stages.data / "stats.json")
    pair_rows, top_rows = policy_pair_rows(data_stats)
    if pair_rows:
        tables |= {POLICY_PAIRS_HEADING: pair_rows, TOP_PAIRS_HEADING: top_rows}
    checks, check_metrics = run_learning_checks(cfg, evaluation, stages, rm_metrics)
    n = len(evaluation.prompts)
    write_report(
        out,
        title=f"RLHF on TL;DR: {cfg.name}" if cfg.data.format == "tldr" else f"RLHF: {cfg.name}, TRL-format data",
        intro=f"Base model: {evaluation.base_name}; evaluation on {n} {ecfg.split} prompts at temperature {ecfg.temperature}.",
        summary=checks,
        headline=evaluation.headline,
        tables=tables,
        plots=plots,
        figure_tables=token_tables,
        samples=report_samples(evaluation.rows[: ecfg.report_samples]),
        html_blocks={
            "Token shift (Table 8): SFT, PPO and DPO summaries coloured by rank under the base model": shift_html
        }
        if shift_html
        else None,
        notes=report_notes(cfg, evaluation) + gating_notes(checks) + policy_pair_notes(data_stats),
    )
    return check_metrics


def report_plots(
    ecfg: EvalConfig, evaluation: Evaluation, stages: StageOutputs, out: Path
) -> tuple[dict[str, Path], dict[str, list[dict[str, Any]]]]:
    """The report's plots in ``out``, in report order: PPO's curves per update, the win rate
    by mean summary length (:func:`win_rate_by_length`) and against the length ratio (Figure 8), the reward model's calibration (Figure 5), the per-token
    plots (:func:`per_token_sections`) and every stage's training curves; those whose inputs
    exist.

    Returns:
        ``({heading: PNG in out}, {heading: table rows})`` for ``write_report``'s ``plots`` and
        ``figure_tables``.
    """
    plots = {"Win rate by mean summary length": win_rate_by_length(evaluation.metrics, POLICIES, out)}
    if any(math.isfinite(r) for ratios, _ in evaluation.curves.values() for r in ratios):
        plots["Win rate against summary length"] = plot_length_control(
            evaluation.curves, out / "length_control.png", bins=ecfg.length_bins
        )
    else:  # every summary or reference without a word: no length ratio to bin
        log.warning("no summary and reference both have words: no plot of win rate against summary length")
    if (stages.reward_eval / CALIBRATION_PLOT).is_file():
        shutil.copyfile(stages.reward_eval / CALIBRATION_PLOT, out / CALIBRATION_PLOT)
        plots["Reward model calibration"] = out / CALIBRATION_PLOT
    token_plots, token_tables = per_token_sections(stages.reward_eval, stages.ppo, out)
    plots |= token_plots
    metric_files = _metric_logs(stages)
    if any(p.is_file() for p in metric_files.values()):
        plots["Training curves"] = plot_training_curves(
            {k: v for k, v in metric_files.items() if v.is_file()}, out / "training_curves.png"
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
    return plots, token_tables


def win_rate_by_length(metrics: dict[str, float], policies: Sequence[tuple[str, str]], out: Path) -> Path:
    """Each policy's win rate against the references by its mean summary length in tokens, from
    the evaluation's metrics (``eval/{key}/win_rate``, its interval, ``eval/{key}/response_tokens``,
    ``eval/reference/response_tokens``), drawn into ``out`` (Huang et al. 2024, Figures 7 and 8,
    left: :func:`rlhf_core.views.plots.plot_win_rate_by_length`).

    Args:
        policies: ``(key, label)`` pairs, the label naming the point.
    """
    points = {
        label: (
            metrics.get(f"eval/{key}/response_tokens", math.nan),
            {
                "win_rate": metrics.get(f"eval/{key}/win_rate", math.nan),
                "ci_low": metrics.get(f"eval/{key}/win_rate_ci_low", math.nan),
                "ci_high": metrics.get(f"eval/{key}/win_rate_ci_high", math.nan),
            },
        )
        for key, label in policies
    }
    reference = metrics.get("eval/reference/response_tokens")
    return plot_win_rate_by_length(points, out / f"{WIN_RATE_BY_LENGTH}.png", reference_tokens=reference)


def _metric_logs(stages: StageOutputs) -> dict[str, Path]:
    """Each trained stage's ``metrics.jsonl``, by its name in the report."""
    return {
        "SFT": stages.sft / METRICS_LOG,
        "reward model": stages.reward / METRICS_LOG,
        "PPO": stages.ppo / METRICS_LOG,
        "DPO": stages.dpo / METRICS_LOG,
    }


def run_learning_checks(
    cfg: PipelineConfig, evaluation: Evaluation, stages: StageOutputs, rm_metrics: dict[str, float]
) -> tuple[list[dict], dict[str, float]]:
    """:func:`rlhf_core.report.learning_checks.learning_checks` on the stages' outputs: SFT's
    ``metrics.json`` and ``samples.jsonl``, the reward model's evaluation metrics
    ``rm_metrics`` and DPO's implicit one's, PPO's last update with a KL, and the evaluation's
    SFT, PPO and DPO scores, summaries and KLs from SFT (with ``ppo.kl_coef``)."""
    sft_samples_file = stages.sft / SAMPLES_FILE
    sft_samples = [json.loads(line) for line in sft_samples_file.open()] if sft_samples_file.is_file() else []
    return learning_checks(
        _read_json(stages.sft / METRICS_FILE),
        sft_samples,
        rm_metrics,
        _last_record_with(stages.ppo / METRICS_LOG, "objective/kl"),
        evaluation.scored["ppo"],
        evaluation.scored["sft"],
        texts={key: [r[key] for r in evaluation.rows] for key in ("ppo", "sft", "dpo")},
        data_format=cfg.data.format,
        dpo=evaluation.scored["dpo"],
        kl=evaluation.kl,
        kl_coef=cfg.ppo.kl_coef,
        dpo_metrics=_read_json(stages.dpo_eval / METRICS_FILE),
    )


def _last_record_with(path: Path, key: str) -> dict[str, float]:
    """The last stepped record of a ``metrics.jsonl`` that holds ``key`` (``{}`` if none)."""
    if not path.is_file():
        return {}
    records = [m for step, m in read_metrics(path) if step is not None and key in m]
    return records[-1] if records else {}


def report_samples(rows: list[dict]) -> list[dict]:
    """The report's sample rows from ``summaries.jsonl``'s: the post, the reference and each
    policy's summary, with their scores with and without the EOS trick."""
    return [
        {
            "post": r["post"],
            "reference": r["reference"],
            "reference_score": r["reference_score"],
            **{key: r[key] for key, _ in POLICIES},
            **{f"{key}_score": r[f"{key}_score"] for key, _ in POLICIES},
            **{f"{key}_raw_score": r[f"{key}_raw_score"] for key, _ in POLICIES},
        }
        for r in rows
    ]


def report_notes(cfg: PipelineConfig, evaluation: Evaluation) -> list[str]:
    """The report's notes: how the win rates were judged and how far the judge can be trusted
    (:func:`judge_note`), what an offline judge is, how many comparisons were made, and how
    title copy, diversity, repetition loops, RM-judge agreement and the RM score are measured."""
    ecfg, n = cfg.eval, len(evaluation.prompts)
    notes = judge_notes(cfg, evaluation)
    k = min(ecfg.diversity_prompts, n)
    notes.append(
        f"Title copy: share of summaries whose longest common word subsequence with the post title covers "
        f"at least {ecfg.title_copy_threshold:.0%} of the title. Diversity: mean pairwise normalised edit "
        f"distance among {ecfg.diversity_samples} samples per prompt at temperature {cfg.ppo.temperature} "
        f"({k} prompts). Repetition loops: share of summaries in which a run of words is immediately "
        "repeated over at least 6 words (a policy caught in a loop). RM-judge agreement: share of judged pairs where "
        "the reward model and the judge prefer the same summary, a tie counting half (Detail 17)."
    )
    notes.append(score_note(cfg.ppo.non_eos_penalty, evaluation.prompts.max_new))
    notes.append(estimator_note(cfg.ppo))
    return notes


def judge_notes(cfg: PipelineConfig, evaluation: Evaluation) -> list[str]:
    """The notes on the judge, shared by the run's report and ``rlhf evaluate``'s: how the win
    rates were judged, with which prompt, and how far the judge can be trusted
    (:func:`judge_note`); what an offline judge is; how many comparisons were made when some
    were not (a spending cap, unreadable answers, request errors)."""
    ecfg, verdicts = cfg.eval, evaluation.verdicts
    by_id = verdicts.by_id
    judge_name = by_id and next(iter(by_id.values())).judge or (ecfg.judge_model or ecfg.judge)
    if ecfg.judge_prompt:
        prompt = f"the prompt of {Path(ecfg.judge_prompt).name} (eval.judge_prompt)"
    elif cfg.data.format == "trl":
        prompt = "a neutral pairwise prompt (TRL-format data)"
    else:
        prompt = JUDGE_PROMPT_NAME
    notes = [judge_note(judge_name, ecfg, len(evaluation.prompts), evaluation.judge_human or {}, prompt)]
    unreadable, answered, example = unreadable_answers(verdicts.judgements)
    if answered and unreadable == answered:  # said first, in one line: no verdict to read below
        shown = example if len(example or "") <= 120 else f"{(example or '')[:120]}..."
        notes.insert(
            0,
            f"The judge {judge_name} gave no readable verdict: {answered} answers, none naming a summary "
            f"(for example {shown!r}); the win rates below are empty.",
        )
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
    return notes


def gating_notes(checks: list[dict]) -> list[str]:
    """The report's note, when PPO's objective check is reported and not gated
    (:data:`rlhf_core.report.learning_checks.NOT_GATED`): why, and where PPO's learning is checked."""
    if not any(row["target"] == NOT_GATED for row in checks):
        return []
    return [
        "PPO against this reward model is reported, not gated: the reward model failed its own check (its row in "
        "the first table, beside its baselines 'longer wins' and 'the preferred policy wins'), so a gain in its "
        "score says nothing of the summaries' quality. PPO's learning is checked against a reward it can learn, "
        "a rule reward, by benchmarks/ppo_learning.py (docs/results/learning.md)."
    ]


def estimator_note(ppo: PPOConfig) -> str:
    """The report's note on how PPO estimated its advantages (``ppo.advantage_estimator``)."""
    k = ppo.samples_per_prompt
    prompts = ppo.batch_size // k
    samples = f"{k} samples of each of {prompts}" if k > 1 else f"one sample of each of {prompts}"
    samples += " prompts per update"
    if ppo.advantage_estimator == "gae":
        return (
            f"PPO's advantages: GAE (gamma {ppo.gamma}, lambda {ppo.lam}) with a value model, whitened (the paper's, "
            f"Detail 25); {samples}."
        )
    if ppo.advantage_estimator == "rloo":
        return (
            f"PPO's advantages: critic-free, no value model; {samples}, each response's advantage its return minus "
            "the mean return of the prompt's other samples (RLOO, arXiv 2402.14740), the return being its score "
            "minus kl_coef times its KL from SFT."
        )
    scale = {
        "group": "divided by the standard deviation of the prompt's scores",
        "batch": "divided by the standard deviation of the batch's scores",
        "none": "not divided (Dr. GRPO, arXiv 2503.20783)",
    }[ppo.scale_rewards]
    return (
        f"PPO's advantages: critic-free, no value model; {samples}, each response's advantage its score minus the "
        f"mean score of the prompt's samples, {scale} (GRPO, arXiv 2402.03300, ppo.scale_rewards: "
        f"{ppo.scale_rewards}); the KL from SFT is a per-token k3 term of the loss, weighted by kl_coef."
    )


def score_note(non_eos_penalty: float | None, max_new: int) -> str:
    """The report's note on what the RM score is: with PPO's EOS trick (Detail 23) when
    ``ppo.non_eos_penalty`` is set, else the reward model's output at the last token."""
    if non_eos_penalty is None:
        return (
            "RM score: the normalised reward model's output at the summary's last token, EOS or not "
            "(ppo.non_eos_penalty: null, no EOS trick), the same as RM raw score. EOS rate: share of "
            "summaries that end with EOS."
        )
    return (
        f"RM score: the normalised reward model's score with PPO's EOS trick (Detail 23): a summary "
        f"that does not end with EOS within {max_new} tokens scores {non_eos_penalty:g} "
        f"(ppo.non_eos_penalty). RM raw score: the reward model's output at the summary's last token, "
        f"EOS or not. EOS rate: share of summaries that end with EOS."
    )


#: How the report names the paper's judge prompt.
JUDGE_PROMPT_NAME = "the prompt of Huang et al. (2024), Appendix I"


def judge_note(
    judge_name: str, ecfg: EvalConfig, n: int, judge_human: dict[str, Any], prompt: str = JUDGE_PROMPT_NAME
) -> str:
    """The report's sentence on how win rates were judged (with ``prompt``, the judge prompt's
    name) and how far the judge can be trusted:
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
        f"(a tie counts half), judged by {judge_name} with {prompt}, "
        f"{orders}; 95% Wilson intervals; {n} {ecfg.split} prompts."
    )
    if not judge_human:
        return text + " The judge's agreement with human labels was not measured (eval.judge_human_comparisons: 0)."
    if not judge_human.get("n"):
        return (
            text
            + " The judge's agreement with human labels could not be measured: it gave no readable verdict on them "
            "(unreadable answers or request errors)."
        )
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


def reward_model_rows(
    rm_metrics: dict[str, float], dpo_metrics: dict[str, float], data_format: str = "tldr"
) -> list[dict[str, str]]:
    """The report's reward-model table (Detail 19, Figure 6): per evaluation split of
    :func:`rlhf_core.report.learning_checks.rm_splits` (held out of train, validation, CNN/DM; under
    ``data.format: trl`` the data's own), the accuracy of the reward model
    and of DPO's implicit reward model on the same pairs (``reward_eval`` and ``dpo_eval``
    metrics), with 95% Wilson intervals, the pair count, the split's distribution (in or
    out of distribution) and the baselines' accuracies on the same pairs ("longer wins", "the
    preferred policy wins": :func:`rlhf_core.evaluation.reward_eval.baseline_accuracies`); "-" where a
    stage did not evaluate the split or a baseline does not apply."""

    def cell(m: dict[str, float], prefix: str, key: str = "accuracy") -> str:
        if f"{prefix}/{key}" not in m:
            return "-"
        text = f"{m[f'{prefix}/{key}']:.1%}"
        if f"{prefix}/{key}_ci_low" in m and f"{prefix}/{key}_ci_high" in m:
            text += f" [{m[f'{prefix}/{key}_ci_low']:.1%}, {m[f'{prefix}/{key}_ci_high']:.1%}]"
        return text

    rows = []
    for prefix, (name, distribution) in rm_splits(data_format).items():
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
                | {
                    label: cell(rm_metrics or dpo_metrics, prefix, f"baseline/{name}/accuracy")
                    for name, label in BASELINES.items()
                }
            )
    return rows


def _per_pair(values: tuple | list) -> str:
    return " / ".join(f"{v:g}" for v in values)


def policy_pair_rows(stats: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The report's tables of the policy pairs each preference split compares (Huang et al. 2024,
    Table 2 and Appendix L), from the data stage's ``stats.json``
    (:func:`rlhf_core.data.prepare.policy_pairs`).

    Returns:
        ``(table_2, top_pairs)``: one row per preference split that names its policies, with its
        comparisons, distinct policy pairs and comparisons per pair (min / median / max), beside
        the paper's figures for the split of the same name (:data:`PAPER_POLICY_PAIRS`; "-"
        for a split the paper has not); and the :data:`TOP_PAIRS` most compared pairs of each
        split with their counts and share of the split's comparisons. Both empty when no split
        names its policies (TRL-format rows, or a ``stats.json`` without policy pairs).
    """
    table, top = [], []
    for key, split in stats.get("splits", {}).items():
        pairs = split.get("policy_pairs")
        if pairs is None:
            continue
        name = key.split("/", 1)[1]
        paper = PAPER_POLICY_PAIRS.get(name)
        per_pair = pairs["per_pair"]
        table.append(
            {
                "split": name,
                "comparisons": pairs["comparisons"],
                "unique policy pairs": pairs["unique"],
                "comparisons per pair (min / median / max)": _per_pair(
                    (per_pair["min"], per_pair["median"], per_pair["max"])
                ),
                "paper: comparisons": paper["comparisons"] if paper else "-",
                "paper: unique policy pairs": paper["unique"] if paper else "-",
                "paper: comparisons per pair": _per_pair(paper["per_pair"]) if paper else "-",
                "paper: most compared pair": f"{paper['top'][0]} ({paper['top'][1]})" if paper else "-",
            }
        )
        top += [
            {
                "split": name,
                "policy pair": p["policies"],
                "comparisons": p["count"],
                "share of the split": f"{p['count'] / pairs['comparisons']:.1%}",
            }
            for p in pairs["pairs"][:TOP_PAIRS]
        ]
    return table, top


def policy_pair_notes(stats: dict[str, Any]) -> list[str]:
    """The report's note on its policy-pair tables (:func:`policy_pair_rows`): where the paper's
    figures come from and, for rows read from local files, that the splits are the offline
    re-split rather than the paper's (none without such a table)."""
    if not policy_pair_rows(stats)[0]:
        return []
    note = (
        "Policy pairs (Table 2): a pair is the two policies whose summaries a comparison row sets side by side, "
        "unordered; the paper's columns are Huang et al. (2024), Table 2 and Appendix L, over the full splits of "
        "openai/summarize_from_feedback, for the split of the same name."
    )
    if stats.get("source") == "local":
        note += (
            " These rows were read from local files (data.source: local): their splits are those the preset "
            "configures (data.preference_splits), e.g. the offline re-split of the paper's validation batches, not "
            "the paper's splits, so their counts are what those rows hold, not a reproduction of the paper's."
        )
    return [note]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _before_eos(row: dict[str, Any], key: str) -> list[float]:
    return [v for t, v in enumerate(row[key]) if t != row["eos_index"]]


def reward_logit_rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's table under the reward-logit plot (Detail 13), one row per response of
    ``reward_logits.json`` (:func:`rlhf_core.evaluation.reward_eval.write_reward_logits`): its token count,
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
                "mean of the other logits": mean_ignoring_missing(others),
                "other logits < 0": f"{sum(v < 0 for v in others)}/{len(others)}",
            }
        )
    return rows


def value_reward_rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's table under the value-against-reward plot (Detail 22), one row per summary of
    ``value_vs_reward.json`` (:meth:`rlhf_core.ppo.trainer.PPOTrainer.value_vs_reward`): the
    score (the reward logit at the EOS), the value there, and the means of the values and of the
    reward logits over the other tokens; where the JSON holds PPO's rewards (Figure 11,
    :func:`rlhf_core.ppo.eval.ppo_rewards_and_values`), also the score PPO adds (with the EOS trick,
    Detail 23), the sum of the per-token KL penalties (``-kl_coef`` times the summary's KL) and
    PPO's value of the first token."""
    rows = []
    for r in table.get("responses", []):
        row = {
            "evaluation prompt": r["row"],
            "tokens": len(r["tokens"]),
            "ends with EOS": r["ends_with_eos"],
            "score (reward logit at EOS)": r["score"],
            "value at EOS": r["value_at_eos"],
            "mean value, other tokens": mean_ignoring_missing(_before_eos(r, "values")),
            "mean reward logit, other tokens": mean_ignoring_missing(_before_eos(r, "reward_logits")),
        }
        if "rewards" in r:
            row |= {
                "score PPO adds": r["ppo_score"],
                "KL penalties, sum": math.fsum(r["kl_penalty"]),
                "value of the first token": r["ppo_values"][0] if r["ppo_values"] else None,
            }
        rows.append(row)
    return rows


def per_token_sections(
    reward_eval_dir: Path, ppo_dir: Path, out: Path
) -> tuple[dict[str, Path], dict[str, list[dict[str, Any]]]]:
    """The report's per-token plots: ``reward_logits.png``, which the reward model's evaluation
    drew (Detail 13), copied to ``out``; ``value_vs_reward.png`` drawn into ``out`` from PPO's
    ``value_vs_reward.json`` (Detail 22; the PPO stage runs no plotting code, so that an edit to
    the plots never re-runs it); each with its table (:func:`reward_logit_rows`,
    :func:`value_reward_rows`, from the JSON).

    Returns:
        ``({heading: plot in out}, {heading: table rows})`` for ``write_report``'s ``plots``
        and ``figure_tables``.
    """
    plots: dict[str, Path] = {}
    tables: dict[str, list[dict[str, Any]]] = {}
    for heading, src, name, rows in (
        (REWARD_LOGITS_HEADING, Path(reward_eval_dir), REWARD_LOGITS, reward_logit_rows),
        (VALUE_VS_REWARD_HEADING, Path(ppo_dir), VALUE_VS_REWARD, value_reward_rows),
    ):
        if name == VALUE_VS_REWARD and (src / f"{name}.json").is_file():
            responses = _read_json(src / f"{name}.json").get("responses", [])
            labels = [f"evaluation prompt {r['row']}" for r in responses]
            plots[heading] = plot_value_vs_reward(responses, out / f"{name}.png", labels)
            tables[heading] = rows(_read_json(src / f"{name}.json"))
        elif name != VALUE_VS_REWARD and (src / f"{name}.png").is_file():
            shutil.copyfile(src / f"{name}.png", out / f"{name}.png")
            plots[heading] = out / f"{name}.png"
            tables[heading] = rows(_read_json(src / f"{name}.json"))
    return plots, tables
