import math

import pytest
import torch
from transformers import CompileConfig

from rlhf_core.models.base import build_random_model
from rlhf_core.ppo.algorithm import logprobs_from_logits
from rlhf_core.train.generation import (
    COMPILED_STATIC_CACHE,
    DYNAMIC_CACHE,
    Decoding,
    decode_responses,
    decoding_for,
    ends_with_eos,
    first_true_indices,
    generate,
    last_token_indices,
    summarize,
    trim_left_padding,
    truncate_after_eos,
)
from tests.conftest import tiny_random_init

PAD, EOS = 0, 9
TINY = tiny_random_init()
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
        TINY,
    ).eval()
    a = tok("SUBREDDIT: r/AskReddit\n\nTITLE: a much longer title here\n\nPOST: text\n\nTL;DR:")["input_ids"]
    b = tok("SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: x\n\nTL;DR:")["input_ids"]
    batch = torch.tensor([a, [tok.pad_token_id] * (len(a) - len(b)) + b])
    torch.manual_seed(0)
    padded = generate(model, batch, tok.pad_token_id, 8, temperature=1e-4)
    alone = generate(model, torch.tensor([b]), tok.pad_token_id, 8, temperature=1e-4)
    assert padded.shape == (2, 8)
    assert padded[1].tolist() == alone[0].tolist()


# ---------------------------------------------------------------- static KV cache vs dynamic

TEMPERATURE = 0.7
QUERIES = (
    QUERY,
    "SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: x\n\nTL;DR:",
    "SUBREDDIT: r/tifu\n\nTITLE: a title\n\nPOST: some words\n\nTL;DR:",
)  # 32, 26 and 29 tokens with SmolLM2's tokenizer


def left_padded(tok, texts) -> torch.Tensor:
    """``(len(texts), longest)`` token ids, each row left-padded with PAD."""
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    return torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])


