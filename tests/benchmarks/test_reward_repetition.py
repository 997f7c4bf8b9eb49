"""benchmarks/reward_repetition.py: the variants of a summary it scores, and that their scores and
differences are the reward model's own (smoke preset)."""

import json

import pytest
import torch

from benchmarks.reward_repetition import VARIANTS, measure, variant_ids
from rlhf_core.data.prepared import load_data_tokenizer, load_prepared
from rlhf_core.train.reward import ScalarModel, score_responses

SUMMARY = "my cat ate my homework"
REFERENCE = "the cat ate it"


def test_each_variant_is_the_summary_once_twice_looped_or_the_reference(smoke_stages):
    tok = load_data_tokenizer(smoke_stages / "data")
    eos, pad = tok.eos_token_id, tok.pad_token_id
    once = tok(SUMMARY, add_special_tokens=False).input_ids
    length = 2 * len(once) + 3
    twice = tok(SUMMARY + " " + SUMMARY, add_special_tokens=False).input_ids
    reference = tok(REFERENCE, add_special_tokens=False).input_ids
    assert 2 * len(once) + 1 <= length < 3 * len(once)  # "twice" fits; the loop is cut mid-summary

    def padded(ids):
        return ids + [pad] * (length - len(ids))

    assert variant_ids(tok, SUMMARY, REFERENCE, "once", length) == padded(once + [eos])
    assert variant_ids(tok, SUMMARY, REFERENCE, "twice", length) == padded(twice + [eos])
    assert variant_ids(tok, SUMMARY, REFERENCE, "reference", length) == padded(reference + [eos])
    loop = variant_ids(tok, SUMMARY, REFERENCE, "loop", length)
    assert loop == (once * 3)[:length] and eos not in loop and pad not in loop
    # a variant longer than the response length keeps its EOS as the last token
    assert variant_ids(tok, SUMMARY, REFERENCE, "twice", len(once) + 2) == (twice[: len(once) + 1] + [eos])
    with pytest.raises(ValueError, match="unknown variant"):
        variant_ids(tok, SUMMARY, REFERENCE, "thrice", length)


def test_scores_are_the_reward_models_raw_outputs_paired_by_prompt(smoke_stages, tmp_path):
    data = smoke_stages / "data"
    tok = load_data_tokenizer(data)
    sft, _, stats = load_prepared(data)
    samples = tmp_path / "samples.jsonl"
    rows = [
        {"sft": SUMMARY, "reference": REFERENCE},
        {"sft": "", "reference": REFERENCE},  # skipped: no summary
        {"sft": "a short one", "reference": "another reference"},
    ]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = measure(data, smoke_stages / "rm", samples)
    length = stats["padded_lengths"]["sft_response"]
    assert out["n"] == 2 and out["response_length"] == length
    queries = torch.tensor(sft["validation"].select([0, 2])["query_token"])
    model = ScalarModel.from_pretrained(str(smoke_stages / "rm")).eval()
    for variant in VARIANTS:
        responses = torch.tensor(
            [variant_ids(tok, r["sft"], r["reference"], variant, length) for r in (rows[0], rows[2])]
        )
        expected = score_responses(model, queries, responses, tok.pad_token_id, tok.eos_token_id, None, 8, "auto")
        torch.testing.assert_close(torch.tensor(out["raw_scores"][variant]), expected.raw_scores)
    diffs = [a - b for a, b in zip(out["raw_scores"]["loop"], out["raw_scores"]["once"], strict=True)]
    assert out["minus_once"]["loop"]["mean"] == pytest.approx(sum(diffs) / 2)
    assert out["minus_once"]["loop"]["share_higher"] == sum(d > 0 for d in diffs) / 2
    assert "once" not in out["minus_once"]
