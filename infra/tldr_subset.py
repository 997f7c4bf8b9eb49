"""Write the subset file naming every row of the offline TL;DR folder (``rlhf_core.data.hub_subset``).

    python infra/tldr_subset.py [DIR] > configs/data/tldr-offline-rows.json

``DIR`` defaults to ``$RLHF_TLDR_DIR``, else ``../shared/data/tldr``. The files named are those
the offline presets (``cpu-demo``, ``smoke``) read; where each came from is its ``SOURCE.md``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rlhf_core.config.data_settings import DataConfig
from rlhf_core.data.hub_subset import subset_document

REPO = Path(__file__).resolve().parent.parent
#: The revision of ``openai/summarize_from_feedback`` read: ``main`` as the hub reported it on
#: 2026-08-11 (unchanged since 2023-01-03). ``vwxyzjn/summarize_from_feedback_tldr_3_filtered`` is
#: read at ``main``: its rows are named by post id, so the rows read stay the same rows.
PREFERENCE_REVISION = "b8f7d168b6f4e95b2a92e84768bd6c955bed2f29"
FILES = {
    "sft_validation.jsonl": (
        "sft",
        "validation",
        "the head of OpenAI's 1.3B PPO samples of the validation split "
        "(vwxyzjn/summarize_from_feedback_details@c26c3a8, eval/oai1b.csv): posts parsed back from its queries",
    ),
    "sft_test.jsonl": (
        "sft",
        "test",
        "the head of the tldr_3_filtered test split (Hritikbansal/dove@02e53a0, data/tldr/test.json)",
    ),
    "preference_validation.jsonl": (
        "preference",
        "validation",
        "OpenAI's comparisons batch13, batch18 and edit_b2_eval_test (redwoodresearch/mlab@b117473, comparisons/)",
    ),
    "preference_validation_cnndm.jsonl": (
        "preference",
        "validation",
        "OpenAI's comparisons batch0_cnndm and cnndm0 (redwoodresearch/mlab@b117473, comparisons/)",
    ),
}


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else os.environ.get("RLHF_TLDR_DIR") or REPO.parent / "shared" / "data" / "tldr")
    data = DataConfig()
    hub = {
        "sft": {"id": data.sft_dataset, "config": None, "revision": "main"},
        "preference": {
            "id": data.preference_dataset,
            "config": data.preference_config,
            "revision": PREFERENCE_REVISION,
        },
    }
    json.dump(subset_document(folder, FILES, hub), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
