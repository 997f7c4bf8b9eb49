"""Saved models: a stage's model directory loaded and saved (atomically), dropout off.

Every model the project builds or loads goes through :func:`disable_dropout` (Huang et
al. 2024, Detail 7). Base models and tokenizers are read from their sources by
:mod:`rlhf_core.models.base`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..common.io import atomic_directory

log = logging.getLogger(__name__)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def disable_dropout(model: nn.Module) -> nn.Module:
    """Turn every dropout in ``model`` off, in place (Huang et al. 2024, Detail 7).

    Sets ``p = 0`` on ``nn.Dropout`` modules, and zeroes float attributes whose name
    contains ``dropout`` on every module and on ``model.config`` (Llama-style attention
    reads ``self.attention_dropout`` in its forward pass). PPO's ratio is then exactly 1
    on the first epoch, and two forward passes in train mode give identical logits.

    Returns:
        ``model`` itself.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for name, value in list(vars(config).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)
    return model


def save_pretrained_atomic(
    model: PreTrainedModel, path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase | None = None
) -> Path:
    """``save_pretrained`` of ``model`` (and ``tokenizer``) into ``path``, replacing it atomically."""
    with atomic_directory(path, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(path)


def load_causal_lm(path: str | os.PathLike, dtype: str = "float32") -> PreTrainedModel:
    """Load a causal LM saved by :func:`import_base_model` (or any ``save_pretrained`` dir), dropout off."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    return disable_dropout(model)
