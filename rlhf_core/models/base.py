"""Base models from their sources: hub ids, local directories and GGUF files shipped in packages
(dequantised once), or a tiny random model; the base model stage (:func:`import_base_model`),
with the tokenizer of :mod:`rlhf_core.models.tokenizers`.

Every tokenizer goes through :func:`ensure_pad_token` (Huang et al. 2024, Detail 3) and every
model through :func:`rlhf_core.models.saved.disable_dropout` (Detail 7).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..common.errors import ModelSourceError
from ..common.io import atomic_directory, write_json_atomic
from ..config.settings import ModelConfig, RandomInitConfig
from .saved import DTYPES, disable_dropout
from .sources import Source, gguf_cache_dir, resolve_source
from .tokenizers import check_source_eos, gguf_special_tokens, load_tokenizer

log = logging.getLogger(__name__)


def gguf_to_safetensors(source: Source) -> Path:
    """Dequantise a GGUF checkpoint once and cache it as a plain safetensors model directory.

    ``transformers`` dequantises GGUF weights on load but refuses to ``save_pretrained``
    such a model, so a plain model is rebuilt from its config and given the state dict.
    Later loads read the cached directory (well under a second for 135M parameters).

    Returns:
        The cached directory (``config.json``, ``model.safetensors``).
    """
    target = gguf_cache_dir(source) / "model"
    if (target / "config.json").is_file():
        return target
    log.info("dequantising %s (once; cached in %s)", source.gguf_path, target)
    gguf_model = AutoModelForCausalLM.from_pretrained(source.location, gguf_file=source.gguf_file, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = str(source.gguf_path)
    special = gguf_special_tokens(source)
    for role in ("bos", "eos"):  # as the tokenizer's (PAD is the project's, set on import)
        if role in special:
            setattr(config, f"{role}_token_id", special[role]["id"])
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k not in getattr(plain, "_tied_weights_keys", {})]
    if missing or unexpected:
        raise ModelSourceError(f"{source.gguf_path}: state dict mismatch (missing {missing}, unexpected {unexpected})")
    if plain.generation_config is not None:
        for role in ("bos", "eos"):
            if role in special:
                setattr(plain.generation_config, f"{role}_token_id", special[role]["id"])
    with contextlib.suppress(FileExistsError), atomic_directory(target) as tmp:
        plain.save_pretrained(tmp)
    return target


def build_random_model(tokenizer: PreTrainedTokenizerBase, cfg: RandomInitConfig) -> PreTrainedModel:
    """A tiny Llama-architecture causal LM with random weights, sized for ``tokenizer``.

    Weights depend only on ``cfg`` (including ``cfg.seed``) and ``len(tokenizer)``.
    Dropout is off.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    return disable_dropout(model)


def import_base_model(cfg: ModelConfig, out_dir: str | os.PathLike, overwrite: bool = False) -> dict:
    """Materialise the base model of ``cfg`` as a plain safetensors directory with its tokenizer.

    Loads from the hub, a local directory or a (cached, dequantised) GGUF file, or
    builds a tiny random model (``cfg.random_init``); grows the embeddings when a PAD
    token was added; turns dropout off; writes ``out_dir`` atomically with
    ``model.safetensors``, ``config.json``, the tokenizer files and ``import.json``.

    Returns:
        A small record: source, kind, parameter count, vocabulary size, PAD/EOS ids and
        the seconds taken.

    Raises:
        ModelSourceError: unresolvable source, or special tokens that disagree with the
            source (:func:`load_tokenizer`, :func:`check_source_eos` for a ``base`` other than
            the tokenizer's source). FileExistsError: ``out_dir`` exists and ``overwrite``
            is false.
    """
    start = time.perf_counter()
    tokenizer = load_tokenizer(cfg)
    if cfg.random_init is not None:
        kind = "random_init"
        model = build_random_model(tokenizer, cfg.random_init)
    else:
        source = resolve_source(cfg.base)  # type: ignore[arg-type]
        kind = source.kind
        if cfg.base != cfg.tokenizer_source:  # else load_tokenizer has checked it
            check_source_eos(tokenizer, source, cfg.revision if source.kind == "hub" else None)
        if source.kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(gguf_to_safetensors(source), dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                source.location, revision=cfg.revision if source.kind == "hub" else None, dtype=torch.float32
            )
    n_embeddings = model.get_input_embeddings().num_embeddings
    if n_embeddings < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    disable_dropout(model)
    model.to(DTYPES[cfg.dtype])
    info = {
        "source": cfg.base if cfg.random_init is None else f"random_init({cfg.tokenizer_source})",
        "kind": kind,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.get_input_embeddings().num_embeddings,
        "tokenizer_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "dtype": cfg.dtype,
    }
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / "import.json", info)  # what was imported; the time is returned, not stored
    return {**info, "seconds": round(time.perf_counter() - start, 3)}
