"""One trainer skeleton: the setup, the optimiser loop and the main rank's finish that the SFT,
reward-model and DPO stages share (PPO its finish).

A stage keeps only what is its own: its model, its loss and step function, its evaluation.
The rest is here, in the order a stage runs it:

1. :func:`start_stage`: the prepared data and tokenizer, the global batch checked against the
   micro-batch and the ranks (:func:`rlhf_core.train.training.accumulation_steps`), the device, the
   tracker; precision is the stage's ``bf16`` on that device (:meth:`TrainerRun.autocast`);
2. :meth:`TrainerRun.adapt`: low-rank adapters (:func:`rlhf_core.train.lora.add_lora`) and activation
   checkpointing (:func:`rlhf_core.train.training.enable_activation_checkpointing`);
3. :meth:`TrainerRun.train`: :func:`train_loop`, whose every optimiser step is the stage's
   ``step_fn`` over one global batch, in the micro-batches of :meth:`TrainerRun.micro_batches`;
4. :meth:`TrainerRun.finish`: on rank 0, the adapters saved and merged and the model saved
   (:func:`save_trained`), the stage's evaluation, and ``metrics.json``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import datasets
import peft
import torch
from transformers import PreTrainedTokenizerBase, get_scheduler

from ..common.io import write_json_atomic
from ..common.tracking import NullTracker, Tracker
from ..config.settings import EpochTrainerConfig
from ..data.prepared import load_data_tokenizer, load_prepared
from ..models.saved import save_pretrained_atomic
from . import lora
from .distributed import DataParallel, World, all_reduce_sum, gather_to_main, shard, world
from .training import (
    StepProgress,
    accumulation_steps,
    adamw,
    autocast,
    batch_order,
    device_clock,
    enable_activation_checkpointing,
    micro_batches,
    pick_device,
    row_order,
    trainer_checkpoints,
)

#: A stage's step: ``step_fn(indices, parallel) -> metrics`` over the rows ``indices`` of one
#: global batch (:func:`train_loop`).
StepFn = Callable[[list[int], DataParallel], dict[str, float]]


@dataclass
class TrainerRun:
    """What a trainer stage shares with the others, set up by :func:`start_stage`, and the
    steps every trainer stage takes with it: :meth:`adapt`, :meth:`train`, :meth:`finish`.

    Attributes:
        name: the stage (``"sft"``, ``"reward"``, ``"dpo"``): the section of its params, its
            progress bar and its errors.
        cfg: the stage's section of the config.
        out_dir: the stage's output folder (created).
        tracker: where params and metrics go (a :class:`~rlhf_core.common.tracking.NullTracker` when
            none was given).
        sft, pref: the prepared SFT and preference splits (:func:`rlhf_core.data.prepared.load_prepared`).
        stats: the data statistics (``stats.json``), part of every checkpoint's key.
        tokenizer: the data's tokenizer, with its PAD token; saved beside the model.
        device: where the stage trains (:func:`rlhf_core.train.training.pick_device`).
        world: this process's rank and the number of ranks.
        metric_prefix: the prefix of the step metrics that are reported and returned
            (``"train/"``; DPO's ``"dpo/"``).
    """

    name: str
    cfg: EpochTrainerConfig
    out_dir: Path
    tracker: Tracker
    sft: datasets.DatasetDict
    pref: datasets.DatasetDict
    stats: dict
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    world: World
    metric_prefix: str = "train/"

    @property
    def pad_id(self) -> int:
        """The tokenizer's PAD id."""
        return self.tokenizer.pad_token_id

    def autocast(self) -> AbstractContextManager:
        """The stage's precision on its device: bf16 autocast or float32
        (:func:`rlhf_core.train.training.autocast` of ``cfg.bf16``)."""
        return autocast(self.device, self.cfg.bf16)

    def adapt(self, model: torch.nn.Module, trained_in_full: Sequence[str] = ()) -> peft.PeftModel | None:
        """Low-rank adapters on ``model`` as ``cfg.lora`` says (:func:`rlhf_core.train.lora.add_lora`,
        seeded by ``cfg.seed``; ``trained_in_full`` names submodules trained whole beside them),
        then activation checkpointing as ``cfg.gradient_checkpointing`` says
        (:func:`rlhf_core.train.training.enable_activation_checkpointing`); both in place.

        Returns:
            The adapted model (``peft.PeftModel``), or ``None`` when ``cfg.lora.r`` is 0.
        """
        adapted = lora.add_lora(model, self.cfg.lora, self.cfg.seed, trained_in_full)
        enable_activation_checkpointing(model, self.cfg.gradient_checkpointing)
        return adapted

    def micro_batches(self, parallel: DataParallel, lengths: torch.Tensor) -> Iterator[list[int]]:
        """This rank's rows of a global batch in micro-batches of ``cfg.micro_batch_size``, in
        the device's order (:func:`rlhf_core.train.training.row_order`: by length on CUDA), each
        yielded inside ``parallel.accumulate`` (gradients summed over the ranks in the last one's
        backward pass).

        Args:
            lengths: ``(n,)`` each row's length in tokens (a pair: its longer row), on the CPU.

        Yields:
            Lists of row positions in ``[0, n)``.
        """
        return parallel.accumulate(micro_batches(row_order(lengths, self.device), self.cfg.micro_batch_size))

    def train(
        self,
        model: torch.nn.Module,
        n_rows: int,
        step_fn: StepFn,
        init_dir: str | os.PathLike,
        rebuild: Callable[[], torch.nn.Module],
    ) -> tuple[torch.nn.Module | None, dict[str, float]]:
        """:func:`train_loop` of this stage over ``n_rows`` training rows: its settings, device,
        output folder, tracker and metric prefix, and checkpoints keyed by the data statistics
        and the model folder ``init_dir`` the stage starts from. ``rebuild()`` builds the
        untrained model on the device (a sharded model is gathered into it).

        Returns:
            :func:`train_loop`'s ``(model, last)``.
        """
        return train_loop(
            desc=self.name,
            model=model,
            n_rows=n_rows,
            optim=self.cfg,
            step_fn=step_fn,
            device=self.device,
            out_dir=self.out_dir,
            inputs=[self.stats, str(Path(init_dir).resolve())],
            rebuild=rebuild,
            tracker=self.tracker,
            metric_prefix=self.metric_prefix,
        )

    def finish(
        self,
        model: torch.nn.Module | None,
        adapted: peft.PeftModel | None,
        last: dict[str, float],
        evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    ) -> dict[str, float]:
        """The main rank's finish: the trained ``model`` saved to ``out_dir/model`` with the
        tokenizer, with adapters (``adapted``) saved to ``out_dir/adapter`` and merged first
        (:func:`save_trained`); then ``evaluate(model)``, when given, on the saved model; then
        ``out_dir/metrics.json``. Other ranks save nothing and return ``{}``.

        Args:
            model, last: what :meth:`train` returned.

        Returns:
            The step metrics of ``last`` under :attr:`metric_prefix`, ``{prefix}steps`` and
            ``{prefix}seconds``, then ``evaluate``'s metrics.
        """
        if not self.world.is_main:
            return {}
        model = save_trained(model, adapted, self.out_dir, tokenizer=self.tokenizer)
        prefix = self.metric_prefix
        metrics = {k: v for k, v in last.items() if k.startswith(prefix)}
        metrics.update({f"{prefix}steps": float(last["steps"]), f"{prefix}seconds": last["seconds"]})
        if evaluate is not None:
            metrics |= evaluate(model)
        write_json_atomic(self.out_dir / "metrics.json", metrics)
        return metrics


def start_stage(
    name: str,
    cfg: EpochTrainerConfig,
    data_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
    metric_prefix: str = "train/",
) -> TrainerRun:
    """Set up the trainer stage ``name``: create ``out_dir``, load the prepared data and its
    tokenizer from ``data_dir``, check the batch sizes against the ranks, pick the device.

    Raises:
        ValueError: ``cfg.micro_batch_size`` times the number of ranks does not divide
            ``cfg.batch_size`` (:func:`rlhf_core.train.training.accumulation_steps`).
        DataError: ``data_dir`` is not a prepared data folder.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sft, pref, stats = load_prepared(data_dir)
    tokenizer = load_data_tokenizer(data_dir)
    w = world()
    accumulation_steps(cfg.batch_size, cfg.micro_batch_size, w.size)
    return TrainerRun(
        name=name,
        cfg=cfg,
        out_dir=out_dir,
        tracker=tracker or NullTracker(),
        sft=sft,
        pref=pref,
        stats=stats,
        tokenizer=tokenizer,
        device=pick_device(),
        world=w,
        metric_prefix=metric_prefix,
    )


def save_trained(
    model: torch.nn.Module,
    adapted: peft.PeftModel | None,
    out_dir: str | os.PathLike,
    name: str = "model",
    adapter: str = "adapter",
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> torch.nn.Module:
    """Save a trained model in eval mode to ``out_dir/name`` (with ``tokenizer`` when given);
    with adapters (``adapted``, from :func:`rlhf_core.train.lora.add_lora` on ``model``), first save
    them to ``out_dir/adapter`` and merge them (:func:`rlhf_core.train.lora.finish`), so that the
    saved model is the merged one.

    Returns:
        The saved model (the merged one with adapters).
    """
    model = lora.finish(adapted, model, Path(out_dir) / adapter).eval()
    save_pretrained_atomic(model, Path(out_dir) / name, tokenizer)
    return model


def global_means(sums: dict[str, float], n: float, tokens: float) -> dict[str, float]:
    """Per-row means over the global batch of sums taken on this rank, and the batch's tokens.

    Collective under ``torchrun``: ``sums`` (the same keys, in the same order, on every rank)
    and ``tokens`` are summed over the ranks (:func:`rlhf_core.train.distributed.all_reduce_sum`).

    Args:
        sums: this rank's sum of each metric over its rows.
        n: the rows of the global batch, all ranks together.
        tokens: this rank's non-pad tokens.

    Returns:
        Each key of ``sums`` divided by ``n``, and ``tokens``: the tokens of every rank.
    """
    names = list(sums)
    totals = all_reduce_sum([sums[k] for k in names] + [tokens])
    out = {k: v / n for k, v in zip(names, totals)}
    out["tokens"] = totals[-1]
    return out


def train_loop(
    *,
    desc: str,
    model: torch.nn.Module,
    n_rows: int,
    optim: EpochTrainerConfig,
    step_fn: StepFn,
    device: torch.device,
    out_dir: str | os.PathLike,
    inputs: list,
    rebuild: Callable[[], torch.nn.Module],
    tracker: Tracker | None = None,
    metric_prefix: str = "train/",
) -> tuple[torch.nn.Module | None, dict[str, float]]:
    """Run (or resume) the optimiser steps of the stage ``desc`` (``"sft"``, ``"reward"``, ``"dpo"``).

    ``step_fn(indices, parallel)`` must run forward and backward over the rows ``indices`` of
    one global batch, each forward pass as ``parallel(fn, *args)`` and the micro-batches
    through ``parallel.accumulate`` (:class:`rlhf_core.train.distributed.DataParallel`), and return
    scalar metrics, including ``loss`` and ``tokens`` (non-pad tokens processed). Under
    ``torchrun`` each rank gets its share of the global batch
    (:func:`rlhf_core.train.distributed.shard`), ``step_fn`` normalises by counts summed over the
    ranks and returns global metrics, and ``parallel`` sums the gradients over the ranks in the
    last micro-batch's backward pass (strategy ``optim.strategy``); rank 0 alone reports and
    checkpoints. This loop zeroes gradients, steps AdamW (:func:`rlhf_core.train.training.adamw`,
    ``eps`` from the config) and the schedule, reports ``{metric_prefix}{name}``, ``lr``,
    ``tokens`` (non-pad tokens of the step), ``tokens_per_s`` (over the step's device time,
    :func:`rlhf_core.train.training.device_clock`) and ``step`` to ``tracker``, shows a progress bar
    in a terminal (log lines otherwise), and checkpoints every ``optim.checkpoint_every`` steps
    or, when that is unset, every ``optim.checkpoint_every_minutes`` minutes
    (:meth:`rlhf_core.train.training.StepProgress.checkpoint_due`), keeping the newest
    ``optim.keep_checkpoints``.

    The settings are logged and the checkpoints kept under ``out_dir/checkpoints``, keyed by
    the settings and ``inputs`` (:func:`rlhf_core.train.training.trainer_checkpoints`). After the last
    step a sharded model is gathered to rank 0 into ``rebuild()``
    (:func:`rlhf_core.train.distributed.gather_to_main`).

    Returns:
        ``(model, metrics)``: the trained model in eval mode (``None`` on ranks other than 0
        when it was sharded; those ranks save nothing) and the metrics of the last step, plus
        ``steps`` and ``seconds``.

    Raises:
        TrainingError: a non-finite loss (after a checkpoint of the last good state was
            written) or an incompatible checkpoint.
    """
    w = world()
    tracker = tracker or NullTracker()
    checkpoints = trainer_checkpoints(desc, optim, device, out_dir, inputs, tracker)
    order = batch_order(n_rows, optim.batch_size, optim.num_epochs, optim.seed)
    parallel = DataParallel(model, optim.strategy)  # before the optimiser: FSDP2 shards the parameters in place
    total = len(order) if optim.max_steps is None else min(len(order), optim.max_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, lr=optim.learning_rate, eps=optim.adam_eps)
    scheduler = get_scheduler(optim.scheduler, optimizer, num_warmup_steps=0, num_training_steps=total)
    resumed = checkpoints.load_latest(model, optimizer, scheduler)
    start = resumed["step"] if resumed else 0
    model.train()
    progress = StepProgress(
        desc,
        total,
        start,
        tracker,
        save=lambda done: checkpoints.save(done, model, optimizer, scheduler),
        checkpoint_every=optim.checkpoint_every,
        checkpoint_root=checkpoints.root,
        checkpoint_every_minutes=optim.checkpoint_every_minutes,
    )
    begin = time.perf_counter()
    last: dict[str, float] = {}
    for step in range(start, total):
        t0 = device_clock(device)
        optimizer.zero_grad(set_to_none=True)
        metrics = step_fn(shard(order[step], w), parallel)  # gradients summed over the ranks
        if not math.isfinite(metrics["loss"]):
            # every rank has the same global loss, so all save together; parameters are the last good ones
            raise progress.stop(f"non-finite loss {metrics['loss']}", step)
        optimizer.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        seconds = device_clock(device) - t0
        last = {f"{metric_prefix}{k}": v for k, v in metrics.items() if k != "tokens"}
        tokens = metrics.get("tokens", 0.0)
        last.update({"lr": lr, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9), "step": step + 1})
        progress.report(
            step + 1,
            last,
            {"loss": f"{metrics['loss']:.4f}", "lr": f"{lr:.3g}", "tok/s": f"{last['tokens_per_s']:.0f}"},
        )
    progress.close()
    last.update({"steps": total, "seconds": time.perf_counter() - begin})
    model = gather_to_main(model, rebuild)  # the full weights, sharded or not
    if model is not None:
        model.eval()
    return model, last
