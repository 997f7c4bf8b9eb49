"""Write ``configs/tokenizers/smoke-bpe-4096/``: the smoke preset's tokenizer, a byte-level BPE of
4,096 tokens trained with ``tokenizers`` on the text of the rows committed in ``tests/data/tldr/``.

    python tests/data/make_smoke_tokenizer.py [OUT]

Byte-level, as GPT-2's and SmolLM2's are, so every text has an encoding and none decodes to an
unknown token. Its special tokens are ``<|endoftext|>`` (EOS and BOS, id 0) and ``[PAD]`` (id 1,
the PAD distinct from EOS that Huang et al. 2024's Detail 3 asks for), inside the 4,096.
The training is deterministic: the same rows give the same file, which
``tests/data/test_smoke_tokenizer.py`` checks against the committed one. The folder sits under
``configs/`` rather than here so that the smoke preset reads it as ``configs:...`` from any
working directory and from the worker image, which holds ``configs/`` and not ``tests/``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ROWS = HERE / "tldr"
OUT = REPO / "configs" / "tokenizers" / "smoke-bpe-4096"
VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
PAD = "[PAD]"


def strings(value: object) -> Iterator[str]:
    """Every string inside a row's JSON value, depth first in key order."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def texts(rows_dir: Path = ROWS) -> list[str]:
    """The distinct strings of every ``*.jsonl`` row in ``rows_dir``, in file and row order."""
    seen: dict[str, None] = {}
    for path in sorted(rows_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            for text in strings(json.loads(line)):
                seen.setdefault(text, None)
    return list(seen)


def train(rows_dir: Path = ROWS) -> Tokenizer:
    """The BPE trained on :func:`texts`, with :data:`EOS` and :data:`PAD` as ids 0 and 1."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(rows_dir), trainer=trainer)
    return tokenizer


def write(out: Path = OUT, rows_dir: Path = ROWS) -> Path:
    """Train and save in the ``save_pretrained`` layout that ``AutoTokenizer`` reads."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train(rows_dir),
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )
    fast.model_max_length = 2048
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
