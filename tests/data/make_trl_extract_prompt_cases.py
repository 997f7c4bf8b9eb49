"""Write ``trl_extract_prompt_cases.json``: TRL's own ``extract_prompt`` (``trl.data_utils``) on
implicit-prompt preference pairs, the cases that ``split_implicit_prompt`` must split alike
(tests/rlhf_core/test_data_trl.py).

Run with TRL importable, e.g. TRL's wheel unpacked on ``PYTHONPATH`` (its ``data_utils`` needs
only ``datasets`` and ``transformers``, which the project's environment has)::

    pip download --no-deps trl==1.12.0 -d /tmp/trl && python -m zipfile -e /tmp/trl/trl-1.12.0-py3-none-any.whl /tmp/trl/x
    PYTHONPATH=/tmp/trl/x .venv/bin/python tests/data/make_trl_extract_prompt_cases.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("trl_extract_prompt_cases.json")


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


#: (chosen, rejected) pairs that share a prompt: TRL's documented example, a difference inside a
#: word, after a newline, after two spaces, one response a prefix of the other, and conversations.
PAIRS = [
    ("The sky is blue.", "The sky is green."),
    ("The sky is blue.", "The sky is black."),
    ("Q: colour?\nA: blue", "Q: colour?\nB: green"),
    ("Say it:  yes", "Say it:  no"),
    ("TL;DR: the end.", "TL;DR: the end. Or not."),
    ("Résumé — café au lait", "Résumé — café noir"),
    ([user("What color is the sky?"), assistant("It is blue.")], [user("What color is the sky?"), assistant("Green.")]),
    (
        [user("Hi"), assistant("Hello!"), user("Sky?"), assistant("Blue.")],
        [user("Hi"), assistant("Hello!"), user("Sky?"), assistant("Green.")],
    ),
]


def main() -> None:
    import trl
    from trl.data_utils import extract_prompt

    cases = [{"chosen": c, "rejected": r, "trl": extract_prompt({"chosen": c, "rejected": r})} for c, r in PAIRS]
    OUT.write_text(json.dumps({"trl_version": trl.__version__, "cases": cases}, indent=1, ensure_ascii=False) + "\n")
    print(f"{OUT}: {len(cases)} cases from TRL {trl.__version__}")


if __name__ == "__main__":
    main()
