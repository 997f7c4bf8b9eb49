"""The DPO stage: direct preference optimisation, the paper's RL-free baseline (Appendix A, Detail 19).

Its loss, its implicit reward, and the sequence log-probabilities both are computed from.

DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7) trains the policy on the preference pairs
directly; Huang et al. 2024 (arXiv 2403.17031, Appendix A eq. 4) use the SFT policy as the
frozen reference and compare DPO's implicit reward model with the explicit one (Detail 19,
Figure 6, hyperparameters in Table 6). The loss is TRL's ``sigmoid`` DPO loss:
https://github.com/huggingface/trl/blob/9d58faa767ee18f52217b32b82d75807c8ce404a/trl/trainer/dpo_trainer.py

Log-probabilities are sums over the response tokens only (EOS included: it is not PAD,
Detail 3; the query and PAD excluded), in nats, float32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..common.tracking import Tracker
from ..config.settings import DPOConfig
from ..models.saved import load_causal_lm
from . import lora
from .chunked_head import linear_logprobs
from .distributed import DataParallel, all_reduce_sum, is_sharded
from .forward import causal_forward, pair_forward, pair_layout
from .offload import CPUOffload
from .sft import make_loss_mask
from .trainer import global_means, start_stage
from .training import autocast


def implicit_reward(logps: torch.Tensor, ref_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's reward of a response, ``beta * (log pi(y|x) - log pi_ref(y|x))`` (Appendix A).

    Shapes: ``logps`` ``(batch,)``, ``ref_logps`` ``(batch,)`` -> ``(batch,)``.
    """
    return beta * (logps - ref_logps)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DPO loss of each pair (Appendix A, eq. 4) and the implicit rewards of its responses.

    ``losses = -log sigmoid(r_chosen - r_rejected)`` with ``r = beta * (log pi - log pi_ref)``
    (:func:`implicit_reward`): the reward model's loss (Detail 10) on the implicit rewards.

    Args:
        policy_chosen_logps: ``(batch,)`` float32 summed log-probs of the chosen responses
            under the trained policy (:func:`sequence_logprobs`).
        policy_rejected_logps: ``(batch,)`` the same for the rejected responses.
        ref_chosen_logps: ``(batch,)`` the chosen responses under the frozen reference (SFT).
        ref_rejected_logps: ``(batch,)`` the rejected responses under the reference.
        beta: the KL coefficient (Table 6: 0.05, PPO's ``kl_coef``).

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(batch,)``; the rewards are
        detached (statistics, as in TRL).
    """
    chosen_rewards = implicit_reward(policy_chosen_logps, ref_chosen_logps, beta)
    rejected_rewards = implicit_reward(policy_rejected_logps, ref_rejected_logps, beta)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def sequence_logprobs(
    model: PreTrainedModel, query_responses: torch.Tensor, query_lengths: torch.Tensor, pad_token_id: int
) -> torch.Tensor:
    """``log pi(y|x)``: each row's summed log-probability of its response tokens.

    The backbone runs once over query and response (:func:`~rlhf_core.train.forward.causal_forward`:
    padding invisible); only the hidden states that predict a response token go through the
    language-model head (:func:`~rlhf_core.train.chunked_head.linear_logprobs`). Targets are the tokens
    from position ``query_lengths[i]`` on that are not PAD, so the EOS that ends each response
    counts.

    Args:
        model: a causal LM (``base_model`` and ``get_output_embeddings``).
        query_responses: ``(batch, length)`` token ids, unpadded query then right-padded
            response (the preference rows' ``query_chosen_token``/``query_rejected_token``).
        query_lengths: ``(batch,)`` query lengths (``query_token_len``), each at least 1.

    Returns:
        ``(batch,)`` float32, in nats (0 for a row with no response token).
    """
    hidden = causal_forward(
        lambda ids, mask, pos: (
            model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        ),
        query_responses,
        pad_token_id,
    )
    target_mask = make_loss_mask(query_responses, pad_token_id, query_lengths)[:, 1:]
    head = model.get_output_embeddings()
    logps = linear_logprobs(
        hidden[:, :-1][target_mask], head.weight, query_responses[:, 1:][target_mask], getattr(head, "bias", None)
    )
    rows = torch.arange(query_responses.size(0), device=logps.device)[:, None].expand_as(target_mask)[target_mask]
    return torch.zeros(query_responses.size(0), dtype=torch.float32, device=logps.device).index_add(0, rows, logps)


def pair_logprobs(
    model: PreTrainedModel,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    query_lengths: torch.Tensor,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logprobs` of each pair's chosen and rejected rows, running their shared
    query once.

    A causal model's hidden state at a token depends only on the tokens before it, so a pair's
    common prefix (its query, but for the last query token, whose hidden state predicts the
    first response token) gives both rows the same keys and values. The prefix runs once; each
    row's tokens from there to the one before its EOS then run against that prefix's key/value
    cache, chosen and rejected side by side (:func:`rlhf_core.train.forward.pair_forward`), as
    :func:`rlhf_core.train.reward.pair_scores` does for the reward model. Log-probabilities and
    gradients equal :func:`sequence_logprobs` on ``torch.cat([chosen, rejected])`` up to kernel
    rounding, for a little over half of the backbone's work when responses are short next to
    their queries, as in TL;DR. Rows that are not right-padded, a row with no response token,
    models with activation checkpointing (:func:`rlhf_core.train.training.enable_activation_checkpointing`:
    no cache in training) and models sharded by ZeRO-2/FSDP
    (:func:`rlhf_core.train.distributed.is_sharded`) take the concatenated path instead.

    Args:
        chosen: ``(batch, length)`` query + chosen response (``query_chosen_token``).
        rejected: ``(batch, length)`` the same query + rejected response.
        query_lengths: ``(batch,)`` the shared query's length, each at least 1.

    Returns:
        ``(chosen_logps, rejected_logps)``, each ``(batch,)`` float32, in nats.
    """
    batch, length = chosen.shape
    right_padded, eos, common = pair_layout(chosen, rejected, pad_token_id)
    # every hidden state that predicts a response token is computed in the second pass
    prefix = torch.minimum(common, query_lengths - 1)  # (batch,)
    if (
        not batch
        or int(prefix.max()) == 0
        or not right_padded
        or not bool((eos >= query_lengths[:, None]).all())  # a row without a response token
        or getattr(model.base_model, "gradient_checkpointing", False)
        or is_sharded(model)
    ):
        logps = sequence_logprobs(model, torch.cat([chosen, rejected]), query_lengths.repeat(2), pad_token_id)
        return logps[:batch], logps[batch:]
    # from the end of the prefix to the token before EOS: the positions that predict a response token
    hidden, positions, valid = pair_forward(model.base_model, chosen, rejected, prefix, eos)
    # the hidden state at position p predicts token p + 1: a target from the query's end to EOS
    rows = torch.stack([chosen, rejected], 1).reshape(2 * batch, length)
    target_mask = valid & (positions + 1 >= query_lengths.repeat_interleave(2)[:, None])
    targets = torch.gather(rows, 1, (positions + 1).clamp(max=length - 1))[target_mask]
    head = model.get_output_embeddings()
    logps = linear_logprobs(hidden[target_mask], head.weight, targets, getattr(head, "bias", None))
    row_of = torch.arange(2 * batch, device=chosen.device)[:, None].expand_as(target_mask)[target_mask]
    summed = torch.zeros(2 * batch, dtype=torch.float32, device=chosen.device).index_add(0, row_of, logps)
    summed = summed.view(batch, 2)
    return summed[:, 0], summed[:, 1]


def load_reference(sft_model_dir: str | os.PathLike, device: torch.device | str) -> PreTrainedModel:
    """The frozen reference policy: the SFT model, in eval mode, no parameter requiring a gradient."""
    reference = load_causal_lm(sft_model_dir).to(device).eval()
    reference.requires_grad_(False)
    return reference


def run_dpo(
    cfg: DPOConfig,
    data_dir: str | os.PathLike,
    sft_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
) -> dict[str, float]:
    """Train a policy with DPO on the preference train split, from and against the SFT policy.

    The policy starts as a copy of the SFT model; the reference is another, frozen copy, whose
    log-probabilities are computed per micro-batch without gradients. With ``dpo.lora.r`` above
    0 only low-rank adapters of the policy train (:mod:`rlhf_core.train.lora`), and the reference is
    the policy with its adapters off (no second copy); ``out_dir/adapter`` holds them and
    ``out_dir/model`` is the merged policy. With ``dpo.offload_reference`` the reference copy
    lives in CPU memory and is streamed to the device block by block for each micro-batch
    (Detail 8, :class:`rlhf_core.train.offload.CPUOffload`). Rows are visited in
    :func:`rlhf_core.train.training.batch_order`'s order, the reward model's for equal ``batch_size``,
    ``num_epochs`` and ``seed`` (Detail 19). Under ``torchrun`` each rank takes its share of
    every global batch and the loss is normalised by the pairs of all ranks, as the reward
    model's. Writes ``out_dir/model`` (a causal LM with the tokenizer) and
    ``out_dir/metrics.json``; checkpoints in ``out_dir/checkpoints`` make it resumable.

    Reports per step (Figure 6): ``dpo/loss``, ``dpo/accuracy`` (implicit reward of chosen >
    rejected), ``dpo/rewards/chosen``, ``dpo/rewards/rejected``, ``dpo/rewards/margin``, each the
    global batch's mean.

    Returns:
        Those metrics of the last step, plus ``dpo/steps`` and ``dpo/seconds``.
    """
    stage = start_stage("dpo", cfg, data_dir, out_dir, tracker, metric_prefix="dpo/")
    device, pad_id = stage.device, stage.pad_id
    policy = load_causal_lm(sft_model_dir).to(device)
    adapted = stage.adapt(policy)  # adapters: None unless dpo.lora.r > 0
    # the frozen reference: with adapters, the policy with them off; else a second copy, which
    # dpo.offload_reference keeps in CPU memory between micro-batches
    reference = (
        None if adapted is not None else load_reference(sft_model_dir, "cpu" if cfg.offload_reference else device)
    )
    offloaded = CPUOffload(reference, device) if reference is not None and cfg.offload_reference else None

    def reference_logprobs(parallel: DataParallel, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if adapted is not None:
            return lora.AdaptersDisabled(parallel, adapted).inference(pair_logprobs, *args)
        if offloaded is not None:
            return offloaded.inference(pair_logprobs, *args)
        return pair_logprobs(reference, *args)

    train = stage.pref["train"].with_format(
        "torch", columns=["query_chosen_token", "query_rejected_token", "query_token_len"]
    )

    def step_fn(indices: list[int], parallel: DataParallel) -> dict[str, float]:
        rows = train[indices]
        chosen_all, rejected_all = rows["query_chosen_token"], rows["query_rejected_token"]
        n = int(all_reduce_sum([len(indices)])[0])  # pairs in the global batch, over every rank
        sums = dict.fromkeys(["loss", "accuracy", "rewards/chosen", "rewards/rejected"], 0.0)
        lengths = torch.maximum((chosen_all != pad_id).sum(1), (rejected_all != pad_id).sum(1))
        for mb in stage.micro_batches(parallel, lengths):
            chosen, rejected = chosen_all[mb].to(device), rejected_all[mb].to(device)
            query_lengths = rows["query_token_len"][mb].to(device)
            with torch.no_grad(), stage.autocast():
                ref_chosen, ref_rejected = reference_logprobs(parallel, chosen, rejected, query_lengths, pad_id)
            with stage.autocast():
                chosen_logps, rejected_logps = parallel(pair_logprobs, chosen, rejected, query_lengths, pad_id)
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                chosen_logps, rejected_logps, ref_chosen, ref_rejected, cfg.beta
            )
            (losses.sum() / n).backward()
            sums["loss"] += losses.sum().item()
            sums["accuracy"] += (chosen_rewards > rejected_rewards).float().sum().item()
            sums["rewards/chosen"] += chosen_rewards.sum().item()
            sums["rewards/rejected"] += rejected_rewards.sum().item()
        out = global_means(sums, n, (chosen_all != pad_id).sum().item() + (rejected_all != pad_id).sum().item())
        out["rewards/margin"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    policy, last = stage.train(
        policy, len(train), step_fn, sft_model_dir, lambda: load_causal_lm(sft_model_dir).to(device)
    )
    return stage.finish(policy, adapted, last)  # rank 0 saves


@torch.no_grad()
def score_pairs(
    policy: PreTrainedModel,
    reference: PreTrainedModel,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    query_lengths: torch.Tensor,
    pad_token_id: int,
    beta: float,
    batch_size: int,
    bf16: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards of preference pairs (:func:`implicit_reward`), in batches, without
    gradients: the reward model that a DPO policy defines (Detail 19).

    Args:
        chosen, rejected: ``(n, length)`` query + response token ids of each pair.
        query_lengths: ``(n,)`` the shared query's length.
        bf16: the stage's precision setting (:func:`rlhf_core.train.training.autocast`).

    Returns:
        ``(chosen_rewards, rejected_rewards)``, each ``(n,)`` float32 on the CPU.
    """
    device = next(policy.parameters()).device
    policy.eval()
    out_chosen, out_rejected = [], []
    for start in range(0, len(chosen), batch_size):
        c, r = chosen[start : start + batch_size].to(device), rejected[start : start + batch_size].to(device)
        q = query_lengths[start : start + batch_size].to(device)
        with autocast(device, bf16):
            policy_chosen, policy_rejected = pair_logprobs(policy, c, r, q, pad_token_id)
            ref_chosen, ref_rejected = pair_logprobs(reference, c, r, q, pad_token_id)
        out_chosen.append(implicit_reward(policy_chosen, ref_chosen, beta).cpu())
        out_rejected.append(implicit_reward(policy_rejected, ref_rejected, beta).cpu())
    empty = torch.zeros(0)
    return (torch.cat(out_chosen) if out_chosen else empty), (torch.cat(out_rejected) if out_rejected else empty)
