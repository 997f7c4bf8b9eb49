"""A tokenizer's BOS/EOS/UNK/PAD agree with its source: a GGUF file's metadata, or a hub or local
source's ``generation_config.json`` and ``config.json``; a stale GGUF conversion is never reused."""

import json
import logging
import shutil

import huggingface_hub.constants
import pytest
import transformers
from transformers import AutoTokenizer

from rlhf_core.common.errors import ModelSourceError
from rlhf_core.common.io import file_sha256
from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ModelConfig
from rlhf_core.models.base import import_base_model
from rlhf_core.models.saved import load_causal_lm
from rlhf_core.models.sources import GGUF_CONVERSION, gguf_cache_dir, resolve_source, source_fingerprint
from rlhf_core.models.tokenizers import gguf_special_tokens, load_tokenizer
from rlhf_core.run.pipeline import stage_key
from tests.conftest import LLAMA_TOKENIZER, SMOL_GGUF, tiny_random_init

TINY = tiny_random_init(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
)
SMOL = ModelConfig(base=SMOL_GGUF)


@pytest.fixture
def smol_converted(smol_tokenizer):
    """The pytest run's cache's converted SmolLM2 tokenizer directory (before the project's PAD)."""
    return gguf_cache_dir(resolve_source(SMOL_GGUF)) / "tokenizer"


@pytest.fixture
def real_from_pretrained(monkeypatch, tmp_path):
    """``AutoTokenizer.from_pretrained`` itself; the cache is this test's own, so a fault injected
    into the conversion is seen by it alone."""
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    return AutoTokenizer.from_pretrained


def _special(tok) -> dict:
    return {role: (getattr(tok, f"{role}_token"), getattr(tok, f"{role}_token_id")) for role in ("bos", "eos", "unk")}


def test_gguf_metadata_names_the_special_tokens(smol_tokenizer):
    special = gguf_special_tokens(resolve_source(SMOL_GGUF))
    assert special == {
        "bos": {"id": 1, "token": "<|im_start|>"},
        "eos": {"id": 2, "token": "<|im_end|>"},
        "unk": {"id": 0, "token": "<|endoftext|>"},
        "pad": {"id": 2, "token": "<|im_end|>"},
    }
    assert _special(smol_tokenizer) == {
        "bos": ("<|im_start|>", 1),
        "eos": ("<|im_end|>", 2),
        "unk": ("<|endoftext|>", 0),
    }
    # the GGUF pads with EOS; the project's own PAD replaces it
    assert smol_tokenizer.pad_token == "[PAD]" and smol_tokenizer.pad_token_id == 49152


def test_the_gguf_cache_and_the_stage_keys_name_the_conversion_scheme(monkeypatch):
    src = resolve_source(SMOL_GGUF)
    unversioned = f"{src.gguf_path.stem}-{file_sha256(src.gguf_path)[:16]}"
    assert gguf_cache_dir(src).name == f"{unversioned}-v{GGUF_CONVERSION}"
    assert source_fingerprint(SMOL_GGUF)["gguf_conversion"] == GGUF_CONVERSION
    cfg = load_config("smoke", [f"model.tokenizer={SMOL_GGUF}"])  # a tokenizer read from the GGUF file
    before = {name: stage_key(name, cfg, []) for name in ("data", "base_model")}
    monkeypatch.setattr("rlhf_core.models.sources.GGUF_CONVERSION", GGUF_CONVERSION + 1)
    assert gguf_cache_dir(src).name == f"{unversioned}-v{GGUF_CONVERSION + 1}"
    for name, key in before.items():
        assert stage_key(name, cfg, []) != key, name


@pytest.mark.heavy
def test_a_stale_gguf_tokenizer_cache_is_converted_again(monkeypatch, tmp_path, smol_converted, caplog):
    """A cached tokenizer with the wrong EOS, in the unversioned directory of earlier conversions
    and in the current one, is never used: the current one is checked and converted again."""
    stale = AutoTokenizer.from_pretrained(smol_converted)
    stale.eos_token = "<|im_start|>"  # what the conversion of transformers 5.17 cached
    assert stale.eos_token_id == 1
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path))
    src = resolve_source(SMOL_GGUF)
    stale.save_pretrained(tmp_path / "gguf" / f"{src.gguf_path.stem}-{file_sha256(src.gguf_path)[:16]}" / "tokenizer")
    current = gguf_cache_dir(src) / "tokenizer"
    stale.save_pretrained(current)
    with caplog.at_level(logging.WARNING, logger="rlhf_core.models.tokenizers"):
        tok = load_tokenizer(SMOL)
    assert _special(tok)["eos"] == ("<|im_end|>", 2)
    assert tok.pad_token_id not in (None, tok.eos_token_id)
    assert f"cached tokenizer {current}: its EOS is '<|im_start|>' (id 1)" in caplog.text
    assert AutoTokenizer.from_pretrained(current).eos_token_id == 2  # the cache itself is repaired


