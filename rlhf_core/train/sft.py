"""Supervised fine-tuning on the TL;DR references, and its ROUGE evaluation (Huang et al. 2024, Detail 9).

Loss: next-token cross-entropy over the query+reference sequence with padding masked
out (the reference implementation's choice), or over the response tokens only
(``sft.loss_on: response``). Gradients of micro-batches are accumulated and normalised
by the number of target tokens in the whole global batch, so the update equals that of
one large batch.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..common.io import write_jsonl_atomic
from ..common.tracking import Tracker
from ..config.settings import SFTConfig
from ..data.prepared import require_prompts
from ..metrics.text import rouge_l
from ..models.saved import load_causal_lm
from .chunked_head import linear_cross_entropy_sum
from .distributed import DataParallel, all_reduce_sum
from .forward import CausalLayout, causal_forward, causal_layout
from .generation import summarize
from .trainer import start_stage

log = logging.getLogger(__name__)


def make_loss_mask(
    input_ids: torch.Tensor, pad_token_id: int, query_lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """Which tokens are SFT targets.

    Args:
        input_ids: ``(batch, length)`` right-padded query+response token ids.
        query_lengths: ``(batch,)`` unpadded query lengths; when given, query tokens are
            not targets (``loss_on: response``).

    Returns:
        ``(batch, length)`` bool, True on non-PAD tokens (and, with ``query_lengths``, only
        from the response on). EOS is a target: it is not PAD (Detail 3).
    """
    mask = input_ids != pad_token_id
    if query_lengths is not None:
        positions = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
        mask &= positions >= query_lengths.to(input_ids.device).unsqueeze(1)
    return mask


def masked_token_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over target tokens, from full logits.

    Position ``t`` of ``logits`` predicts token ``t + 1``; a token counts when
    ``loss_mask`` is True at its own position.

    Args:
        logits: ``(batch, length, vocab)``.
        input_ids: ``(batch, length)``.
        loss_mask: ``(batch, length)`` bool (see :func:`make_loss_mask`).

    Returns:
        ``(loss_sum, n_targets)``: a scalar tensor in nats and the number of target tokens.
    """
    target_mask = loss_mask[:, 1:]
    logits = logits[:, :-1][target_mask].float()
    targets = input_ids[:, 1:][target_mask]
    return F.cross_entropy(logits, targets, reduction="sum"), int(target_mask.sum())


@dataclass(frozen=True)
class SFTBatch:
    """A micro-batch of SFT rows on its device, with what the loss needs to know about it worked out
    beforehand (:func:`sft_batch`): computed from CPU tensors, none of it makes the host wait for
    the device.

    Attributes:
        input_ids: ``(batch, length)`` long token ids, right-padded.
        pad_token_id: the PAD id.
        layout: :func:`rlhf_core.train.forward.causal_layout` of ``input_ids``.
        predict: ``(n_targets,)`` long, ``row * length + t`` for each position ``t`` whose hidden
            state predicts a target (the token at ``t + 1``), in row-major order.
        targets: ``(n_targets,)`` long, those target tokens, in the same order.
        n_targets: the number of target tokens.
    """

    input_ids: torch.Tensor
    pad_token_id: int
    layout: CausalLayout
    predict: torch.Tensor
    targets: torch.Tensor
    n_targets: int


def sft_batch(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, pad_token_id: int, device: torch.device | str | None = None
) -> SFTBatch:
    """An :class:`SFTBatch` on ``device`` from ``input_ids`` and ``loss_mask`` wherever they are.

    The layout, the positions that predict a target, the targets and their count are computed
    where the inputs are; from CPU tensors that costs ``device`` no synchronisation, and the
    tensors are then copied to ``device`` without waiting (``non_blocking``).

    Args:
        input_ids: ``(batch, length)`` right-padded token ids.
        loss_mask: ``(batch, length)`` bool target mask (:func:`make_loss_mask`), on
            ``input_ids``' device.
        device: where the loss is computed (default: ``input_ids``' device).
    """
    device = input_ids.device if device is None else torch.device(device)
    target_mask = loss_mask[:, 1:]
    rows, cols = target_mask.nonzero(as_tuple=True)
    predict = rows * input_ids.size(1) + cols
    return SFTBatch(
        input_ids=input_ids.to(device, non_blocking=True),
        pad_token_id=pad_token_id,
        layout=causal_layout(input_ids, pad_token_id, device),
        predict=predict.to(device, non_blocking=True),
        targets=input_ids[:, 1:][target_mask].to(device, non_blocking=True),
        n_targets=predict.numel(),
    )


