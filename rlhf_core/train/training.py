"""The parts every trainer is built from: device and precision, the AdamW optimiser, activation
checkpointing, batch order, resumable mid-stage checkpoints, and step progress.

:func:`rlhf_core.train.trainer.train_loop` composes them into the SFT, reward-model and DPO loop, and
PPO (:func:`rlhf_core.ppo.trainer.run_ppo`) into its own. Data order is a pure function of the
seed and the epoch (:func:`batch_order`), so a checkpoint needs only the step number to resume
mid-epoch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from ..common.errors import TrainingError  # noqa: F401  (re-exported: TrainingError of this module)
from ..common.io import json_digest
from ..common.tracking import RESUME_METRIC, NullTracker, Tracker
from ..config.presets import flatten
from ..config.settings import TrainerConfig
from .distributed import all_reduce_sum, load_model_state, load_optimizer_state, model_state, optimizer_state, world

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` read once the work queued on ``device`` has finished, so that the
    difference of two readings times the device's work, not only its launch (seconds).

    A GPU runs kernels after the host has queued them; reading the clock without waiting would
    credit one step's tail to the next. ``torch.<device type>.synchronize`` waits (a no-op on
    the CPU, whose work is done when the call returns).
    """
    getattr(torch, device.type).synchronize(device)
    return time.perf_counter()


def wall_clock() -> float:
    """Seconds of ``time.monotonic()``: the clock of the time cadence of mid-stage checkpoints
    (:class:`StepProgress`), which counts minutes of the attempt whatever the device does."""
    return time.monotonic()


#: The ``bf16`` setting of every stage: ``true`` (bf16 autocast), ``false`` (float32) or
#: ``"auto"`` (bf16 autocast where the hardware computes in bf16 natively, :func:`resolve_bf16`).
Precision = bool | Literal["auto"]

#: CPU features with native bf16 arithmetic: AVX512-BF16 dot products, AMX-BF16 tiles.
NATIVE_BF16_CPU_FEATURES = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_features() -> frozenset[str]:
    """Names of the CPU's instruction-set features that are present (lower case, e.g. ``avx512_bf16``).

    From ``torch.cpu.get_capabilities()`` (cpuinfo, the library PyTorch dispatches with); where
    this torch has no such call, from the ``flags`` line of ``/proc/cpuinfo``.
    """
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        return frozenset(k.lower() for k, v in get().items() if v is True)
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matrix products natively: a CUDA device with bf16
    support (compute capability 8.0 or newer), or a CPU with AVX512-BF16 or AMX-BF16.

    Elsewhere bf16 autocast is emulated through float32 and slower than float32 itself.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return any(f in cpu_features() for f in NATIVE_BF16_CPU_FEATURES)
    return False


def resolve_bf16(setting: Precision, device: torch.device) -> bool:
    """A stage's ``bf16`` setting as a decision: ``"auto"`` is :func:`native_bf16` of ``device``.

    Raises:
        ValueError: a setting other than true, false or ``"auto"``.
    """
    if setting == "auto":
        return native_bf16(device)
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"bf16 must be true, false or 'auto', not {setting!r}")


def precision_name(setting: Precision, device: torch.device) -> str:
    """``"bf16-autocast"`` or ``"float32"``: what ``setting`` resolves to on ``device`` (logged per stage)."""
    return "bf16-autocast" if resolve_bf16(setting, device) else "float32"


def autocast(device: torch.device, bf16: Precision) -> contextlib.AbstractContextManager:
    """bf16 autocast on ``device`` when ``bf16`` resolves to true (:func:`resolve_bf16`), else a
    no-op context (float32)."""
    if not resolve_bf16(bf16, device):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@dataclass(frozen=True)
