"""The report of ``rlhf evaluate`` (the stage ``policy_eval``): policies from elsewhere judged against
the human references, written to the stage's output as ``report.html`` and ``report.md`` with the
stage's ``metrics.json`` (:func:`finish_policy_evaluation`).

It reads only :func:`rlhf_core.evaluation.policies.evaluate_policies`' results: win rates with
their intervals (Huang et al. 2024, arXiv:2403.17031, Figure 1), win rate by summary length
(Figures 7 and 8), ROUGE-L, length, repetition and, where a reward model scored the summaries,
its scores and its agreement with the judge (Detail 17).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from ..common.io import METRICS_FILE, write_json_atomic
from ..common.tracking import NullTracker, Tracker
from ..config.settings import PipelineConfig, policy_key
from ..evaluation.stage import Evaluation
from ..views.page import write_report
from ..views.plots import WIN_RATE_BY_LENGTH, plot_length_control
from .run_report import judge_notes, score_note, win_rate_by_length

log = logging.getLogger(__name__)

#: The files of the report in the stage's output that are logged as artifacts (those present).
POLICY_REPORT_FILES = ("report.html", "report.md", f"{WIN_RATE_BY_LENGTH}.png", "length_control.png")


def finish_policy_evaluation(
    cfg: PipelineConfig, evaluation: Evaluation, out_dir: Path, tracker: Tracker | None = None
) -> dict[str, float]:
    """The stage's end: the report (:func:`write_policy_report`), then ``metrics.json`` (the
    evaluation's metrics and ``eval/seconds``, the stage's wall time), and to ``tracker`` those
    metrics, the summary rows (at most 32) as the table ``evaluation_samples`` and the
    :data:`POLICY_REPORT_FILES` present as artifacts.

    Returns:
        The metrics written.
    """
    tracker = tracker or NullTracker()
    out = Path(out_dir)
    write_policy_report(cfg, evaluation, out)
    metrics = evaluation.metrics | {"eval/seconds": time.perf_counter() - evaluation.started}
    write_json_atomic(out / METRICS_FILE, metrics)
    tracker.log_metrics(metrics)
    tracker.log_table("evaluation_samples", evaluation.rows[:32])
    for name in POLICY_REPORT_FILES:
        if (out / name).is_file():
            tracker.log_artifact(out / name)
    keys = [policy_key(name) for name in cfg.eval.policies]
    log.info("policy evaluation: win rates %s", {k: round(metrics[f"eval/{k}/win_rate"], 3) for k in keys})
    return metrics


def write_policy_report(cfg: PipelineConfig, evaluation: Evaluation, out: Path) -> None:
    """``report.html`` and ``report.md`` in ``out``: the headline (one row per policy, named by
    its source, and the references), how it was judged and measured, the policies' sources,
    the win rate by mean summary length and by length ratio, and sample summaries."""
    ecfg = cfg.eval
    policies = [(policy_key(name), name) for name in ecfg.policies]
    plots = {"Win rate by mean summary length": win_rate_by_length(evaluation.metrics, policies, out)}
    if any(math.isfinite(r) for ratios, _ in evaluation.curves.values() for r in ratios):
        plots["Win rate against summary length"] = plot_length_control(
            evaluation.curves, out / "length_control.png", bins=ecfg.length_bins
        )
    sources = [
        {"policy": name, "source": source, "metric key": f"eval/{policy_key(name)}/..."}
        for name, source in ecfg.policies.items()
    ]
    n = len(evaluation.prompts)
    write_report(
        out,
        title=f"Policies judged against the TL;DR references: {cfg.name}",
        intro=(
            f"{len(policies)} policies on {n} {ecfg.split} prompts at temperature {ecfg.temperature}, "
            f"the data and tokenizer of the preset {cfg.name}."
        ),
        headline=evaluation.headline,
        tables={"Policies and their sources": sources},
        plots=plots,
        samples=[_sample(row, policies, bool(evaluation.scored)) for row in evaluation.rows[: ecfg.report_samples]],
        notes=policy_notes(cfg, evaluation),
    )


def _sample(row: dict[str, Any], policies: list[tuple[str, str]], scored: bool) -> dict[str, Any]:
    """A report sample: the post, the reference and each policy's summary under its name."""
    sample: dict[str, Any] = {"post": row["post"], "reference": row["reference"]}
    for key, name in policies:
        sample[name] = row[key]
    if scored:
        sample["reference_score"] = row["reference_score"]
        for key, name in policies:
            sample[f"{name}_score"] = row[f"{key}_score"]
            sample[f"{name}_raw_score"] = row[f"{key}_raw_score"]
    return sample


def policy_notes(cfg: PipelineConfig, evaluation: Evaluation) -> list[str]:
    """The report's notes: the judge and how far it can be trusted (:func:`judge_note`), what an
    offline judge is, how many comparisons were made, what the reward model is, and what length
    and repetition measure."""
    ecfg = cfg.eval
    notes = judge_notes(cfg, evaluation)
    if ecfg.reward_model:
        notes.append(
            f"Reward model: {ecfg.reward_model} (eval.reward_model). RM-judge agreement: share of judged pairs "
            "where the reward model and the judge prefer the same summary, a tie counting half (Detail 17). "
            + score_note(cfg.ppo.non_eos_penalty, evaluation.prompts.max_new)
        )
    else:
        notes.append(
            "No reward model scored the summaries: give one with rlhf evaluate --reward SOURCE (eval.reward_model)."
        )
    notes.append(
        "Tokens: mean summary length in the preset's tokenizer, up to and including the EOS. Repetition loops: "
        "share of summaries in which a run of words is immediately repeated over at least 6 words."
    )
    return notes
