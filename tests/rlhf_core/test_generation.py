import math

import torch

from rlhf_core.config import RandomInitConfig
from rlhf_core.generation import (
    decode_responses,
    ends_with_eos,
    first_true_indices,
    generate,
    last_token_indices,
    summarize,
    trim_left_padding,
    truncate_after_eos,
)
from rlhf_core.models import build_random_model
from rlhf_core.ppo import logprobs_from_logits

PAD, EOS = 0, 9
TINY = RandomInitConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
QUERY = "SUBREDDIT: r/AskReddit\n\nTITLE: a much longer title here\n\nPOST: text\n\nTL;DR:"


def test_first_true_indices():
    bools = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    assert first_true_indices(bools).tolist() == [1, 3, 0]


def test_truncate_after_eos_fills_pad_after_the_first_eos():
    responses = torch.tensor([[5, 9, 6, 9, 7], [5, 6, 7, 8, 4], [9, 1, 2, 3, 4]])
    out = truncate_after_eos(responses, EOS, PAD)
    assert out.tolist() == [[5, 9, 0, 0, 0], [5, 6, 7, 8, 4], [9, 0, 0, 0, 0]]
    assert responses[0].tolist() == [5, 9, 6, 9, 7]  # input untouched


def test_the_reward_index_must_hold_an_eos_for_a_response_to_count_as_ended():
    """Detail 12: the score is read before the first PAD; Detail 23: only an EOS there counts."""
    responses = torch.tensor(
        [
            [5, 9, 0, 0],  # EOS, then PAD
            [5, 6, 7, 8],  # no EOS, no PAD: read at the last token
            [0, 5, 9, 0],  # PAD first
            [5, 0, 9, 0],  # PAD before the EOS
            [9, 0, 0, 0],  # EOS first
        ]
    )
    assert last_token_indices(responses, PAD).tolist() == [1, 3, -1, 0, 0]
    assert ends_with_eos(responses, EOS, PAD).tolist() == [True, False, False, False, True]


def test_generation_never_samples_pad(smol_tokenizer):
    """A model that puts all but ~1e-9 of its mass on PAD still never samples it, and the
    log-probabilities of what it samples are those of its distribution without PAD."""
    tok = smol_tokenizer
    model = build_random_model(tok, TINY).eval()
    head = torch.nn.Linear(TINY.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[tok.pad_token_id] = 30.0
    model.lm_head = head
    queries = torch.tensor([tok(QUERY)["input_ids"]] * 3)
    torch.manual_seed(0)
    responses, logits = generate(model, queries, tok.pad_token_id, 6, temperature=1.0, return_logits=True)
    assert (logits.argmax(-1) == tok.pad_token_id).all()  # PAD is the model's top choice everywhere
    assert (responses != tok.pad_token_id).all()
    # every other token has logit 0: uniform over the len(tok) - 1 tokens that can be sampled
    logprobs = logprobs_from_logits(logits, responses, 1.0, tok.pad_token_id)
    torch.testing.assert_close(logprobs, torch.full_like(logprobs, -math.log(len(tok) - 1)))
    summaries = summarize(model, tok, queries, 6, temperature=1.0, batch_size=2, seed=0)
    assert (summaries.responses[:, 0] != tok.pad_token_id).all()


def test_summaries_record_eos_and_length(smol_tokenizer):
    tok = smol_tokenizer
    model = build_random_model(tok, TINY).eval()
    head = torch.nn.Linear(TINY.hidden_size, len(tok), bias=True)
    with torch.no_grad():  # near-zero logits, and EOS with probability about 0.1 at each step
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = math.log(len(tok) / 9)
    model.lm_head = head
    queries = torch.tensor([tok(QUERY)["input_ids"]] * 16)
    out = summarize(model, tok, queries, 8, temperature=1.0, batch_size=4, seed=1)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert out.responses.shape == (16, 8) and len(out.texts) == 16
    assert truncate_after_eos(out.responses, eos, pad).equal(out.responses)  # PAD after the first EOS
    assert out.has_eos.tolist() == [eos in row for row in out.responses.tolist()]
    assert 0 < int(out.has_eos.sum()) < 16  # both kinds present
    assert out.lengths.tolist() == [int((row != pad).sum()) for row in out.responses]


def test_trim_left_padding_keeps_every_real_token():
    q = torch.tensor([[0, 0, 0, 1, 2], [0, 3, 4, 5, 6]])
    assert trim_left_padding(q, PAD).tolist() == [[0, 0, 1, 2], [3, 4, 5, 6]]


def test_decode_responses_cuts_at_eos(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok(" my summary", add_special_tokens=False)["input_ids"]
    row = ids + [tok.eos_token_id] + tok(" junk after", add_special_tokens=False)["input_ids"]
    assert decode_responses(tok, torch.tensor([row]), tok.eos_token_id, tok.pad_token_id) == ["my summary"]


def test_left_padded_generation_matches_unpadded(smol_tokenizer):
    """Position ids follow the attention mask: left padding does not change what is generated."""
    tok = smol_tokenizer
    model = build_random_model(
        tok,
        RandomInitConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        ),
    ).eval()
    a = tok("SUBREDDIT: r/AskReddit\n\nTITLE: a much longer title here\n\nPOST: text\n\nTL;DR:")["input_ids"]
    b = tok("SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: x\n\nTL;DR:")["input_ids"]
    batch = torch.tensor([a, [tok.pad_token_id] * (len(a) - len(b)) + b])
    torch.manual_seed(0)
    padded = generate(model, batch, tok.pad_token_id, 8, temperature=1e-4)
    alone = generate(model, torch.tensor([b]), tok.pad_token_id, 8, temperature=1e-4)
    assert padded.shape == (2, 8)
    assert padded[1].tolist() == alone[0].tolist()