class DeviceTuning:
    """Kernel choices that depend only on the type of device the tensors live on.

    Each one changes how fast a result is computed, never what it is beyond floating-point
    rounding; the CPU's choices are the code's original ones, so CPU results are unchanged bit
    for bit. Read through :func:`device_tuning`, the one place they are picked.

    Attributes:
        fused_adamw: AdamW's fused kernel (torch's ``fused=True``: the whole update of many
            parameters per launch) instead of torch's default implementation (:func:`adamw`).
        head_chunk_bytes: float32 logits per chunk of the chunked language-model head
            (:func:`rlhf_core.train.chunked_head.linear_cross_entropy_sum`,
            :func:`rlhf_core.train.chunked_head.linear_logprobs`): larger chunks are fewer, larger matrix
            products, for more transient memory.
        width_multiple: :func:`rlhf_core.train.forward.causal_forward` rounds its micro-batch width
            up to a multiple of this (capped at the batch's length), so attention kernels that
            build a plan per sequence length (cuDNN's) meet few distinct lengths; 1 keeps the
            width at the longest row.
        group_lengths: a rank's rows of a global batch run shortest first, so that each
            micro-batch holds rows of similar length and pads less (:func:`row_order`); the
            update is the same sum over the same rows, in another order.
    """

    fused_adamw: bool
    head_chunk_bytes: int
    width_multiple: int
    group_lengths: bool = False


#: The CPU's choices (and any device but CUDA's): those the code had before there was a choice.
DEFAULT_TUNING = DeviceTuning(fused_adamw=False, head_chunk_bytes=32 * 2**20, width_multiple=1)
#: CUDA's choices: the fused AdamW kernel, 256 MiB logit chunks, widths rounded to 64 tokens,
#: micro-batches of rows of similar length.
CUDA_TUNING = DeviceTuning(fused_adamw=True, head_chunk_bytes=256 * 2**20, width_multiple=64, group_lengths=True)


def device_tuning(device: torch.device | str) -> DeviceTuning:
    """The :class:`DeviceTuning` of ``device``: :data:`CUDA_TUNING` for a CUDA device,
    :data:`DEFAULT_TUNING` for any other (the CPU)."""
    return CUDA_TUNING if torch.device(device).type == "cuda" else DEFAULT_TUNING


#: AdamW's implementation settings: they choose a kernel, not the update's arithmetic.
_ADAMW_KERNEL_KEYS = ("fused", "foreach")


def adamw(params: Iterable[torch.Tensor], lr: float, eps: float, fused: bool | None = None) -> torch.optim.AdamW:
    """The AdamW optimiser of every trainer, with the kernel its parameters' device calls for.

    ``torch.optim.AdamW(params, lr=lr, eps=eps)`` (its other settings at torch's defaults),
    with ``fused=True`` where :func:`device_tuning` of the parameters' device says so (CUDA:
    torch's fused kernel) and torch's default implementation otherwise. Both compute the same
    update up to floating-point rounding.

    A checkpoint's optimiser state records the kernel that wrote it; loading it
    (``load_state_dict``, :meth:`CheckpointManager.load_latest`) keeps this optimiser's kernel,
    so a run resumed on another kind of device uses that device's kernel.

    Args:
        params: the trained parameters (``requires_grad``), all on one device; a generator is
            consumed.
        lr, eps: AdamW's learning rate and epsilon (the trainer configs' ``learning_rate``,
            ``adam_eps``).
        fused: force the fused kernel on (``True``) or off (``False``) instead of the device's
            choice (``None``).

    Raises:
        ValueError: no parameters (torch's error; ``fused=True`` on parameters the fused kernel
            does not take fails at the first step, with torch's RuntimeError).
    """
    params = list(params)
    if fused is None:
        fused = bool(params) and all(device_tuning(p.device).fused_adamw for p in params)
    optimizer = torch.optim.AdamW(params, lr=lr, eps=eps, **({"fused": True} if fused else {}))
    kernel = [{k: g[k] for k in _ADAMW_KERNEL_KEYS if k in g} for g in optimizer.param_groups]

    def keep_kernel(_optimizer: torch.optim.Optimizer, state: dict) -> dict:
        # the loaded groups replace the optimiser's, kernel settings included; restore this
        # optimiser's before loading, so the state (AdamW's step counts) is placed for its kernel
        groups = [dict(saved, **own) for saved, own in zip(state["param_groups"], kernel)]
        return {**state, "param_groups": groups}

    optimizer.register_load_state_dict_pre_hook(keep_kernel)
    return optimizer


