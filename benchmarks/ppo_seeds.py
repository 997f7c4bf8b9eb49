"""PPO's learning check per seed, from a sweep's ``cells.json`` or from ``rlhf stages`` run directories.

The check is the one the PPO stage measures against the SFT policy on its evaluation prompts
(:func:`rlhf_core.ppo.eval.learning_check_metrics`), as Huang et al. 2024 state it for every run
("our PPO implementation at least optimizes the RLHF objective"):
  (a) the RLHF objective's gain over SFT, the reward-model score minus ``kl_coef`` times the
      summary's KL from SFT, minus SFT's score, with its 95% t interval above 0;
  (b) an EOS rate of at least 90%;
  (c) greedy summaries in a repetition loop at most 5 points more often than SFT's
      (:data:`rlhf_core.report.learning_checks.REPETITION_TOLERANCE`);
  (d) the score gain over SFT with its interval, reported.
From a sweep, a cell its seed-health rule flags (final KL or response length outside 2x / 1.5x of
its sibling seeds' median, docs/operations/sweeps.md "Seed health") is marked, not failed. Writes
one object per cell: ``seed``, ``estimator`` (``ppo.advantage_estimator``), ``objective_gain``,
``objective_gain_ci`` ``[low, high]``, ``ppo_score_gain``, ``ppo_score_gain_ci``,
``ppo_eos_rate``, ``ppo_eos_rate_ci``, ``ppo_kl`` (the last update's samples),
``ppo_kl_vs_sft`` (the evaluation summaries'), ``repetition_rate``, ``sft_repetition_rate``,
``flagged`` (``None`` outside a sweep), ``passed``, with the machine and the commit.

Usage:
  .venv/bin/python benchmarks/ppo_seeds.py --cells runs/sweep-estimators/summary/cells.json \\
      --out benchmarks/results/cpu-seeds.json
  .venv/bin/python benchmarks/ppo_seeds.py --run 1=runs/s1 --run 2:rloo=runs/s2 --out FILE
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cell(seed: int, metrics: dict[str, float], flagged: bool | None = None, estimator: str = "gae") -> dict:
    """One cell's check from the PPO stage's final metrics (``eval/...`` and ``objective/kl``) and
    the sweep's seed-health flag (``None``: not from a sweep)."""
    from rlhf_core.report.learning_checks import REPETITION_TOLERANCE

    objective = metrics.get("eval/objective_gain_vs_sft", math.nan)
    objective_low = metrics.get("eval/objective_gain_vs_sft_ci_low", math.nan)
    eos = metrics.get("eval/eos_rate_policy", math.nan)
    repetition = metrics.get("eval/repetition_rate_policy", math.nan)
    sft_repetition = metrics.get("eval/repetition_rate_sft", math.nan)
    return {
        "seed": seed,
        "estimator": estimator,
        "objective_gain": objective,
        "objective_gain_ci": [objective_low, metrics.get("eval/objective_gain_vs_sft_ci_high", math.nan)],
        "ppo_score_gain": metrics.get("eval/score_gain_vs_sft", math.nan),
        "ppo_score_gain_ci": [
            metrics.get("eval/score_gain_vs_sft_ci_low", math.nan),
            metrics.get("eval/score_gain_vs_sft_ci_high", math.nan),
        ],
        "ppo_eos_rate": eos,
        "ppo_eos_rate_ci": [
            metrics.get("eval/eos_rate_policy_ci_low", math.nan),
            metrics.get("eval/eos_rate_policy_ci_high", math.nan),
        ],
        "ppo_kl": metrics.get("objective/kl", math.nan),
        "ppo_kl_vs_sft": metrics.get("eval/kl_vs_sft", math.nan),
        "repetition_rate": repetition,
        "sft_repetition_rate": sft_repetition,
        "flagged": flagged,
        "passed": bool(
            objective_low > 0 and eos >= 0.9 and repetition <= sft_repetition + REPETITION_TOLERANCE + 1e-12
        ),
    }


def from_cells(path: Path) -> list[dict]:
    """Cells of a sweep's ``cells.json`` (:func:`rlhf_core.run.sweep.summary_rows`)."""
    names = {
        "eval/objective_gain_vs_sft": "PPO objective gain vs SFT",
        "eval/objective_gain_vs_sft_ci_low": "PPO objective gain vs SFT ci_low",
        "eval/objective_gain_vs_sft_ci_high": "PPO objective gain vs SFT ci_high",
        "eval/kl_vs_sft": "PPO KL vs SFT",
        "eval/score_gain_vs_sft": "PPO score gain vs SFT",
        "eval/score_gain_vs_sft_ci_low": "PPO score gain vs SFT ci_low",
        "eval/score_gain_vs_sft_ci_high": "PPO score gain vs SFT ci_high",
        "eval/eos_rate_policy": "PPO EOS rate",
        "eval/eos_rate_policy_ci_low": "PPO EOS rate ci_low",
        "eval/eos_rate_policy_ci_high": "PPO EOS rate ci_high",
        "objective/kl": "PPO KL",
        "eval/repetition_rate_policy": "PPO repetition rate",
        "eval/repetition_rate_sft": "SFT repetition rate",
    }
    out = []
    for row in json.loads(path.read_text())["cells"]:
        metrics = {key: row[column] for key, column in names.items() if row.get(column) is not None}
        flagged = bool(row.get("flagged"))
        estimator = row.get("ppo.advantage_estimator", "gae")
        out.append(
            cell(int(row["seed"]), metrics, flagged, estimator) | {"cell": row["cell"], "error": row.get("error")}
        )
    return out


def from_run(item: str) -> dict:
    """A cell from ``SEED[:ESTIMATOR]=DIR``: an ``rlhf stages`` run directory (its
    ``ppo/metrics.json``) and the estimator it ran with (default ``gae``)."""
    label, _, directory = item.partition("=")
    seed, _, estimator = label.partition(":")
    metrics = json.loads((Path(directory) / "ppo" / "metrics.json").read_text())
    return cell(int(seed), metrics, estimator=estimator or "gae") | {"run": directory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=Path, help="a sweep's summary cells.json")
    parser.add_argument(
        "--run", action="append", default=[], help="SEED[:ESTIMATOR]=DIR: an `rlhf stages` run directory"
    )
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None, help="the commit the runs were made with (default: HEAD)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.judge_agreement import cpu_flags
    from benchmarks.truncation import cpu_model

    cells = from_cells(args.cells) if args.cells else []
    for item in args.run:
        cells.append(from_run(item))
    if not cells:
        parser.error("give --cells or at least one --run")
    commit = (
        args.commit
        or subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    )
    report = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}",
        "commit": commit,
        "preset": args.preset,
        "check": (
            "(a) RLHF objective (RM score - kl_coef x KL from SFT) minus SFT's score: 95% t interval above 0; "
            "(b) PPO EOS rate >= 0.9; (c) PPO repetition rate <= SFT's + 5 points; (d) score gain reported"
        ),
        "passed": f"{sum(c['passed'] for c in cells)}/{len(cells)}",
        "cells": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
