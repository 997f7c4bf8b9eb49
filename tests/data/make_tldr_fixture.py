"""Write ``tests/data/tldr/``: real rows of the offline TL;DR folder that the tests read when no
such folder is beside the repository (tests/conftest.py).

    python tests/data/make_tldr_fixture.py [DIR]

``DIR`` defaults to ``$RLHF_TLDR_DIR``, else ``../shared/data/tldr``. The rows are chosen by the
rule below, in each file's order, and named by identity (``rlhf_core.data.hub_subset.row_identity``)
in ``ROWS.json``, a subset file of the same hub datasets as ``configs/data/tldr-offline-rows.json``:
the fixture's rows are a subset of those rows. Each row is copied byte for byte (its whole line).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rlhf_core.data.hub_subset import subset_document

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT = HERE / "tldr"
#: At most this many bytes in all.
MAX_BYTES = 3_000_000
#: The rule: each file's first rows, per batch for the comparison files (``None``: every row).
#: The tests read at most the first 400 SFT rows and 64 comparisons of a batch; a file's first
#: rows keep them as they are in the whole folder.
FIRST_ROWS: dict[str, dict[str | None, int | None]] = {
    "sft_train.jsonl": {None: 6},
    "sft_validation.jsonl": {None: 450},
    "sft_test.jsonl": {None: 64},
    "preference_validation.jsonl": {"batch13": 160, "batch18": 64, "edit_b2_eval_test": None},
    "preference_validation_cnndm.jsonl": {"batch0_cnndm": 24, "cnndm0": 16},
}
#: Batches whose every article is also kept, by its first comparison after the first rows: the
#: CNN/DM comparisons compare each of a few dozen articles many times over.
EVERY_POST = {"batch0_cnndm"}


def select(lines: list[str], rule: dict[str | None, int | None]) -> list[str]:
    """The lines the rule keeps (:data:`FIRST_ROWS`, :data:`EVERY_POST`), in their order."""
    taken: dict[str | None, int] = {}
    posts: set[tuple] = set()
    kept = []
    for line in lines:
        row = json.loads(line)
        group = row.get("batch") if None not in rule else None
        if group not in rule:
            continue
        limit, post = rule[group], (row.get("title"), row.get("post"))
        if limit is None or taken.get(group, 0) < limit or (group in EVERY_POST and post not in posts):
            taken[group] = taken.get(group, 0) + 1
            posts.add(post)
            kept.append(line)
    return kept


def main(argv: list[str]) -> int:
    source = Path(argv[0] if argv else os.environ.get("RLHF_TLDR_DIR") or REPO.parent / "shared" / "data" / "tldr")
    subset = json.loads((REPO / "configs" / "data" / "tldr-offline-rows.json").read_text())
    OUT.mkdir(exist_ok=True)
    files = {}
    for name, rule in FIRST_ROWS.items():
        with open(source / name, encoding="utf-8") as fh:
            lines = fh.readlines()
        (OUT / name).write_text("".join(select(lines, rule)), encoding="utf-8")
        kind = name.split("_")[0]
        split = name.removesuffix(".jsonl").split("_")[1]
        named = subset["files"].get(name, {})
        files[name] = (kind, split, named.get("source", "the offline TL;DR folder's SOURCE.md"))
    doc = subset_document(OUT, files, subset["datasets"])
    (OUT / "ROWS.json").write_text(json.dumps(doc, indent=1) + "\n")
    size = sum(p.stat().st_size for p in OUT.iterdir() if p.is_file())
    print(f"{OUT}: {size} bytes; rows " + ", ".join(f"{n} {len(f['rows'])}" for n, f in doc["files"].items()))
    if size > MAX_BYTES:
        print(f"over {MAX_BYTES} bytes: choose fewer rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
