import torch

from rlhf_core.config import RandomInitConfig
from rlhf_core.generation import decode_responses, first_true_indices, generate, trim_left_padding, truncate_after_eos
from rlhf_core.models import build_random_model

PAD, EOS = 0, 9


def test_first_true_indices():
    bools = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    assert first_true_indices(bools).tolist() == [1, 3, 0]


def test_truncate_after_eos_fills_pad_after_the_first_eos():
    responses = torch.tensor([[5, 9, 6, 9, 7], [5, 6, 7, 8, 4], [9, 1, 2, 3, 4]])
    out = truncate_after_eos(responses, EOS, PAD)
    assert out.tolist() == [[5, 9, 0, 0, 0], [5, 6, 7, 8, 4], [9, 0, 0, 0, 0]]
    assert responses[0].tolist() == [5, 9, 6, 9, 7]  # input untouched


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
    model = build_random_model(tok, RandomInitConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    a = tok("SUBREDDIT: r/AskReddit\n\nTITLE: a much longer title here\n\nPOST: text\n\nTL;DR:")["input_ids"]
    b = tok("SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: x\n\nTL;DR:")["input_ids"]
    batch = torch.tensor([a, [tok.pad_token_id] * (len(a) - len(b)) + b])
    torch.manual_seed(0)
    padded = generate(model, batch, tok.pad_token_id, 8, temperature=1e-4)
    alone = generate(model, torch.tensor([b]), tok.pad_token_id, 8, temperature=1e-4)
    assert padded.shape == (2, 8)
    assert padded[1].tolist() == alone[0].tolist()
