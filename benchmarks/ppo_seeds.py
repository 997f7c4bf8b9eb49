"""PPO's learning check per seed, from a sweep's ``cells.json`` or from ``rlhf stages`` run directories.

The check is the one the PPO stage measures against the SFT policy on its evaluation prompts
(:func:`rlhf_core.ppo_eval.learning_check_metrics`): the reward-model score gain over SFT
with its 95% interval above 0, and an EOS rate of at least 90%; beside it the KL of the last
update and both policies' repetition rates (share of greedy summaries caught in a loop, which
must be no higher for PPO than for SFT). From a sweep, the KL must also be bounded: a cell the
sweep's seed-health rule flags (final KL or response length outside 2x / 1.5x of its sibling
seeds' median, docs/operations/sweeps.md "Seed health") fails. Writes one object per cell: ``seed``,
``ppo_score_gain``, ``ppo_score_gain_ci`` ``[low, high]``, ``ppo_eos_rate``, ``ppo_kl``,
``repetition_rate``, ``sft_repetition_rate``, ``flagged`` (``None`` outside a sweep),
``passed``, with the machine and the commit.

Usage:
  .venv/bin/python benchmarks/ppo_seeds.py --cells runs/sweeps/cpu-seeds/summary/cells.json \\
      --out benchmarks/results/cpu-seeds.json
  .venv/bin/python benchmarks/ppo_seeds.py --run 1=runs/s1 --run 2=runs/s2 --out FILE
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


def cell(seed: int, metrics: dict[str, float], flagged: bool | None = None) -> dict:
    """One cell's check from the PPO stage's final metrics (``eval/...`` and ``objective/kl``) and
    the sweep's seed-health flag (``None``: not from a sweep)."""
    gain = metrics.get("eval/score_gain_vs_sft", math.nan)
    low = metrics.get("eval/score_gain_vs_sft_ci_low", math.nan)
    high = metrics.get("eval/score_gain_vs_sft_ci_high", math.nan)
    eos = metrics.get("eval/eos_rate_policy", math.nan)
    repetition = metrics.get("eval/repetition_rate_policy", math.nan)
    sft_repetition = metrics.get("eval/repetition_rate_sft", math.nan)
    return {
        "seed": seed,
        "ppo_score_gain": gain,
        "ppo_score_gain_ci": [low, high],
        "ppo_eos_rate": eos,
        "ppo_eos_rate_ci": [
            metrics.get("eval/eos_rate_policy_ci_low", math.nan),
            metrics.get("eval/eos_rate_policy_ci_high", math.nan),
        ],
        "ppo_kl": metrics.get("objective/kl", math.nan),
        "repetition_rate": repetition,
        "sft_repetition_rate": sft_repetition,
        "flagged": flagged,
        "passed": bool(low > 0 and eos >= 0.9 and repetition <= sft_repetition and not flagged),
    }


def from_cells(path: Path) -> list[dict]:
    """Cells of a sweep's ``cells.json`` (:func:`rlhf_core.sweep.summary_rows`)."""
    names = {
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
        out.append(cell(int(row["seed"]), metrics, flagged) | {"cell": row["cell"], "error": row.get("error")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=Path, help="a sweep's summary cells.json")
    parser.add_argument("--run", action="append", default=[], help="SEED=DIR: an `rlhf stages` run directory")
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None, help="the commit the runs were made with (default: HEAD)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.judge_agreement import cpu_flags
    from benchmarks.truncation import cpu_model

    cells = from_cells(args.cells) if args.cells else []
    for item in args.run:
        seed, _, directory = item.partition("=")
        metrics = json.loads((Path(directory) / "ppo" / "metrics.json").read_text())
        cells.append(cell(int(seed), metrics) | {"run": directory})
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
            "PPO minus SFT score: 95% interval above 0; PPO EOS rate >= 0.9; PPO repetition rate <= SFT's; "
            "from a sweep, not flagged by its seed-health rule (KL and length within 2x / 1.5x of the siblings)"
        ),
        "passed": f"{sum(c['passed'] for c in cells)}/{len(cells)}",
        "cells": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