#: ``gradient_checkpointing`` values of the stage configs: off, every decoder layer recomputed
#: in the backward pass, or selective recomputation (:func:`recompute_policy`).
Checkpointing = bool | Literal["selective"]


@functools.cache
def _saved_ops() -> frozenset:
    """The aten ops whose outputs :func:`recompute_policy` keeps (those this torch build has)."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def recompute_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective activation recomputation: keep what is costly to recompute, recompute the rest.

    Inside a checkpointed decoder layer, the outputs of matrix multiplications (the q/k/v,
    output, gate, up and down projections) and of the fused attention kernels are saved in
    the forward pass; every other op (RMSNorm, rotary embeddings, SiLU, products, residual
    sums, dtype casts) is run again in the backward pass from them. Recomputing those costs a
    few memory-bound elementwise passes instead of a second forward pass of the layer (full
    checkpointing); the activations only they would have saved are never held (measured in
    ``benchmarks/README.md``). Gradients are those of the plain forward pass.

    A ``policy_fn`` for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
    (Korthikanti et al. 2022 recompute the cheap part of attention; here it is the
    elementwise part of the whole layer).
    """
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def enable_activation_checkpointing(model: torch.nn.Module, mode: Checkpointing) -> None:
    """Turn on activation checkpointing of every decoder layer of a Hugging Face ``model``.

    ``mode`` is a stage config's ``gradient_checkpointing``: ``False`` leaves the model as it
    is; ``True`` recomputes each layer's forward pass in the backward pass (least memory, about
    a third more compute); ``"selective"`` recomputes only the elementwise ops
    (:func:`recompute_policy`). Either runs ``torch.utils.checkpoint`` non-reentrantly and only
    in training mode, so evaluation and generation keep their KV cache. Applied to
    ``model.base_model`` (the backbone of a causal LM or of a ``ScalarModel``), in place.
    Source: activation checkpointing (Chen et al. 2016; Huang et al. 2024 do not describe it);
    selective recomputation after Korthikanti et al. 2022.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode is False:
        return
    if mode is not True and mode != "selective":
        raise ValueError(f"gradient_checkpointing must be true, false or 'selective', not {mode!r}")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, recompute_policy)
    base = model.base_model
    if hasattr(base, "activation_checkpointing_enable"):  # newer transformers; older ones have only the next
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def accumulation_steps(batch_size: int, micro_batch_size: int, world_size: int = 1) -> int:
    """Micro-batches per rank per optimiser step, keeping the global ``batch_size`` whatever the
    number of ranks. Raises ValueError unless ``micro_batch_size * world_size`` divides ``batch_size``."""
    if batch_size % (micro_batch_size * world_size):
        raise ValueError(
            f"batch_size {batch_size} is not a multiple of micro_batch_size {micro_batch_size} x {world_size} rank(s)"
        )
    return batch_size // (micro_batch_size * world_size)


def batch_order(n_rows: int, batch_size: int, num_epochs: int, seed: int) -> list[list[int]]:
    """Row indices of every global batch, epoch after epoch.

    Each epoch is a fresh permutation drawn from ``seed + epoch``; the incomplete last
    batch of an epoch is dropped (as the reference implementation does). With fewer rows
    than ``batch_size``, each epoch is one batch of all rows.
    """
    order = []
    for epoch in range(num_epochs):
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        if n_rows < batch_size:
            order.append(perm)
            continue
        order += [perm[i * batch_size : (i + 1) * batch_size] for i in range(n_rows // batch_size)]
    return order


def row_order(lengths: torch.Tensor, device: torch.device | str, group: bool | None = None) -> list[int]:
    """The order in which a rank's rows of a global batch run, before
    :func:`micro_batches` cuts it into consecutive micro-batches.

    Shortest first (a stable sort of ``lengths``) where ``group`` is true, by default where
    :func:`device_tuning` of ``device`` says ``group_lengths`` (CUDA): each micro-batch then
    holds rows of similar length, and the padding-free forward pass
    (:func:`rlhf_core.train.forward.causal_forward`) computes few PAD columns. Elsewhere the rows keep
    their order (the CPU's results are those of the order drawn by :func:`batch_order`). The
    stages normalise every loss by counts of the whole global batch, so the update is the same
    sum in either order, up to floating-point rounding.

    Args:
        lengths: ``(n,)`` each row's length in tokens (a pair: its longer row), on the CPU.

    Returns:
        A permutation of ``range(n)``.
    """
    if group is None:
        group = device_tuning(device).group_lengths
    if not group:
        return list(range(len(lengths)))
    return torch.sort(lengths, stable=True).indices.tolist()


def micro_batches(indices: list[int], micro_batch_size: int) -> Iterator[list[int]]:
    """Consecutive slices of ``indices`` of at most ``micro_batch_size`` rows."""
    for i in range(0, len(indices), micro_batch_size):
        yield indices[i : i + micro_batch_size]


def frozen_parameter_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of ``model``'s parameters that do not require a gradient: with
    low-rank adapters (:mod:`rlhf_core.train.lora`), the weights they adapt; none for a model that
    trains every weight."""
    return {
        name
        for name, value in model.state_dict(keep_vars=True).items()
        if isinstance(value, torch.nn.Parameter) and not value.requires_grad
    }


class CheckpointManager:
    """Mid-stage checkpoints under ``root/step-NNNNNN/state.pt``, the newest ``keep`` kept.

    A checkpoint holds the model's state dict without its frozen parameters
    (:func:`frozen_parameter_names`: with adapters, only they and a trained head are saved, and
    the frozen weights come from the stage's input on resume), the optimiser state dict, the
    scheduler state, the torch and Python RNG states, the step, and the stage's config digest;
    only checkpoints with the same digest are resumed. Under ``torchrun`` every rank calls
    :meth:`save` and :meth:`load_latest` (a sharded model's full state is gathered from all
    ranks) and rank 0 alone writes.

    A checkpoint counts once its ``state.pt`` exists: the file is written under a temporary
    name, flushed to disk (``fsync``) and renamed, and only then are older checkpoints removed,
    so a process killed at any point leaves the newest complete checkpoint loadable. A stage
    therefore needs room for ``keep + 1`` checkpoints while one is written (``tasks.stages``'s
    free-space estimate counts them).
    """

    def __init__(self, root: str | os.PathLike, config_digest: str, keep: int = 1):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.root = Path(root)
        self.config_digest = config_digest
        self.keep = keep

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step-*") if (p / "state.pt").is_file())

    def save(self, step: int, model: torch.nn.Module, optimizer, scheduler, extra: dict | None = None) -> Path:
        """Write the checkpoint taken after ``step`` optimiser steps (rank 0 writes; collective),
        then remove all but the newest ``keep`` complete checkpoints.

        Before writing, what an interrupted save left (a partial ``state.pt``, a folder without
        one) is removed; complete checkpoints are removed only after the new one is complete.
        """
        frozen = frozen_parameter_names(model)  # LoRA's base weights: rebuilt, not saved
        model_sd, optimizer_sd = model_state(model), optimizer_state(model, optimizer)
        model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
        target = self.root / f"step-{step:06d}"
        if not world().is_main:
            return target
        state = {
            "step": step,
            "config_digest": self.config_digest,
            "model": model_sd,
            "optimizer": optimizer_sd,
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python_rng": random.getstate(),
            "extra": extra or {},
        }
        self._remove_partial()
        target.mkdir(parents=True, exist_ok=True)
        partial = target / f".state.pt.{os.getpid()}.partial"
        try:
            torch.save(state, partial)
            with open(partial, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(partial, target / "state.pt")  # atomic: replaces a same-step checkpoint whole
        except BaseException:  # a full disk, say: nothing partial is left behind
            partial.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                target.rmdir()  # only when empty: a same-step checkpoint stays
            raise
        # the new checkpoint is complete on disk: only now are older ones removed
        complete = self.checkpoints()
        kept = {target, *complete[-self.keep :]}
        for old in complete:
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)
        return target

    def _remove_partial(self) -> None:
        """Remove what an interrupted save left: checkpoint folders without ``state.pt``, partial
        files inside complete ones, and the temporary folders of earlier versions' saves."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.name.startswith(".step-") and path.name.endswith(".partial") and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.name.startswith("step-") and path.is_dir():
                if not (path / "state.pt").is_file():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    for stray in path.glob(".state.pt.*"):
                        stray.unlink(missing_ok=True)

    def load_latest(self, model: torch.nn.Module, optimizer, scheduler) -> dict | None:
        """Restore the newest checkpoint into ``model``/``optimizer``/``scheduler``.

        Returns:
            ``{"step": int, "extra": dict}``, or ``None`` when there is no checkpoint.

        Raises:
            TrainingError: the checkpoint was written with a different configuration.
        """
        found = self.checkpoints()
        if not found:
            return None
        state = torch.load(found[-1] / "state.pt", map_location="cpu", weights_only=False)
        if state["config_digest"] != self.config_digest:
            raise TrainingError(
                f"checkpoint {found[-1]} was written with a different configuration "
                f"({state['config_digest']} != {self.config_digest}); remove {self.root} or use another output directory"
            )
        frozen = frozen_parameter_names(model)
        if frozen:  # the checkpoint holds what trains; the frozen weights are the model's own
            missing, unexpected = model.load_state_dict(state["model"], strict=False)
            if set(missing) != frozen or unexpected:
                raise TrainingError(
                    f"checkpoint {found[-1]} does not hold this model's trained parameters "
                    f"(missing {sorted(set(missing) - frozen)[:5]}, unexpected {unexpected[:5]})"
                )
        else:
            load_model_state(model, state["model"])
        load_optimizer_state(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        random.setstate(state["python_rng"])
        log.info("resumed from %s (step %d)", found[-1], state["step"])
        return {"step": state["step"], "extra": state["extra"]}


def trainer_checkpoints(
    section: str,
    cfg: TrainerConfig,
    device: torch.device,
    out_dir: str | os.PathLike,
    inputs: list,
    tracker: Tracker,
    extra_params: dict[str, Any] | None = None,
) -> CheckpointManager:
    """Log a trainer's settings and return its checkpoints, the same way for every trainer.

    The settings go to ``tracker`` as ``{section}.{key}`` params with the resolved precision
    (``{section}.precision``) and ``extra_params``; the checkpoints live in
    ``out_dir/checkpoints``, keyed by the settings it reads (less ``cfg.unread_settings()``) and ``inputs`` (JSON-serialisable: the data
    statistics, the input model folders), so a checkpoint written with other settings or
    inputs is never resumed (:meth:`CheckpointManager.load_latest` raises instead); the newest
    ``cfg.keep_checkpoints`` are kept.
    """
    tracker.log_params(
        flatten(cfg, prefix=f"{section}.")  # sft.lora.r, ...
        | {f"{section}.precision": precision_name(cfg.bf16, device)}
        | (extra_params or {})
    )
    unread = set(cfg.unread_settings())
    return CheckpointManager(
        Path(out_dir) / "checkpoints",
        json_digest([cfg.model_dump(mode="json", exclude=unread), *inputs]),
        keep=cfg.keep_checkpoints,
    )


class StepProgress:
    """Progress, checkpoints and failure of a trainer's steps, the same for every trainer.

    A ``tqdm`` bar in a terminal, about 20 log lines a run otherwise, on rank 0 only; each
    step's metrics go to the tracker; mid-stage checkpoints at the cadence of
    :meth:`checkpoint_due` (never after the last step: the stage saves its final state itself);
    on a non-finite value, the last good state is saved before the error is raised.

    Args:
        desc: the stage's name, on the bar, in log lines and in errors (``"sft"``, ``"ppo"``).
        total: steps of the whole run; ``start``: steps already done (a resumed run).
        tracker: where metrics go; ranks other than 0 report nothing.
        save: ``save(done)`` writes the checkpoint taken after ``done`` steps; collective
            under ``torchrun`` (every rank calls it, rank 0 writes).
        checkpoint_every: steps between mid-stage checkpoints; when set, it takes precedence
            over ``checkpoint_every_minutes``.
        checkpoint_root: the checkpoint folder, named in errors.
        unit: what a step is called in log lines and errors (``"step"``, ``"update"``).
        checkpoint_every_minutes: minutes of wall-clock time between mid-stage checkpoints,
            counted from this object's creation (the start of the attempt) or the end of the
            last checkpoint, on rank 0's ``clock``; used when ``checkpoint_every`` is ``None``.
        clock: seconds of a monotonic clock (default :func:`wall_clock`); read on rank 0 only.

    Raises:
        ValueError: neither ``checkpoint_every`` nor ``checkpoint_every_minutes`` is set.
    """

    def __init__(
        self,
        desc: str,
        total: int,
        start: int,
        tracker: Tracker | None,
        save: Callable[[int], object],
        checkpoint_every: int | None,
        checkpoint_root: Path,
        unit: str = "step",
        checkpoint_every_minutes: float | None = None,
        clock: Callable[[], float] | None = None,
    ):
        if checkpoint_every is None and checkpoint_every_minutes is None:
            raise ValueError(f"{desc}: set checkpoint_every or checkpoint_every_minutes; both are None")
        self.desc, self.total, self.unit = desc, total, unit
        self.save, self.checkpoint_every, self.checkpoint_root = save, checkpoint_every, checkpoint_root
        self.checkpoint_seconds = None if checkpoint_every_minutes is None else 60.0 * checkpoint_every_minutes
        w = world()
        self.is_main, self.world_size = w.is_main, w.size
        self.clock = clock or wall_clock
        self.last_checkpoint = self.clock() if self.is_main else 0.0
        self.tracker = (tracker or NullTracker()) if self.is_main else NullTracker()
        self.interactive = sys.stderr.isatty() and self.is_main
        self.bar = tqdm(total=total, initial=start, desc=desc, disable=not self.interactive, dynamic_ncols=True)
        self.log_every = max(1, total // 20)
        if start > 0:
            # steps after `start` that an interrupted attempt reported are done again: readers of
            # the metrics (rlhf_core.common.tracking.read_metrics) let the new records replace them
            self.tracker.log_metrics({RESUME_METRIC: float(start)}, step=start)

    def checkpoint_due(self, done: int) -> bool:
        """Whether a mid-stage checkpoint is due after ``done`` steps; the same answer on every rank.

        Never after the last step. With ``checkpoint_every`` set: when ``done`` is a multiple
        of it (every rank computes the same, no communication). Otherwise: when at least
        ``checkpoint_every_minutes`` have passed on rank 0's clock since the attempt started or
        the last checkpoint ended; under ``torchrun`` rank 0's decision reaches the others
        through a sum over the ranks (:func:`rlhf_core.train.distributed.all_reduce_sum`: rank 0
        adds 1 or 0, the others 0), so that all ranks save together. Collective then: every
        rank calls it after each step.
        """
        if done >= self.total:
            return False
        if self.checkpoint_every is not None:
            return done % self.checkpoint_every == 0
        due = self.is_main and self.clock() - self.last_checkpoint >= self.checkpoint_seconds
        if self.world_size > 1:
            due = all_reduce_sum([1.0 if due else 0.0])[0] > 0
        return due

    def report(self, done: int, metrics: dict[str, float], summary: dict[str, str]) -> None:
        """Report the step that brought the count to ``done``: ``metrics`` to the tracker,
        ``summary`` (short name -> formatted value) to the bar or, every ``total // 20``
        steps and at the end, to the log; then checkpoint if one is due."""
        self.tracker.log_metrics(metrics, step=done)
        self.bar.update(1)
        self.bar.set_postfix(summary)
        if not self.interactive and self.is_main and (done % self.log_every == 0 or done == self.total):
            text = ", ".join(f"{k} {v}" for k, v in summary.items())
            log.info("%s %s %d/%d: %s", self.desc, self.unit, done, self.total, text)
        if self.checkpoint_due(done):
            self.save(done)
            if self.is_main:
                self.last_checkpoint = self.clock()

    def stop(self, problem: str, done: int) -> TrainingError:
        """Save the state after ``done`` good steps (collective) and return the
        :class:`TrainingError` naming ``problem`` and the failing step, for the caller to raise."""
        self.save(done)
        self.close()
        return TrainingError(
            f"{self.desc}: {problem} at {self.unit} {done + 1}; last good state saved in {self.checkpoint_root}"
        )

    def close(self) -> None:
        self.bar.close()