def sft_batch_loss_sum(model: PreTrainedModel, batch: SFTBatch) -> torch.Tensor:
    """The summed SFT loss of ``batch`` (:func:`sft_loss_sum`), the host never waiting for the device.

    Returns:
        A float32 scalar on the batch's device: the summed next-token loss in nats.
    """
    hidden = causal_forward(
        lambda ids, mask, pos: (
            model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        ),
        batch.input_ids,
        batch.pad_token_id,
        batch.layout,
    )
    head = model.get_output_embeddings()
    predicting = hidden.flatten(0, 1).index_select(0, batch.predict)  # (n_targets, d_model)
    return linear_cross_entropy_sum(predicting, head.weight, batch.targets, getattr(head, "bias", None))


def sft_loss_sum(
    model: PreTrainedModel, input_ids: torch.Tensor, loss_mask: torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, int]:
    """:func:`masked_token_loss` computed without full-vocabulary logits at non-target positions.

    The backbone runs through :func:`~rlhf_core.train.forward.causal_forward` (no attention mask,
    no PAD columns past the longest row); its hidden states are gathered at the positions
    that predict a target, and only those go through the language-model head
    (:func:`sft_batch` then :func:`sft_batch_loss_sum`, on ``input_ids``' device).

    Args:
        input_ids: ``(batch, length)`` right-padded token ids.
        loss_mask: ``(batch, length)`` bool target mask.

    Returns:
        ``(loss_sum, n_targets)`` as :func:`masked_token_loss`.
    """
    batch = sft_batch(input_ids, loss_mask, pad_token_id)
    return sft_batch_loss_sum(model, batch), batch.n_targets


def run_sft(
    cfg: SFTConfig,
    data_dir: str | os.PathLike,
    base_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
) -> dict[str, float]:
    """Fine-tune the base model on the SFT train split, then compare ROUGE-L of base and SFT.

    Writes ``out_dir/model`` (causal LM + tokenizer, loadable with
    :func:`rlhf_core.models.saved.load_causal_lm`), ``out_dir/samples.jsonl`` and
    ``out_dir/metrics.json``; with ``sft.lora.r`` above 0 only low-rank adapters train
    (:mod:`rlhf_core.train.lora`), ``out_dir/adapter`` holds them and ``out_dir/model`` is the
    merged model; mid-stage checkpoints go to ``out_dir/checkpoints`` and a
    restarted run with the same configuration resumes from the newest one.

    Returns:
        Flat metrics: ``train/loss`` (last step), ``eval/rougeL`` (SFT), ``eval/rougeL_base``,
        ``eval/eos_rate`` and ``eval/eos_rate_base`` (share of summaries ending with EOS
        within the response length), ``eval/response_length`` and
        ``eval/response_length_base`` (mean tokens up to and including the EOS),
        ``eval/samples``, ``train/steps``, ``train/seconds``.

    Raises:
        ValueError: ``micro_batch_size`` does not divide ``batch_size``; TrainingError:
        non-finite loss or a checkpoint from another configuration.
    """
    stage = start_stage("sft", cfg, data_dir, out_dir, tracker)
    require_prompts(stage.stats, cfg.eval_split, "sft.eval_split")  # before training, not after it
    device, pad_id = stage.device, stage.pad_id
    torch.manual_seed(cfg.seed)
    model = load_causal_lm(base_model_dir).to(device)
    adapted = stage.adapt(model)  # adapters: None unless sft.lora.r > 0
    train = stage.sft["train"].with_format("torch", columns=["query_reference_response_token", "query_token_len"])

    def step_fn(indices: list[int], parallel: DataParallel) -> dict[str, float]:
        rows = train[indices]
        input_ids = rows["query_reference_response_token"]
        query_lengths = rows["query_token_len"] if cfg.loss_on == "response" else None
        loss_mask = make_loss_mask(input_ids, pad_id, query_lengths)
        # normalised by the target tokens of the whole global batch, over every rank
        n_targets = int(all_reduce_sum([loss_mask[:, 1:].sum().item()])[0])
        # float64 on the device, summed in Python's order: read once, after the last micro-batch
        total = torch.zeros((), dtype=torch.float64, device=device)
        for mb in stage.micro_batches(parallel, (input_ids != pad_id).sum(1)):
            batch = sft_batch(input_ids[mb], loss_mask[mb], pad_id, device)  # worked out on the host
            with stage.autocast():
                loss_sum = parallel(sft_batch_loss_sum, batch)
            (loss_sum / n_targets).backward()
            total += loss_sum.detach().double()
        total, tokens = all_reduce_sum([total.item(), (input_ids != pad_id).sum().item()])
        return {"loss": total / n_targets, "tokens": tokens}

    def evaluate(model: PreTrainedModel) -> dict[str, float]:
        eval_ds = stage.sft[cfg.eval_split]
        metrics, samples = evaluate_sft(model, base_model_dir, eval_ds, stage.stats, stage.tokenizer, cfg, device)
        write_jsonl_atomic(stage.out_dir / "samples.jsonl", samples)
        stage.tracker.log_metrics(metrics, step=last["steps"])
        stage.tracker.log_table("sft_samples", samples[:32])
        log.info(
            "sft: ROUGE-L %.4f (base %.4f), EOS rate %.2f (base %.2f) on %d %s prompts",
            metrics["eval/rougeL"],
            metrics["eval/rougeL_base"],
            metrics["eval/eos_rate"],
            metrics["eval/eos_rate_base"],
            int(metrics["eval/samples"]),
            cfg.eval_split,
        )
        return metrics

    model, last = stage.train(
        model, len(train), step_fn, base_model_dir, lambda: load_causal_lm(base_model_dir).to(device)
    )
    return stage.finish(model, adapted, last, evaluate)  # rank 0 saves and evaluates


