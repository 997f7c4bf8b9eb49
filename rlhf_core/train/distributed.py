"""Data parallelism with ``torch.distributed``: this process's rank, its share of a batch, sums over ranks.

A stage launched by ``torchrun --nproc_per_node=N`` (which sets ``RANK``, ``WORLD_SIZE`` and the
rendezvous variables) calls :func:`init_from_env`; every rank then computes gradients on its
own contiguous share of each global batch, normalised by quantities summed over all ranks
(token counts, pair counts), and :class:`DataParallel` (PyTorch's ``DistributedDataParallel``,
or FSDP2 for the sharded strategies) sums the gradients during the backward pass of each
global batch's last micro-batch, so each optimiser step equals the single-process step on the
whole global batch (up to the order of floating-point sums). Without ``torchrun`` everything
here is the identity: one rank, no communication.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .offload import CPUOffload, is_frozen, transformer_blocks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks: ``rank`` in ``[0, size)``."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, checkpoints and saves."""
        return self.rank == 0


def world() -> World:
    """The current :class:`World` (one rank unless a process group is initialised)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def init_from_env(backend: str | None = None) -> World:
    """Join the process group that ``torchrun`` describes in the environment, once.

    With ``WORLD_SIZE`` unset or 1 nothing happens. The backend defaults to ``nccl`` on GPUs
    and ``gloo`` on CPUs.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return world()


def leave(finished: bool = False) -> None:
    """Leave the process group that :func:`init_from_env` joined; a no-op when none is joined.

    Every rank calls it before its process exits, also after an error: otherwise gloo's worker
    threads outlive the interpreter's teardown and a rank that finished its work can still abort
    with SIGABRT ("terminate called without an active exception", pytorch/pytorch#190489), which
    fails the whole ``torchrun`` job. With ``finished`` (the rank's work done without an error)
    the ranks first meet at a barrier, so that no rank takes its group down while another still
    has work queued on it; after an error there is no collective, so it cannot hang (``torchrun``
    ends the other ranks once this one exits).
    """
    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def shard(indices: Sequence[int], w: World | None = None) -> list[int]:
    """This rank's contiguous share of a global batch's row indices.

    Raises:
        ValueError: the batch does not split evenly over the ranks.
    """
    w = w or world()
    if len(indices) % w.size:
        raise ValueError(f"a global batch of {len(indices)} rows does not split evenly over {w.size} ranks")
    per_rank = len(indices) // w.size
    return list(indices[w.rank * per_rank : (w.rank + 1) * per_rank])


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """``values`` summed element-wise over all ranks (float64); the identity on one rank."""
    if world().size == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


#: Data-parallel strategies: ``ddp`` keeps a full copy of model, gradients and optimiser state
#: on every rank and sums gradients (``DistributedDataParallel``); ``zero2`` shards gradients and
#: optimiser state (parameters are gathered once per forward and kept until the backward, like
#: DeepSpeed ZeRO stage 2); ``fsdp`` also shards the parameters between uses (ZeRO stage 3).
#: Both sharded strategies are PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).
STRATEGIES = ("ddp", "zero2", "fsdp")


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by :class:`DataParallel` (its parameters are DTensors)."""
    return any(_is_dtensor(p) for p in model.parameters())


class _TrainingForward(torch.nn.Module):
    """``fn(module, *args)`` as a module's forward: the stages compute a loss from the backbone
    and the output layer separately (logits only where the loss needs them), so the call that
    ``DistributedDataParallel`` and FSDP2 hook into is the whole loss computation."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(self.module, *args, **kwargs)


