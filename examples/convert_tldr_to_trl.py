"""Write the TL;DR rows a configuration reads as files in TRL's dataset formats.

    python examples/convert_tldr_to_trl.py OUT_DIR [--preset smoke] [--form standard] [KEY=VALUE ...]

For each split of the configuration (``data.sft_splits``, ``data.preference_splits``: their
sources, batch filters, row caps and holdouts, a holdout as a split of its own) it writes ``OUT_DIR/sft_{split}.jsonl`` and
``OUT_DIR/preference_{split}.jsonl``, which ``data.format=trl data.local_dir=OUT_DIR`` reads.

``--form standard``: the prompt is the paper's formatted query, already cut to the query
length by its rule (Detail 2: whole paragraphs of the post first), and each response is
``" " + summary`` (Detail 3's leading space), so that the TRL format, reading them with
``data.prompt_truncation`` unused (the prompts fit), gives the same token ids as the ``tldr``
format. ``--form conversational``: one user message holding the formatted post and one
assistant message holding the summary, as a chat model would be trained on them.

Preference rows keep the metadata the reward model's evaluation groups by (``batch``,
``chosen_policy``, ``rejected_policy``, ``confidence``, ``split``) and the labeller
(``worker``: one pair labelled by two workers is two rows). The CNN/DM comparisons become
standard preference rows the same way, for example as a train split and a held-out validation
split::

    python examples/convert_tldr_to_trl.py /tmp/cnndm-trl \
        'data.preference_splits={train: {source: validation, batches: [batch0_cnndm], task: cnndm,
                                 holdout: {split: validation, rows: 87}}}'

"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlhf_core.config.presets import load_config
from rlhf_core.data.prepare import TokenizedSplits, apply_holdouts, tokenize_splits
from rlhf_core.models.tokenizers import load_tokenizer

METADATA = ("batch", "chosen_policy", "rejected_policy", "confidence", "split", "worker")


def trl_rows(row: dict, kind: str, form: str) -> dict:
    """One tokenised TL;DR row (:func:`rlhf_core.data.prepare.tokenize_splits`) in TRL's ``form``."""
    names = ("summary",) if kind == "sft" else ("chosen", "rejected")
    if form == "standard":
        out = {"prompt": row["query"], **{name: " " + row[name] for name in names}}
    else:
        prompt = [{"role": "user", "content": row["query"]}]
        out = {"prompt": prompt, **{name: [{"role": "assistant", "content": row[name]}] for name in names}}
    if kind == "sft":
        out["completion"] = out.pop("summary")
    else:
        out |= {name: row[name] for name in METADATA}
    return {"id": row["id"], **out}


def convert(
    out_dir: Path, preset: str | None, overrides: list[str], form: str
) -> tuple[dict[str, int], TokenizedSplits]:
    """Write every split of the configuration to ``out_dir``.

    Returns:
        ``({file name: rows}, splits)``: the rows written, and the TL;DR rows as the ``tldr``
        format tokenised them (:func:`rlhf_core.data.prepare.tokenize_splits`), for comparison.
    """
    cfg = load_config(preset, overrides)
    tokenizer = load_tokenizer(cfg.model)
    splits = tokenize_splits(cfg.data, tokenizer)
    apply_holdouts(splits, cfg.data)  # a split's holdout is written as a split of its own
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for kind, named in splits.datasets.items():
        for name, ds in named.items():
            path = out_dir / f"{kind}_{name}.jsonl"
            with open(path, "w", encoding="utf-8") as fh:
                for row in ds:
                    fh.write(json.dumps(trl_rows(row, kind, form), ensure_ascii=False) + "\n")
            written[path.name] = len(ds)
    return written, splits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", default="smoke", help="the configuration whose splits are converted")
    parser.add_argument("--form", choices=("standard", "conversational"), default="standard")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE settings, as for rlhf run")
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    written, _ = convert(args.out_dir, args.preset, args.overrides, args.form)
    for name, rows in written.items():
        print(f"{args.out_dir / name}: {rows} rows")


if __name__ == "__main__":
    main()
