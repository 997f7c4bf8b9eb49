"""How far a reward model gets on the offline TL;DR comparisons without learning any preference:
the "longer wins" and "the preferred policy wins" baselines of the reward model's evaluation
(:func:`rlhf_core.evaluation.reward_eval.baseline_accuracies`) on comparisons held out of each candidate
training set.

The cpu-demo preset trains its reward model on batch13, one policy pair, where the PPO policy's
summary is the chosen one in 72% of the comparisons: a model that learned which policy wrote a
summary passes a bar of 50%. This asks whether training on more than one policy pair (batch13 and
batch18, as the reward model would see them) removes that shortcut. For each candidate, 20% of the
posts (seeded) are held out, as ``data.preference_splits.train.holdout`` holds out by post; the
policy prior is learned on the other 80% and both baselines are measured on the held-out
comparisons, with 95% Wilson intervals (a tie counts half). No model is involved.

Usage:
  .venv/bin/python benchmarks/rm_baselines.py --data $RLHF_TLDR_DIR --out benchmarks/results/rm_baselines.json \\
      [--seeds 1 2 3]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The candidate training sets: their batches in ``preference_validation.jsonl``.
CANDIDATES = {"batch13": ["batch13"], "batch18": ["batch18"], "batch13+batch18": ["batch13", "batch18"]}


def split_by_post(rows: list[dict], held_share: float, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train, held out)``: the rows of a seeded ``held_share`` of the posts held out, whole."""
    posts = sorted({row["post"] for row in rows})
    random.Random(seed).shuffle(posts)
    held = set(posts[: int(len(posts) * held_share)])
    return [r for r in rows if r["post"] not in held], [r for r in rows if r["post"] in held]


def candidate(rows: list[dict], held_share: float = 0.2, seed: int = 1) -> dict:
    """Both baselines on one candidate's held-out comparisons, the policy prior learned on the rest."""
    from rlhf_core.evaluation.reward_eval import baseline_accuracies, policy_win_rates

    train, held = split_by_post(rows, held_share, seed)

    def columns(part: list[dict]) -> dict[str, list]:
        return {key: [r[key] for r in part] for key in ("chosen", "rejected", "chosen_policy", "rejected_policy")}

    found = baseline_accuracies(columns(held), columns(train), "held")
    out: dict = {"train_rows": len(train), "held_out_rows": len(held)}
    for name in ("longer_wins", "policy_prior"):
        key = f"held/baseline/{name}/accuracy"
        if key in found:
            out[name] = {"accuracy": found[key], "ci": [found[f"{key}_ci_low"], found[f"{key}_ci_high"]]}
    rates = policy_win_rates(columns(train)["chosen_policy"], columns(train)["rejected_policy"])
    out["policy_win_rates"] = {policy: round(rate, 3) for policy, rate in sorted(rates.items())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="the offline TL;DR folder ($RLHF_TLDR_DIR)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds of the held-out posts")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    rows = [json.loads(line) for line in (args.data / "preference_validation.jsonl").open()]
    report = {
        "data": "preference_validation.jsonl (the offline TL;DR comparisons)",
        "held_out": "20% of each candidate's posts, one draw per seed",
        "seeds": {
            str(seed): {
                name: candidate([r for r in rows if r["batch"] in batches], seed=seed)
                for name, batches in CANDIDATES.items()
            }
            for seed in args.seeds
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