def evaluate_sft(
    model: PreTrainedModel,
    base_model_dir: str | os.PathLike,
    eval_ds,
    stats: dict,
    tokenizer,
    cfg: SFTConfig,
    device: torch.device,
) -> tuple[dict[str, float], list[dict]]:
    """Near-greedy summaries (``sft.eval_temperature``) of the first ``sft.eval_max_samples``
    prompts of ``eval_ds`` by the fine-tuned ``model`` and by the base model, with ROUGE-L
    against the references, EOS rate and length. ``model`` is released before the base model
    is loaded.

    Returns:
        ``(metrics, samples)``: ``eval/rougeL``, ``eval/rougeL_base``, ``eval/eos_rate``,
        ``eval/eos_rate_base``, ``eval/response_length``, ``eval/response_length_base`` (mean
        tokens up to and including the EOS), ``eval/samples``, ``eval/seconds``; one sample dict
        per prompt.
    """
    n_eval = min(len(eval_ds), cfg.eval_max_samples or len(eval_ds))
    eval_ds = eval_ds.select(range(n_eval))
    queries = torch.tensor(eval_ds["query_token"])
    references = [r.strip() for r in eval_ds["reference_response"]]
    max_new = stats["padded_lengths"]["sft_response"]
    t0 = time.perf_counter()
    sft_out = summarize(
        model, tokenizer, queries, max_new, cfg.eval_temperature, cfg.micro_batch_size, cfg.seed, cfg.bf16
    )
    model = None  # free the SFT model before loading the base model
    base = load_causal_lm(base_model_dir).to(device)
    base_out = summarize(
        base, tokenizer, queries, max_new, cfg.eval_temperature, cfg.micro_batch_size, cfg.seed, cfg.bf16
    )
    base = None
    sft_rouge, base_rouge = rouge_l(sft_out.texts, references), rouge_l(base_out.texts, references)
    samples = [
        {
            "post": p,
            "reference": r,
            "base": b,
            "sft": s,
            "rougeL_base": rb,
            "rougeL_sft": rs,
            "has_eos_base": eb,
            "has_eos_sft": es,
            "length_base": lb,
            "length_sft": ls,
        }
        for p, r, b, s, rb, rs, eb, es, lb, ls in zip(
            eval_ds["post"],
            references,
            base_out.texts,
            sft_out.texts,
            base_rouge,
            sft_rouge,
            base_out.has_eos.tolist(),
            sft_out.has_eos.tolist(),
            base_out.lengths.tolist(),
            sft_out.lengths.tolist(),
        )
    ]
    metrics = {
        "eval/rougeL": sum(sft_rouge) / n_eval,
        "eval/rougeL_base": sum(base_rouge) / n_eval,
        "eval/eos_rate": sft_out.has_eos.double().mean().item(),
        "eval/eos_rate_base": base_out.has_eos.double().mean().item(),
        "eval/response_length": sft_out.lengths.double().mean().item(),
        "eval/response_length_base": base_out.lengths.double().mean().item(),
        "eval/samples": float(n_eval),
        "eval/seconds": time.perf_counter() - t0,
    }
    return metrics, samples