@pytest.mark.heavy
def test_a_wrong_eos_from_the_conversion_is_set_from_the_gguf_metadata(
    real_from_pretrained, monkeypatch, tmp_path, caplog
):
    """The fault transformers 5.17 makes (a Llama-type GGUF's BOS as its EOS, no PAD) is corrected;
    the model config that import_base_model writes has the metadata's EOS."""

    def eos_as_bos(*args, **kwargs):
        tok = real_from_pretrained(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tok.eos_token = tok.bos_token
            tok.pad_token = None
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", eos_as_bos)
    with caplog.at_level(logging.WARNING, logger="rlhf_core.models.tokenizers"):
        tok = load_tokenizer(SMOL)
    assert _special(tok) == {"bos": ("<|im_start|>", 1), "eos": ("<|im_end|>", 2), "unk": ("<|endoftext|>", 0)}
    assert tok.pad_token == "[PAD]"
    assert f"transformers {transformers.__version__} converts a tokenizer whose EOS is '<|im_start|>' (id 1)" in (
        caplog.text
    )
    cached = AutoTokenizer.from_pretrained(gguf_cache_dir(resolve_source(SMOL_GGUF)) / "tokenizer")
    assert (cached.eos_token_id, cached.pad_token_id) == (2, 2)  # the GGUF's own PAD is cached
    info = import_base_model(ModelConfig(tokenizer=SMOL_GGUF, random_init=TINY), tmp_path / "base")
    assert info["eos_token_id"] == 2 and info["pad_token_id"] == 49152
    model = load_causal_lm(tmp_path / "base")
    assert model.config.eos_token_id == 2 and model.generation_config.eos_token_id == 2


def test_a_conversion_that_cannot_agree_with_the_gguf_metadata_is_refused(real_from_pretrained, monkeypatch):
    """A converted vocabulary without the metadata's tokens at their ids cannot be set right."""
    llama = resolve_source(LLAMA_TOKENIZER).location

    def other_vocabulary(*args, **kwargs):
        return real_from_pretrained(llama) if kwargs.get("gguf_file") else real_from_pretrained(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", other_vocabulary)
    with pytest.raises(ModelSourceError) as err:
        load_tokenizer(SMOL)
    message = str(err.value)
    assert f"the tokenizer transformers {transformers.__version__} converts cannot be made to agree" in message
    assert (
        "EOS is '<|end_of_text|>' (id 128001) where the GGUF metadata (tokenizer.ggml.eos_token_id) names "
        "'<|im_end|>' (id 2), and the converted vocabulary has '#' at that id"
    ) in message
    assert not (gguf_cache_dir(resolve_source(SMOL_GGUF)) / "tokenizer").exists()  # nothing cached


def _local_source(path, **files):
    """A directory with Llama 3.2's tokenizer files (EOS ``<|end_of_text|>``, 128001) and ``files``."""
    shutil.copytree(resolve_source(LLAMA_TOKENIZER).location, path)
    for name, payload in files.items():
        (path / f"{name}.json").write_text(json.dumps(payload))
    return path


def test_a_local_source_whose_config_files_name_another_eos_is_refused(tmp_path):
    eos = 128001  # <|end_of_text|>
    ok = _local_source(tmp_path / "ok", generation_config={"eos_token_id": [128009, eos]})
    assert load_tokenizer(ModelConfig(base=str(ok))).eos_token_id == eos
    bad = _local_source(tmp_path / "bad", generation_config={"eos_token_id": [128008, 128009]})
    with pytest.raises(ModelSourceError) as err:
        load_tokenizer(ModelConfig(base=str(bad)))
    assert str(err.value) == (
        f"{bad / 'generation_config.json'}: eos_token_id names '<|eom_id|>' (id 128008), '<|eot_id|>' (id 128009), "
        "but the tokenizer's EOS is '<|end_of_text|>' (id 128001); a model trained with this tokenizer would end "
        "its text with another token"
    )
    config = _local_source(tmp_path / "config", config={"eos_token_id": 2})
    with pytest.raises(ModelSourceError, match=r"config\.json: eos_token_id names '#' \(id 2\), .*'<\|end_of_text"):
        load_tokenizer(ModelConfig(base=str(config)))
    # a base model read with another source's tokenizer is checked too
    with pytest.raises(ModelSourceError, match=r"generation_config\.json: eos_token_id names '<\|eom_id\|>'"):
        import_base_model(ModelConfig(base=str(bad), tokenizer=str(ok)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_hub_source_is_checked_through_the_hub_cache(tmp_path, monkeypatch):
    """Offline, hub files come from the hub cache (its real layout, read by huggingface_hub); a file
    that neither the cache nor the repository has is not checked."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    commit = "0123456789abcdef0123456789abcdef01234567"

    def hub_repo(name, **files):
        repo = tmp_path / f"models--acme--{name}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        _local_source(repo / "snapshots" / commit, **files)
        return f"acme/{name}"

    # offline, transformers needs the snapshot's config.json; generation_config.json is in neither
    plain = hub_repo("plain", config={"model_type": "llama", "eos_token_id": 128001})
    assert load_tokenizer(ModelConfig(base=plain)).eos_token_id == 128001
    bad = hub_repo(
        "bad", config={"model_type": "llama", "eos_token_id": 128001}, generation_config={"eos_token_id": 128009}
    )
    with pytest.raises(ModelSourceError) as err:
        load_tokenizer(ModelConfig(base=bad))
    assert str(err.value).startswith(
        "acme/bad/generation_config.json: eos_token_id names '<|eot_id|>' (id 128009), "
        "but the tokenizer's EOS is '<|end_of_text|>' (id 128001)"
    )
