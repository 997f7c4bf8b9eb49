"""Rule rewards and the ``ppo.reward`` spec: format checks, imports, inputs and outputs."""

import pytest
import torch

from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError
from rlhf_core.train import rule_rewards as rr


def test_words_keep_contractions_and_drop_punctuation():
    assert rr.words("I'm fine, thanks -- don’t ask! 42x") == ["i'm", "fine", "thanks", "don't", "ask", "42x"]
    assert rr.words("  ...  ") == []


@pytest.mark.parametrize("n_words, score", [(12, 0.0), (6, -0.5), (24, -0.5), (0, -1.0), (1200, -0.99)])
def test_word_count_score_is_relative_to_the_larger_count(n_words, score):
    assert rr.word_count_score(n_words, 12) == pytest.approx(score)


def test_word_count_reward_never_scores_below_the_non_eos_penalty():
    default_penalty = load_config().ppo.non_eos_penalty
    texts = ["", "one", "word " * 12, "word " * 500]
    scores = rr.word_count_12(["q"] * 4, texts, [[1]] * 4, [[1]] * 4)
    assert scores[2] == 0.0
    assert min(scores) >= default_penalty
    assert rr.word_count_12.__name__ == "word_count_12"
    with pytest.raises(ValueError, match="positive"):
        rr.word_count_score(3, 0)


def test_no_first_person_counts_pronouns_and_contractions():
    scores = rr.no_first_person(
        ["q"] * 4, ["I think my cat hates me", "The cat hates the dog", "We're done.", ""], [[1]] * 4, [[1]] * 4
    )
    assert scores == pytest.approx([-3 / 6, 0.0, -1 / 2, -1.0])


def test_non_repeating_tokens_counts_immediate_repeats_only():
    ids = [[5, 5, 5, 7], [5, 7, 5, 7], [9], []]
    assert rr.non_repeating_tokens([""] * 4, [""] * 4, [[1]] * 4, ids) == pytest.approx([1 / 3, 1.0, 1.0, 1.0])
    assert rr.repeat_share([3, 3]) == 1.0


def test_reward_inputs_decode_up_to_the_first_eos_without_pad(smol_tokenizer):
    tok = smol_tokenizer
    pad, eos = tok.pad_token_id, tok.eos_token_id
    query = tok.encode("TITLE: cats\n\nTL;DR:")
    body = tok.encode(" My cat hates me")
    queries = torch.tensor([[pad, pad] + query, [pad, pad] + query])
    responses = torch.tensor([body + [eos, pad, pad], body + [eos, 17, 18]])  # after EOS: ignored
    q_texts, r_texts, q_ids, r_ids = rr.reward_inputs(tok, queries, responses, pad, eos)
    assert q_ids == [query, query] and r_ids == [body, body]
    assert q_texts == ["TITLE: cats\n\nTL;DR:"] * 2
    assert r_texts == ["My cat hates me"] * 2
    no_eos = rr.reward_inputs(tok, queries[:1], torch.tensor([body + [17]]), pad, eos)
    assert no_eos[3] == [body + [17]]


def test_rule_scores_check_the_function_output(smol_tokenizer):
    tok = smol_tokenizer
    queries, responses = torch.tensor([[1, 2], [1, 3]]), torch.tensor([[4, 4], [4, 5]])
    spec = "python:rlhf_core.train.rule_rewards:non_repeating_tokens"
    scores = rr.rule_scores(rr.non_repeating_tokens, spec, tok, queries, responses, tok.pad_token_id, tok.eos_token_id)
    assert scores.dtype == torch.float32 and scores.tolist() == [0.0, 1.0]
    as_tensor = rr.rule_scores(
        lambda *a: torch.tensor([1, 2], dtype=torch.float64),
        spec,
        tok,
        queries,
        responses,
        tok.pad_token_id,
        tok.eos_token_id,
    )
    assert as_tensor.dtype == torch.float32 and as_tensor.tolist() == [1.0, 2.0]
    with pytest.raises(rr.RewardSpecError, match=r"ppo.reward 'python:.*non_repeating_tokens'.* 2 floats"):
        rr.rule_scores(lambda *a: [1.0], spec, tok, queries, responses, tok.pad_token_id, tok.eos_token_id)
    with pytest.raises(rr.RewardSpecError, match="2 floats"):
        rr.rule_scores(lambda *a: ["good", "bad"], spec, tok, queries, responses, tok.pad_token_id, tok.eos_token_id)


@pytest.mark.parametrize(
    "spec",
    [
        "python:rlhf_core.train.rule_rewards:word_count_12",
        "python:rlhf_core.train.rule_rewards:no_first_person",
        "python:rlhf_core.train.rule_rewards:non_repeating_tokens",
    ],
)
def test_shipped_rewards_load_from_their_spec(spec):
    cfg = load_config("smoke", [f"ppo.reward={spec}"])
    fn = rr.load_reward_function(cfg.ppo.reward)
    assert fn is getattr(rr, spec.rsplit(":", 1)[1])
    described = rr.describe_reward(spec, None)
    assert described.startswith(spec + " (") and described.endswith("rule_rewards.py)")
    assert len(rr.reward_code_digest(spec)) == 16


def test_model_spec_loads_no_function(tmp_path):
    assert rr.load_reward_function("model") is None
    assert rr.reward_code_digest("model") is None
    assert rr.describe_reward("model", tmp_path) == f"model:{tmp_path.resolve()}"


@pytest.mark.parametrize(
    "spec",
    [
        "modle",
        "python::f",
        "python:rlhf_core.train.rule_rewards",
        "python:a b:f",
        "python:rlhf_core.train.rule_rewards:word_count_12:x",
        "rlhf_core.train.rule_rewards:f",
        "model:a b",
        "model:org/rm@",
    ],
)
def test_malformed_specs_fail_at_config_time(spec):
    with pytest.raises(
        ConfigError, match=r"ppo\.reward: .*'model', 'model:SOURCE\[@REVISION\]' .* or 'python:MODULE:FUNCTION'"
    ):
        load_config("smoke", [f"ppo.reward={spec}"])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("python:no_such_module_here:f", "cannot import module 'no_such_module_here'"),
        ("python:rlhf_core.train.rule_rewards:no_such_function", "has no attribute 'no_such_function'"),
        ("python:rlhf_core.train.rule_rewards:FIRST_PERSON", "is a frozenset, not a function"),
    ],
)
def test_unusable_specs_fail_on_loading_naming_the_spec(spec, message):
    with pytest.raises(rr.RewardSpecError, match=f"ppo.reward '{spec}': .*{message}"):
        rr.load_reward_function(spec)


def test_reward_code_digest_follows_the_module_source(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "my_reward_mod.py"
    module.write_text("def f(q, r, qi, ri):\n    return [0.0] * len(r)\n")
    before = rr.reward_code_digest("python:my_reward_mod:f")
    module.write_text("def f(q, r, qi, ri):\n    return [1.0] * len(r)\n")
    assert rr.reward_code_digest("python:my_reward_mod:f") != before
    with pytest.raises(rr.RewardSpecError, match="cannot find module 'not_there_either'"):
        rr.reward_code_digest("python:not_there_either:f")
