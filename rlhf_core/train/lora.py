"""Low-rank adapters (LoRA) for the trainers' models, through ``peft``.

LoRA (Hu et al. 2021, arXiv 2106.09685) freezes a linear layer's weight ``W`` and trains a
low-rank update beside it: ``W x + alpha / r * B A x``, with ``A`` of shape ``(r, in)`` and
``B`` of shape ``(out, r)``, ``B`` zero at the start, so the adapted model starts equal to the
model it adapts. ``peft`` replaces the layers in place: the model object keeps its class and its
attributes (``model.base_model``, a :class:`rlhf_core.train.reward.ScalarModel`'s ``backbone`` and
``head``), so every function of ``rlhf_core`` runs on it unchanged, and only the adapters (and
a scalar head, trained in full) require gradients. The handle ``peft`` returns
(:class:`peft.PeftModel`) is kept beside the model for what only it does: saving the adapter,
turning the adapters off (a frozen reference without a second copy of the weights, as TRL's
DPO and PPO trainers did), and merging them into the weights, so that a stage saves the plain
``transformers`` checkpoint it saves without adapters.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import peft
import torch
from torch import nn

from ..common.io import atomic_directory
from ..config.settings import LoraConfig


def linear_layer_names(module: nn.Module) -> list[str]:
    """The distinct last parts of the names of ``module``'s ``nn.Linear`` layers, sorted
    (``["down_proj", "gate_proj", "k_proj", ...]`` for a Llama backbone): LoRA's default
    targets."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in module.named_modules() if isinstance(m, nn.Linear) and name})


def add_lora(
    model: nn.Module, cfg: LoraConfig, seed: int, trained_in_full: Sequence[str] = ()
) -> peft.PeftModel | None:
    """Adapt ``model``'s backbone with LoRA in place, as ``cfg`` says; ``None`` when ``cfg.r``
    is 0 (``model`` untouched, every weight trained).

    The adapted layers are ``cfg.target_modules``, by default every linear layer of
    ``model.base_model`` (the backbone: a causal LM's without its language-model head, a
    :class:`rlhf_core.train.reward.ScalarModel`'s without its head). Their weights, and every other
    parameter of ``model`` but the modules named in ``trained_in_full`` (a scalar model's
    ``head``, peft's ``modules_to_save``), stop requiring gradients.

    The adapters' ``A`` matrices are drawn (peft's Kaiming-uniform initialisation) from
    ``seed``, in a forked random state: the same adapters in every process and on every rank,
    and the caller's random stream (PPO's sampling) as it would be without them.

    Args:
        model: a model with ``base_model`` (a ``transformers`` model, a ``ScalarModel``).
        cfg: the trainer section's ``lora`` block.
        seed: the seed of the adapters' initialisation (the trainer section's ``seed``).
        trained_in_full: names of ``model``'s direct submodules trained whole beside the adapters.

    Returns:
        The ``peft.PeftModel`` around ``model`` (for :func:`save_adapter`, :func:`merge_lora`,
        :class:`AdaptersDisabled`), or ``None``.

    Raises:
        ValueError: a name of ``cfg.target_modules`` matches no linear layer of the backbone.
    """
    if cfg.r == 0:
        return None
    available = linear_layer_names(model.base_model)
    targets = list(cfg.target_modules or available)
    missing = sorted(set(targets) - set(available))
    if missing:
        raise ValueError(
            f"lora.target_modules {missing} name no linear layer of the backbone {type(model.base_model).__name__}; "
            f"its linear layers: {available}"
        )
    config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        modules_to_save=list(trained_in_full) or None,
    )
    cuda = list(range(torch.cuda.device_count()))  # torch.manual_seed seeds them all: all restored
    with torch.random.fork_rng(devices=cuda), warnings.catch_warnings():
        # peft reads a property transformers 5 deprecates
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def save_adapter(adapted: peft.PeftModel, path: str | os.PathLike) -> Path:
    """Write the adapter (and the modules trained in full) in peft's format into ``path``,
    replacing it atomically: ``peft.PeftModel.from_pretrained(model, path)`` loads it onto the
    model it was trained from (the stage's input model; for a reward model, the SFT model's
    backbone with any head of the same shape)."""
    with atomic_directory(path, overwrite=True) as tmp:
        adapted.save_pretrained(tmp)
    return Path(path)


def merge_lora(adapted: peft.PeftModel) -> nn.Module:
    """Fold the adapters into their layers' weights and put the plain layers back
    (``peft``'s ``merge_and_unload``): the model ``add_lora`` adapted, again with its own class
    and layer types, computing what the adapted model computed (up to rounding), so that it
    saves as a plain ``transformers`` checkpoint."""
    return adapted.merge_and_unload()


def finish(adapted: peft.PeftModel | None, model: nn.Module, adapter_dir: str | os.PathLike) -> nn.Module:
    """What a stage does with its trained ``model`` before saving it: with adapters (``adapted``,
    from :func:`add_lora` on ``model``), write them to ``adapter_dir`` (:func:`save_adapter`) and
    return the merged model (:func:`merge_lora`); without (``None``), return ``model`` as it is."""
    if adapted is None:
        return model
    save_adapter(adapted, adapter_dir)
    return merge_lora(adapted)


class AdaptersDisabled:
    """An adapted model with its adapters turned off, used where a frozen copy of the model it
    was adapted from would be: PPO's and DPO's reference policy. It runs forward passes
    through the adapted model's :class:`rlhf_core.train.distributed.DataParallel` inside
    ``peft``'s ``disable_adapter()``, so the reference needs no second copy of the weights.

    It offers what those stages call on a frozen model's ``DataParallel``: :meth:`inference`
    and :meth:`gathered`.
    """

    def __init__(self, parallel: Any, adapted: peft.PeftModel):
        self.parallel, self.adapted = parallel, adapted

    def inference(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(model, *args, **kwargs)`` with the adapters off (no gradients are needed of it)."""
        with self.adapted.disable_adapter():
            return self.parallel.inference(fn, *args, **kwargs)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """The adapted model's :meth:`rlhf_core.train.distributed.DataParallel.gathered`."""
        with self.parallel.gathered():
            yield