def eos_prone_model(tok):
    """The tiny random model with EOS's logit raised: at ``TEMPERATURE``, EOS with probability
    about 1/3 a step."""
    model = build_random_model(tok, TINY).eval()
    head = torch.nn.Linear(TINY.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = TEMPERATURE * math.log(len(tok) / 2)  # tempered: odds 1 : 2 against the rest
    model.lm_head = head
    return model


def sample_both(model, queries, pad, eos, decodings, seed=3, n=10):
    """``generate`` with each decoding from the same seed: a list of ``(responses, logits)``."""
    outs = []
    for decoding in decodings:
        torch.manual_seed(seed)
        outs.append(
            generate(
                model, queries, pad, n, temperature=TEMPERATURE, eos_token_id=eos, return_logits=True, decoding=decoding
            )
        )
    return outs


def check_stop_behaviour(responses, logits, tok, stop_at_eos):
    """The sample exercises what it is meant to: stops at EOS (rows ending at different steps,
    all before the last, so the zero-padded logits too), or EOS sampled through."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    if stop_at_eos:
        assert truncate_after_eos(responses, eos, pad).equal(responses)
        assert ends_with_eos(responses, eos, pad).all()
        assert len(set(last_token_indices(responses, pad).tolist())) > 1
        assert (logits[:, -1] == 0).all()  # every row stopped before the last step
    else:
        assert (responses == eos).any() and (responses != pad).all()
        assert (logits[:, -1] != 0).any()


@pytest.mark.parametrize("stop_at_eos", [False, True], ids=["sample-through", "stop-at-eos"])
def test_static_cache_samples_what_the_dynamic_cache_samples(smol_tokenizer, stop_at_eos):
    """float32: from the same seed, the static cache (its slots beyond each step masked)
    samples the same tokens from the same logits, for queries of three lengths, left-padded."""
    tok = smol_tokenizer
    model = eos_prone_model(tok)
    queries = left_padded(tok, QUERIES)
    eos = tok.eos_token_id if stop_at_eos else None
    (dyn, dyn_logits), (sta, sta_logits) = sample_both(
        model, queries, tok.pad_token_id, eos, [DYNAMIC_CACHE, Decoding(static_cache=True)]
    )
    check_stop_behaviour(dyn, dyn_logits, tok, stop_at_eos)
    assert sta.shape == dyn.shape == (3, 10) and sta_logits.shape == dyn_logits.shape == (3, 10, len(tok))
    assert sta.tolist() == dyn.tolist()
    torch.testing.assert_close(sta_logits, dyn_logits, rtol=1e-5, atol=1e-5)


def test_one_static_cache_per_decoding_shape_is_kept_across_calls(smol_tokenizer):
    """Calls of one shape (rows, cache length, autocast) decode into the same cache storage,
    emptied between calls, and sample what the dynamic cache samples; another shape, or the
    same under autocast, gets a cache of its own."""
    import rlhf_core.train.generation as generation

    tok = smol_tokenizer
    model = eos_prone_model(tok)
    queries = left_padded(tok, QUERIES)
    static = Decoding(static_cache=True)

    def storage():
        caches = generation._STATIC_CACHES[model]
        return {key: (cache, cache.layers[0].keys.data_ptr()) for key, cache in caches.items()}

    (dyn, _), (first, _) = sample_both(model, queries, tok.pad_token_id, None, [DYNAMIC_CACHE, static])
    kept = storage()  # held here: a cache built anew could not take the old one's memory
    (second, _), (third, _) = sample_both(model, queries, tok.pad_token_id, None, [static, static])
    assert len(kept) == 1 and all(
        storage()[key][0] is cache and storage()[key][1] == ptr for key, (cache, ptr) in kept.items()
    )
    assert first.tolist() == second.tolist() == third.tolist() == dyn.tolist()
    sample_both(model, queries[:2], tok.pad_token_id, None, [static])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sample_both(model, queries, tok.pad_token_id, None, [static])
    assert len(storage()) == 3 and all(storage()[key][0] is cache for key, (cache, _) in kept.items())


def test_a_model_keeps_at_most_max_static_caches_dropping_the_least_recently_used(smol_tokenizer, caplog):
    """With ``max_static_caches`` 2, a third decoding shape drops the cache used longest ago (a
    shape used again since is kept); the log gives the caches' memory and the one dropped."""
    import rlhf_core.train.generation as generation

    tok = smol_tokenizer
    model = eos_prone_model(tok)
    queries = left_padded(tok, QUERIES)
    static = Decoding(static_cache=True, max_static_caches=2)
    with caplog.at_level("INFO", logger="rlhf_core.train.generation"):
        for rows in (3, 2, 3, 1):  # 3 used again after 2: 2 is the least recently used when 1 comes
            sample_both(model, queries[:rows], tok.pad_token_id, None, [static])
    caches = generation._STATIC_CACHES[model]
    assert [key[0] for key in caches] == [3, 1]
    per_row = generation.cache_bytes(caches[next(iter(caches))]) / 3
    assert per_row > 0 and generation.cache_bytes(caches[list(caches)[1]]) == per_row
    length = next(iter(caches))[1]
    assert f"the least recently used, 2 rows of {length} tokens ({2 * per_row / 2**20:.1f} MiB), dropped" in caplog.text
    assert caplog.text.count("generate: a static KV cache for") == 3  # 3, 2 and 1 rows; 3 again was kept
    with pytest.raises(ValueError, match="at least one static cache"):
        generation.static_cache_for(model, 1, length, torch.device("cpu"), keep=0)


@pytest.mark.parametrize("stop_at_eos", [False, True], ids=["sample-through", "stop-at-eos"])
def test_static_cache_under_bf16_autocast_with_float32_weights(smol_tokenizer, stop_at_eos):
    """The PPO rollout's setting: float32 weights under bf16 autocast. The static cache holds
    float32 keys and bfloat16 values (each the dtype first written) and samples what the
    dynamic cache samples; the logits agree to bf16 rounding (attention over the cache's
    masked slots sums in another order)."""
    tok = smol_tokenizer
    model = eos_prone_model(tok)
    queries = left_padded(tok, QUERIES)
    eos = tok.eos_token_id if stop_at_eos else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (dyn, dyn_logits), (sta, sta_logits) = sample_both(
            model, queries, tok.pad_token_id, eos, [DYNAMIC_CACHE, Decoding(static_cache=True)]
        )
    check_stop_behaviour(dyn, dyn_logits, tok, stop_at_eos)
    assert sta_logits.dtype == torch.float32
    assert sta.tolist() == dyn.tolist()
    torch.testing.assert_close(sta_logits, dyn_logits, rtol=1e-2, atol=1e-2)


def test_decoding_is_chosen_by_device():
    """CUDA gets the compiled static cache, anything else the dynamic one; the static cache's
    length is rounded up, so one length serves every query length below it."""
    assert decoding_for(torch.device("cpu")) is DYNAMIC_CACHE and decoding_for("cpu") is DYNAMIC_CACHE
    assert decoding_for(torch.device("cuda", 1)) is COMPILED_STATIC_CACHE
    assert decoding_for("cuda", sharded=True) is DYNAMIC_CACHE  # FSDP2: gathered afresh each rollout
    assert COMPILED_STATIC_CACHE.static_cache and COMPILED_STATIC_CACHE.compile_config.mode == "reduce-overhead"
    assert not DYNAMIC_CACHE.static_cache and DYNAMIC_CACHE.generation_config_kwargs() == {}
    lengths = {COMPILED_STATIC_CACHE.cache_length(q, 53) for q in range(1, 204)}
    assert lengths == {256}
    assert COMPILED_STATIC_CACHE.cache_length(204, 53) == 512


@pytest.mark.heavy
def test_compiled_static_cache_step_is_traced_once_for_every_query_length(smol_tokenizer):
    """The compiled path on the CPU, with a backend that records each graph TorchDynamo
    captures and runs it eagerly (inductor's CPU compile is too slow for a unit test; CUDA
    graphs need CUDA): queries of three lengths, stopping at EOS or not, share one captured
    decoding step, and sample what the dynamic cache samples."""
    tok = smol_tokenizer
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = Decoding(static_cache=True, compile_config=CompileConfig(backend=record, mode=None))
    model = eos_prone_model(tok)
    torch._dynamo.reset()
    try:
        # batches of two, 26, 29 and 32 tokens wide: without a rounded-up cache length each would
        # need a longer cache than the one before, and a new graph
        for texts, eos in (((1, 1), None), ((1, 2), tok.eos_token_id), ((0, 1), None)):
            queries = left_padded(tok, [QUERIES[i] for i in texts])
            (dyn, dyn_logits), (com, com_logits) = sample_both(
                model, queries, tok.pad_token_id, eos, [DYNAMIC_CACHE, compiled]
            )
            assert com.tolist() == dyn.tolist()
            torch.testing.assert_close(com_logits, dyn_logits, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1


def test_a_decoding_step_that_fails_to_compile_falls_back_to_the_dynamic_cache(smol_tokenizer, monkeypatch, caplog):
    """A compiler error never stops a run: the call that hit it samples with the dynamic cache,
    a warning names the error, and later calls no longer try to compile."""
    import rlhf_core.train.generation as generation

    tok = smol_tokenizer
    monkeypatch.setattr(generation, "_compile_failure", [])
    calls = []

    def broken(gm, example_inputs):
        calls.append(gm)
        raise RuntimeError("no kernel for this step")

    compiled = Decoding(static_cache=True, compile_config=CompileConfig(backend=broken, mode=None))
    model = eos_prone_model(tok)
    queries = left_padded(tok, QUERIES)
    torch._dynamo.reset()
    try:
        with caplog.at_level("WARNING", logger="rlhf_core.train.generation"):
            (first, first_logits), (second, _) = sample_both(model, queries, tok.pad_token_id, None, [compiled] * 2)
        (dyn, dyn_logits), _ = sample_both(model, queries, tok.pad_token_id, None, [DYNAMIC_CACHE] * 2)
    finally:
        torch._dynamo.reset()
    assert len(calls) == 1  # tried once, in the first call; the second went straight to the dynamic cache
    assert "no kernel for this step" in caplog.text and "dynamic KV cache" in caplog.text
    assert generation._compile_failure and "no kernel for this step" in generation._compile_failure[0]
    assert first.tolist() == second.tolist() == dyn.tolist()  # from the same seed, the dynamic cache's tokens


@pytest.mark.parametrize("fail_at", [1, 4], ids=["first-step", "fourth-step"])
@pytest.mark.heavy
def test_a_compiled_step_that_fails_when_it_runs_falls_back_with_the_same_tokens(
    smol_tokenizer, monkeypatch, caplog, fail_at
):
    """Errors after compiling (a CUDA graph's recording out of memory, a replay over overwritten
    outputs) fall back too: the compiled step runs, tokens are sampled (the random stream moves
    on), then it raises; the call samples again with the dynamic cache from the random state it
    began with, so its tokens are the dynamic cache's from that seed."""
    import rlhf_core.train.generation as generation

    tok = smol_tokenizer
    monkeypatch.setattr(generation, "_compile_failure", [])
    runs = []

    def fails_on_replay(gm, example_inputs):
        def run(*args):
            runs.append(1)
            if len(runs) == fail_at:
                raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten")
            return gm.forward(*args)

        return run

    compiled = Decoding(static_cache=True, compile_config=CompileConfig(backend=fails_on_replay, mode=None))
    model = eos_prone_model(tok)
    queries = left_padded(tok, QUERIES)
    torch._dynamo.reset()
    try:
        with caplog.at_level("WARNING", logger="rlhf_core.train.generation"):
            (fallen, fallen_logits), (dyn, dyn_logits) = sample_both(
                model, queries, tok.pad_token_id, None, [compiled, DYNAMIC_CACHE]
            )
    finally:
        torch._dynamo.reset()
    assert len(runs) == fail_at and "overwritten" in caplog.text
    assert fallen.tolist() == dyn.tolist()
    torch.testing.assert_close(fallen_logits, dyn_logits, rtol=0, atol=0)


@pytest.mark.heavy
def test_a_model_sharded_by_fsdp2_decodes_with_the_dynamic_cache():
    """A sharded policy is gathered into new memory for each rollout: its model is recognised as
    sharded (one-rank FSDP2 on the CPU, in its own process), a plain model is not."""
    import subprocess
    import sys

    code = """
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from rlhf_core.train.generation import _is_sharded
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
plain = _is_sharded(model)
fully_shard(model[0]); fully_shard(model)
print("SHARDED", plain, _is_sharded(model))
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "SHARDED False True" in out.stdout, out.stderr[-2000:]