def _allreduce_sum_hook(state, bucket):  # noqa: ANN001, ANN202  (DDP checks annotations against its own types)
    """A DDP communication hook: the ``dist.GradBucket``'s gradients summed over the ranks, as a
    ``torch.futures.Future`` of the flat tensor. DDP's default hook divides by the number of
    ranks; the stages' losses are already normalised by counts summed over all ranks, so the
    sum is the gradient of the global mean."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


class DataParallel:
    """One trained model under data parallelism: its training forward passes, and the sum of
    its gradients over the ranks.

    Call ``parallel(fn, *args)`` instead of ``fn(model, *args)`` for every forward pass whose
    loss is backpropagated, and iterate a global batch's micro-batches with
    :meth:`accumulate`; after the backward pass of the last micro-batch every rank holds the
    gradient summed over all ranks (each rank normalises its loss by counts summed over the
    ranks, so the sum is the gradient of the global batch's mean). On one rank nothing is
    wrapped and no process communicates.

    Under ``torchrun``, per ``strategy`` (:data:`STRATEGIES`):

    - ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (bucketed all-reduce overlapping the
      backward pass; a summing communication hook, :func:`_allreduce_sum_hook`), with ``no_sync``
      on every micro-batch but the last.
    - ``zero2``/``fsdp``: ``fully_shard`` on every transformer block (the classes in the Hugging
      Face model's ``_no_split_modules``), which hold nearly all the parameters, and on the
      whole model for the rest (embeddings, final norm, heads; tied input and output embeddings
      stay one parameter). Gradients are reduce-scattered after every micro-batch; the divide
      factor is 1, as above. ``zero2`` keeps each block's gathered weights from its forward to
      its backward; ``fsdp`` frees them in between.

    A frozen model (no parameter requires a gradient: PPO's reference and reward models) is
    left whole on every rank under ``ddp`` and ``zero2``, and sharded under ``fsdp``, its
    parameters freed again after every forward pass. Forward passes without gradients go
    through :meth:`inference`, and through :meth:`gathered` where the ranks run different
    numbers of them. With ``offload`` (Detail 8, :mod:`rlhf_core.train.offload`) a frozen model lives
    in CPU memory between its forward passes and runs on ``device``: a whole one as a
    :class:`rlhf_core.train.offload.CPUOffload` (streamed to ``device`` block by block for each
    :meth:`inference`, copied whole for a :meth:`gathered` block), a sharded one under FSDP2's
    ``CPUOffloadPolicy``.

    Build it before the optimiser: FSDP2 replaces the parameters by their shards, in place.
    ``model`` keeps its parameters (sharded or not), so its state is read and written with
    :func:`model_state` and :func:`load_model_state`.

    Raises:
        ValueError: an unknown strategy, a sharded strategy on a model with no block classes,
            ``offload`` of a model that trains, or ``offload`` without a ``device``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        strategy: str = "ddp",
        offload: bool = False,
        device: torch.device | None = None,
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown data-parallel strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        self.model, self.strategy = model, strategy
        self._forward: torch.nn.Module | None = None
        self._offload: CPUOffload | None = None
        frozen = is_frozen(model)
        if offload and (not frozen or device is None):
            raise ValueError(
                f"offload needs a frozen model and a device (got {'a frozen' if frozen else 'a trained'} "
                f"{type(model).__name__}, device {device})"
            )
        # parameters freed after each forward pass: ZeRO-3, and any sharded frozen model (it has no backward)
        self._reshard_after_forward = strategy == "fsdp"
        if world().size == 1 or (frozen and strategy != "fsdp"):
            if offload:
                self._offload = CPUOffload(model, device)  # type: ignore[arg-type]
            return
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # buffers (rotary frequencies) are constants: no broadcast before each forward
            ddp = DistributedDataParallel(_TrainingForward(model), broadcast_buffers=False)
            ddp.register_comm_hook(None, _allreduce_sum_hook)
            self._forward = ddp
        else:
            self._forward = _fully_shard(model, self._reshard_after_forward, strategy, offload)

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over the ranks (FSDP2)."""
        return self._forward is not None and self.strategy != "ddp"

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(model, *args, **kwargs)``, run as the wrapped model's forward pass."""
        if self._forward is None:
            return fn(self.model, *args, **kwargs)
        return self._forward(fn, *args, **kwargs)

    def accumulate(self, micro_batches: Iterator[Any] | Sequence[Any]) -> Iterator[Any]:
        """Yield each of a global batch's ``micro_batches``; the forward and backward passes run
        in the loop body. Under ``ddp`` every micro-batch but the last runs inside ``no_sync``
        (gradients accumulate locally), and the last one's backward sums the accumulated
        gradients over the ranks. Every rank must run the same number of micro-batches and
        backpropagate each."""
        items = list(micro_batches)
        for i, item in enumerate(items):
            local = self.strategy == "ddp" and self._forward is not None and i < len(items) - 1
            with self._forward.no_sync() if local else nullcontext():  # type: ignore[union-attr]
                yield item

    def inference(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(model, *args, **kwargs)`` for a forward pass whose output is not backpropagated
        (sampling, scoring, the reference's log-probs). A sharded model runs it as one forward
        pass of the sharded whole, which gathers each block's parameters for its forward and
        frees them after it under ``fsdp``: collective, so every rank must make the same calls
        with the same number of block forward passes (inside :meth:`gathered` they need not).
        An unsharded model, DDP's included, runs ``fn`` on the plain model, an offloaded one
        streamed to its device for the call."""
        if self._offload is not None:
            return self._offload.inference(fn, *args, **kwargs)
        if not self.sharded:
            return fn(self.model, *args, **kwargs)
        return self._forward(fn, *args, **kwargs)  # type: ignore[misc]

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter of a sharded model gathered on every rank for the duration and kept
        between forward passes, so that :meth:`inference` inside communicates nothing and the
        ranks may run different numbers of forward passes: generation that stops at EOS,
        evaluation prompts that do not split evenly. Costs the full model's weights on each
        rank while it lasts (as DDP always does). Entering and leaving are collective; for an
        unsharded model a no-op, unless it is offloaded: then it is on its device for the duration."""
        if self._offload is not None:
            with self._offload.gathered():
                yield
            return
        if not self.sharded:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self._forward.modules() if isinstance(m, FSDPModule)]  # type: ignore[union-attr]
        for module in modules:
            module.set_reshard_after_forward(False, recurse=False)
        # gathered inside one forward pass of the whole, which initialises FSDP2's root first
        self._forward(lambda _model: [m.unshard() for m in modules])  # type: ignore[misc]
        try:
            yield
        finally:
            for module in modules:
                module.set_reshard_after_forward(self._reshard_after_forward, recurse=False)
                module.reshard()


def _fully_shard(
    model: torch.nn.Module, reshard_after_forward: bool, strategy: str, offload: bool = False
) -> torch.nn.Module:
    """FSDP2 on ``model``'s transformer blocks and on a :class:`_TrainingForward` around it;
    ``strategy`` names it in the log. With ``offload`` (a frozen model, Detail 8) the shards live
    in CPU memory (FSDP2's ``CPUOffloadPolicy``, pinned where CUDA is available) and are copied
    to the device for each all-gather."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    targets = transformer_blocks(model)
    if not targets:
        raise ValueError(f"{type(model).__name__} names no transformer block class (_no_split_modules) to shard")
    root = _TrainingForward(model)
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for module in [*targets, root]:
        fully_shard(module, reshard_after_forward=reshard_after_forward, offload_policy=policy)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    if world().is_main:
        in_blocks = sum(p.numel() for m in targets for p in m.parameters())
        total = sum(p.numel() for p in model.parameters())
        log.info(
            "%s: %d blocks sharded over %d ranks (%.1f%% of %d parameters; the rest sharded as one group)",
            strategy,
            len(targets),
            world().size,
            100 * in_blocks / total,
            total,
        )
        held = offloaded_modules([*targets, root])
        if held:
            log.info(
                "%s: the shards of %s kept in CPU memory (CPUOffloadPolicy on %d of %d sharded modules)",
                strategy,
                type(model).__name__,
                held,
                len(targets) + 1,
            )
    return root


def offloaded_modules(modules: list[torch.nn.Module]) -> int:
    """How many of ``modules`` (sharded by FSDP2) keep their shards in CPU memory, read from
    each module's own FSDP2 state (its parameter group's offload policy), not from the setting
    that asked for it."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    count = 0
    for module in modules:
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        count += isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy)
    return count


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of ``model``, on the CPU for a sharded one. Collective
    for a sharded model: every rank must call it."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (from :func:`model_state`) into a plain or sharded model."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The full optimiser state of ``model``'s optimiser; collective for a sharded model."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full optimiser state (from :func:`optimizer_state`) into a plain or sharded model's optimiser."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def gather_to_main(model: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
    """A plain model with ``model``'s trained weights on rank 0, for saving and evaluation.

    An unsharded ``model`` is returned as it is (on every rank). A sharded one is gathered
    (collective): rank 0 gets ``build()`` loaded with the full weights, the other ranks ``None``.
    """
    if not is_sharded(model):
        return model
    state = model_state(model)
    if not world().is_main:
        return None
    plain = build()
    plain.load_state_dict(state)
    return plain


def split_range(n: int, w: World | None = None) -> range:
    """This rank's contiguous share of ``n`` items that need not split evenly (evaluation
    prompts): the first ``n % size`` ranks get one more."""
    w = w or world()
    base, extra = divmod(n, w.size)
    start = w.rank * base + min(w.rank, extra)
    return range(start, start + base + (1 if w.rank < extra else 0))


def all_gather_cat(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order, on every rank.

    All ranks must pass tensors of the same shape and dtype (``(rows, ...)``); the result
    is ``(size * rows, ...)`` on ``tensor``'s device. The identity on one rank.
    """
    if world().size == 1:
        return tensor
    sent = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()  # gloo has no bool
    parts = [torch.empty_like(sent) for _ in range(world().size)]
    dist.all_gather(parts, sent)
    return torch.cat(parts).to(tensor.dtype)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` on one rank)."""
    if world().size == 1:
        return [obj]
    out: list[Any] = [None] * world().size
    dist.all_gather_object(out, obj)
    return out
