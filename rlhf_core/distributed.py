"""Data parallelism with ``torch.distributed``: which rank this process is, its share of a global
batch, and sums across ranks.

A stage launched by ``torchrun --nproc_per_node=N`` (which sets ``RANK``, ``WORLD_SIZE`` and the
rendezvous variables) calls :func:`init_from_env`; every rank then computes gradients on its
own contiguous share of each global batch, normalised by quantities summed over all ranks
(token counts, pair counts), and :func:`all_reduce_gradients` sums the gradients, so each
optimiser step equals the single-process step on the whole global batch (up to the order of
floating-point sums). Without ``torchrun`` everything here is the identity: one rank, no
communication.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


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


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient over all ranks, in place (no-op on one rank).

    Each rank must have normalised its loss by the global count (e.g. the global batch's
    token count), so the sum is the gradient of the global mean.
    """
    if world().size == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
