"""The smoke preset's tokenizer (configs/tokenizers/smoke-bpe-4096): what
tests/data/make_smoke_tokenizer.py makes of the committed rows, and a tokenizer the pipeline can
use on real text it was not trained on."""

from __future__ import annotations

import json

import pytest

from rlhf_core.config.presets import load_config
from rlhf_core.models.tokenizers import load_tokenizer
from tests.conftest import FIXTURE_TLDR, read_jsonl
from tests.data import make_smoke_tokenizer


def test_the_committed_tokenizer_is_what_the_script_makes_of_the_committed_rows(tmp_path):
    made = make_smoke_tokenizer.write(tmp_path / "made")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        committed = make_smoke_tokenizer.OUT / name
        assert json.loads((made / name).read_text()) == json.loads(committed.read_text()), (
            f"{committed} is not what tests/data/make_smoke_tokenizer.py makes: run it again"
        )


def test_the_script_reads_every_committed_row():
    texts = make_smoke_tokenizer.texts()
    for row in read_jsonl(FIXTURE_TLDR / "preference_validation_cnndm.jsonl", limit=3):
        assert row["post"] in texts
    assert read_jsonl(FIXTURE_TLDR / "sft_test.jsonl")[-1]["summary"] in texts


@pytest.mark.heavy
def test_the_smoke_preset_tokenizer_fits_4096_with_its_own_pad_and_reads_unseen_rows(sft_rows):
    cfg = load_config("smoke")
    assert cfg.model.tokenizer == "configs:tokenizers/smoke-bpe-4096"
    tokenizer = load_tokenizer(cfg.model)
    assert len(tokenizer) == make_smoke_tokenizer.VOCAB_SIZE == 4096  # its [PAD] is inside: none added
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|endoftext|>", "[PAD]")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    # Rows beyond the committed ones (the offline folder's, where present): byte-level, so every
    # text round-trips and no token is unknown; and a real vocabulary, far fewer tokens than bytes.
    for row in sft_rows[-20:]:
        text = f"{row['title']}\n\n{row['post']}\n\nTL;DR: {row['summary']} 😀"
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert len(ids) < 0.4 * len(text.encode())
    assert tokenizer(" the")["input_ids"] == [tokenizer.convert_tokens_to_ids("Ġthe")]
