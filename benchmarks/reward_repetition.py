"""What repetition looks like to a reward model: its raw score of each SFT summary as written, stated
twice, and repeated up to the response length without EOS, against the human reference.

PPO's greedy summaries fall into loops ("I went on a date with her, she said yes, I went on a date
with her, ..."). This measures whether the reward model pays for that: every variant of a summary is
scored by :func:`rlhf_core.train.reward.score_responses` without the EOS trick (``raw_scores``: the reward
model's own output at the last real token), on the same query, and compared with the summary as
written by the mean paired difference and its 95% normal interval
(:func:`rlhf_core.metrics.statistics.paired_difference`) and the share of prompts where the variant scores
higher. Variants:

- ``once``: the summary, then EOS (what the SFT policy wrote);
- ``twice``: the summary, a space, the summary again, then EOS;
- ``loop``: the summary repeated up to ``response_length`` tokens, no EOS (a loop that ran to the
  token limit, which PPO's EOS trick would score ``non_eos_penalty``, Detail 23);
- ``reference``: the human reference summary, then EOS.

Variants longer than ``response_length`` are cut to it (``twice`` keeps its EOS as the last token).
The summaries are the ``sft`` field of a PPO stage's ``samples.jsonl`` (the SFT policy's near-greedy
summaries of the first rows of the data's ``validation`` split, in order); rows with an empty one are
skipped.

Usage:
  .venv/bin/python benchmarks/reward_repetition.py --data DATA_DIR --reward-model REWARD_NORM_DIR/model \\
      --samples PPO_DIR/samples.jsonl --out benchmarks/results/reward_repetition.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("once", "twice", "loop", "reference")


def variant_ids(tokenizer, summary: str, reference: str, variant: str, response_length: int) -> list[int]:
    """The response token ids of one variant, right-padded with PAD to ``response_length``.

    Raises:
        ValueError: an unknown variant.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    if variant == "loop":
        once = encode(summary)
        ids = (once * (response_length // max(len(once), 1) + 1))[:response_length]
    elif variant in ("once", "twice", "reference"):
        text = {"once": summary, "twice": summary + " " + summary, "reference": reference}[variant]
        ids = encode(text)[: response_length - 1] + [eos]
    else:
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    return ids + [pad] * (response_length - len(ids))


def measure(data_dir: Path, reward_model_dir: Path, samples: Path, response_length: int | None = None) -> dict:
    """The reward model's raw scores (before normalisation, Detail 15) of every variant of each
    SFT summary in ``samples``, and each variant's paired difference from ``once``.

    Row ``i`` of ``samples`` (a PPO stage's ``samples.jsonl``: ``sft`` and ``reference`` text) is
    the ``i``-th query of the data stage's SFT ``validation`` split; rows without an SFT summary
    are skipped. ``response_length`` (tokens; default the data stage's padded SFT response
    length) is where a variant is cut.

    Returns:
        ``n`` (rows scored), ``response_length``, ``mean_raw_score`` ``{variant: float}``,
        ``minus_once`` ``{variant: {"mean", "ci" [low, high] (95%, paired), "share_higher"
        (fraction of rows, 0-1)}}`` and ``raw_scores`` ``{variant: list of n floats}``; scores
        are in the reward model's raw logit units.

    Raises:
        ValueError: ``samples`` has more rows than the validation split of ``data_dir``.
    """
    import torch

    from rlhf_core.data.prepared import load_data_tokenizer, load_prepared
    from rlhf_core.metrics.statistics import paired_difference
    from rlhf_core.train.reward import ScalarModel, score_responses

    tokenizer = load_data_tokenizer(data_dir)
    sft, _, stats = load_prepared(data_dir)
    response_length = response_length or stats["padded_lengths"]["sft_response"]
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    validation = sft["validation"]
    if len(rows) > len(validation):
        raise ValueError(f"{samples}: {len(rows)} rows, but the validation split of {data_dir} has {len(validation)}")
    keep = [i for i, row in enumerate(rows) if row.get("sft")]
    queries = torch.tensor(validation.select(keep)["query_token"])
    model = ScalarModel.from_pretrained(str(reward_model_dir)).eval()
    scores = {}
    for variant in VARIANTS:
        responses = torch.tensor(
            [variant_ids(tokenizer, rows[i]["sft"], rows[i]["reference"], variant, response_length) for i in keep]
        )
        scored = score_responses(
            model, queries, responses, tokenizer.pad_token_id, tokenizer.eos_token_id, None, 8, "auto"
        )
        scores[variant] = scored.raw_scores.tolist()
    out = {"n": len(keep), "response_length": response_length, "mean_raw_score": {}, "minus_once": {}}
    for variant in VARIANTS:
        out["mean_raw_score"][variant] = sum(scores[variant]) / len(keep)
        if variant != "once":
            diff = paired_difference(scores[variant], scores["once"])
            higher = sum(a > b for a, b in zip(scores[variant], scores["once"], strict=True))
            out["minus_once"][variant] = {
                "mean": diff["mean"],
                "ci": [diff["ci_low"], diff["ci_high"]],
                "share_higher": higher / len(keep),
            }
    out["raw_scores"] = scores
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a data stage's directory")
    parser.add_argument("--reward-model", type=Path, required=True, help="a reward model directory (reward_norm/model)")
    parser.add_argument("--samples", type=Path, required=True, help="a PPO stage's samples.jsonl")
    parser.add_argument("--response-length", type=int, help="default: the data's SFT response length (Detail 4)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.judge_agreement import cpu_flags
    from benchmarks.truncation import cpu_model

    result = measure(args.data, args.reward_model, args.samples, args.response_length)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    report = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}",
        "commit": commit,
        "reward_model": str(args.reward_model),
        "samples": str(args.samples),
    } | result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    shown = {k: v for k, v in report.items() if k != "raw_scores"}
    print(json.dumps(shown, indent=2))


if __name__ == "__main__":
    main()
