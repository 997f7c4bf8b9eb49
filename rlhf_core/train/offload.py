"""Frozen models kept in CPU memory between their forward passes (Huang et al. 2024, Detail 8).

Detail 8 (arXiv 2403.17031): "for 6.9B PPO training we also offload the reference policy and
reward model to CPU", there with DeepSpeed's parameter offload.

A frozen model's weights are needed on the accelerator only while it runs a forward pass: PPO's
reference policy for the rollout's reference log-probabilities, its reward model for the
scores, DPO's reference for each micro-batch's reference log-probabilities. Between those
passes, during generation and the optimiser's update, they can live in host memory, which
frees their bytes (4 a parameter in float32) for the trained models' gradients, optimiser state
and activations. During a pass only one transformer block at a time need be on the device.

Two mechanisms, one per placement of the frozen model:

- whole on each rank (one process, ``ddp``, ``zero2``; DPO's reference always):
  :class:`CPUOffload`, which streams the blocks to the device one at a time, from pinned host
  memory where CUDA is available;
- sharded (``fsdp``): FSDP2's own ``CPUOffloadPolicy`` (:class:`rlhf_core.train.distributed.DataParallel`),
  which keeps each rank's shards on the CPU and copies a block's shards to the device for its
  all-gather.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def is_frozen(model: nn.Module) -> bool:
    """Whether no parameter of ``model`` requires a gradient."""
    return not any(p.requires_grad for p in model.parameters())


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model`` (a Hugging Face model, or a module holding one): the
    instances of the classes its ``_no_split_modules`` name, which hold nearly all the
    parameters. They are what FSDP2 shards one by one (:mod:`rlhf_core.train.distributed`) and what
    :class:`CPUOffload` streams to the device one at a time. Empty for a model that names none."""
    classes = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in model.modules() if type(m).__name__ in classes]


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every distinct parameter and buffer of ``module`` (``named_*`` skip a tied one's repeats)."""
    return [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]


class CPUOffload:
    """A frozen model whose parameters and buffers live in CPU memory, streamed to ``device``
    for its forward passes (Detail 8's offload of a model that is not sharded).

    The CPU tensors are made once, pinned (page-locked) where CUDA is available so that each
    copy to the GPU is asynchronous (``non_blocking``) and ordered before the kernels that read
    it on the same stream. Between uses every parameter's and buffer's ``data`` is its CPU
    tensor. A use (:meth:`inference`) copies the tensors outside the transformer blocks
    (:func:`transformer_blocks`: embeddings, final norm, output head) to ``device`` for its
    duration, and each block's tensors for that block's forward pass only (forward hooks): at
    most one block is on the device at a time. :meth:`gathered` copies everything for a block of
    several uses (an evaluation's generations, where every token passes through every block).
    Copies are dropped as soon as they are done with (the CUDA caching allocator reuses their
    memory); a copy is a real one on a CPU ``device`` too, so the model runs the same way
    everywhere, and on a CPU-only machine it saves nothing. Tied parameters (one
    ``nn.Parameter`` used twice) stay tied: each parameter object is copied once.

    Its :meth:`inference` and :meth:`gathered` are those of a frozen model's
    :class:`rlhf_core.train.distributed.DataParallel`, which holds one of these when offloading; run
    the model through them, not directly.

    Args:
        model: a frozen model (no parameter requires a gradient), on any device; it is moved
            to the CPU here.
        device: where its forward passes run.

    Raises:
        ValueError: a parameter of ``model`` requires a gradient (a trained model's
            parameters must stay where its optimiser updates them).
    """

    def __init__(self, model: nn.Module, device: torch.device | str):
        if not is_frozen(model):
            raise ValueError(
                f"only a frozen model is offloaded to the CPU: {type(model).__name__} has parameters that require a gradient"
            )
        self.model, self.device = model, torch.device(device)
        model.to("cpu")
        pin = torch.cuda.is_available()
        self.host: dict[torch.Tensor, torch.Tensor] = {}  # each tensor's CPU copy (by identity)
        for tensor in _tensors(model):
            tensor.data = tensor.data.pin_memory() if pin else tensor.data
            self.host[tensor] = tensor.data
        blocks = transformer_blocks(model)
        self._blocks = [_tensors(block) for block in blocks]
        in_blocks = {id(t) for group in self._blocks for t in group}
        self._resident = [t for t in _tensors(model) if id(t) not in in_blocks]  # on the device for a whole use
        for block, group in zip(blocks, self._blocks):
            block.register_forward_pre_hook(lambda _module, _args, group=group: self._stream_in(group))
            block.register_forward_hook(lambda _module, _args, _output, group=group: self._stream_out(group))
        self._uses = 0  # nested inference/gathered
        self._whole = False  # inside gathered: every block stays on the device

    def _copy(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            tensor.data = self.host[tensor].to(self.device, non_blocking=True, copy=True)

    def _release(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            tensor.data = self.host[tensor]

    def _stream_in(self, group: list[torch.Tensor]) -> None:
        if not self._whole:
            self._copy(group)

    def _stream_out(self, group: list[torch.Tensor]) -> None:
        if not self._whole:
            self._release(group)

    @contextmanager
    def _use(self, whole: bool) -> Iterator[nn.Module]:
        outermost, promote = self._uses == 0, whole and not self._whole
        self._uses += 1
        try:  # the copies too: one that runs out of device memory part way leaves none behind
            if outermost:
                self._copy(self._resident)
            if promote:
                self._whole = True
                self._copy([t for group in self._blocks for t in group])
            yield self.model
        finally:
            self._uses -= 1
            if promote:
                self._whole = False
                self._release([t for group in self._blocks for t in group])
            if outermost:  # every block too: one whose forward pass raised kept its copy
                self._release(self._resident + [t for group in self._blocks for t in group])

    def inference(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(model, *args, **kwargs)`` with the model's tensors outside its blocks on
        ``device`` and each block streamed there for its forward pass (a forward pass whose
        output is not backpropagated). Back on the CPU tensors after it, also when ``fn``
        raises."""
        with self._use(whole=False) as model:
            return fn(model, *args, **kwargs)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """The whole model on ``device`` for the duration: :meth:`inference` inside copies
        nothing. Back on the CPU tensors after it, also when the body raises."""
        with self._use(whole=True):
            yield
