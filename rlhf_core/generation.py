"""Sampling responses from left-padded queries, and post-processing them (Details 3, 5, 12, 23).

PAD is never sampled: it marks where a response ends (Details 3, 12), so a sampled PAD would
end a response before its EOS. :func:`generate` removes it from the sampling distribution,
and :func:`rlhf_core.ppo.sampling_logits` removes it from the distribution PPO trains, so the
two are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Index of the first ``True`` in each row; the row length when there is none.

    Args:
        bools: ``(batch, length)`` bool tensor.

    Returns:
        ``(batch,)`` tensor of ``dtype``.
    """
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def trim_left_padding(queries: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Drop the columns of left padding shared by every row of a left-padded batch.

    Args:
        queries: ``(batch, length)`` token ids, left-padded with ``pad_token_id``.

    Returns:
        ``(batch, length - k)`` where ``k`` is the smallest padding count in the batch.
    """
    first_real = first_true_indices(queries != pad_token_id)
    return queries[:, int(first_real.min()) :]


def truncate_after_eos(responses: torch.Tensor, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Keep each response up to and including its first EOS; fill the rest with PAD (Detail 23).

    Args:
        responses: ``(batch, response_length)`` sampled token ids.

    Returns:
        A new ``(batch, response_length)`` tensor; rows without EOS are unchanged.
    """
    eos_index = first_true_indices(responses == eos_token_id)
    positions = torch.arange(responses.size(1), device=responses.device).unsqueeze(0)
    return torch.where(positions > eos_index.unsqueeze(1), torch.full_like(responses, pad_token_id), responses)


def last_token_indices(responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Index of each response's last real token, the one before its first PAD: where the
    reward model's score is read (Detail 12).

    Args:
        responses: ``(batch, response_length)`` token ids, PAD after the end.

    Returns:
        ``(batch,)`` long: ``response_length - 1`` when there is no PAD, ``-1`` when the
        response starts with PAD.
    """
    return first_true_indices(responses == pad_token_id) - 1


def ends_with_eos(responses: torch.Tensor, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Whether each response's last real token (:func:`last_token_indices`) is EOS (Details 12, 23).

    The reward is read at that token, so a response counts as having an EOS only when the
    token there is one: a response without EOS, one that starts with PAD and one with a PAD
    before its EOS are all False.

    Args:
        responses: ``(batch, response_length)`` token ids, PAD after the first EOS
            (:func:`truncate_after_eos`).

    Returns:
        ``(batch,)`` bool.
    """
    last = last_token_indices(responses, pad_token_id).clamp(min=0)  # a response starting with PAD: its PAD
    return torch.gather(responses, 1, last.unsqueeze(1)).squeeze(1) == eos_token_id


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    queries: torch.Tensor,
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int | None = None,
    return_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sample responses for a batch of left-padded queries with the KV cache.

    Sampling is plain temperature sampling (no top-k, no top-p) from the model's
    distribution without PAD: PAD's logit is set to ``-inf`` before sampling, so PAD only
    ever follows a stop (:func:`rlhf_core.ppo.sampling_logits` is the same distribution).
    With ``eos_token_id`` a sequence stops at its EOS and is padded; with ``None`` exactly
    ``max_new_tokens`` tokens are sampled, EOS or not (PPO rollouts, Detail 23). Position
    ids follow the attention mask, so left padding does not shift positions (Detail 14).

    Args:
        queries: ``(batch, query_length)`` token ids, left-padded with ``pad_token_id``.
        return_logits: also return the raw logits of every sampled position (untempered,
            PAD included).

    Returns:
        ``(batch, max_new_tokens)`` response token ids, PAD after a stop; with
        ``return_logits`` also ``(batch, max_new_tokens, vocab)`` float logits.
    """
    attention_mask = (queries != pad_token_id).long()
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        suppress_tokens=[pad_token_id],
        output_logits=return_logits,
        return_dict_in_generate=True,
    )
    # generate() falls back on the model's own EOS when none is given; clear it to sample through.
    saved_eos = model.generation_config.eos_token_id
    if eos_token_id is None:
        model.generation_config.eos_token_id = None
    try:
        # synced_gpus off: transformers turns it on for a sharded model under torch.distributed (every
        # rank then steps until all have stopped); the callers sample from unsharded or gathered
        # parameters (DataParallel.gathered), so the ranks' calls are independent.
        out = model.generate(
            input_ids=queries, attention_mask=attention_mask, generation_config=config, synced_gpus=False
        )
    finally:
        model.generation_config.eos_token_id = saved_eos
    responses = out.sequences[:, queries.size(1) :]
    short = max_new_tokens - responses.size(1)
    if short > 0:
        pad = torch.full((responses.size(0), short), pad_token_id, dtype=responses.dtype, device=responses.device)
        responses = torch.cat([responses, pad], dim=1)
    if not return_logits:
        return responses
    logits = torch.stack(out.logits, dim=1)
    if short > 0:
        logits = torch.cat([logits, logits.new_zeros(logits.size(0), short, logits.size(2))], dim=1)
    return responses, logits


def decode_responses(
    tokenizer: PreTrainedTokenizerBase, responses: torch.Tensor, eos_token_id: int, pad_token_id: int
) -> list[str]:
    """Text of each response up to (not including) its first EOS, stripped of whitespace.

    Args:
        responses: ``(batch, response_length)`` token ids.
    """
    texts = []
    for row in truncate_after_eos(responses, eos_token_id, pad_token_id).tolist():
        ids = [t for t in row if t not in (eos_token_id, pad_token_id)]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True).strip())
    return texts


@dataclass
class Summaries:
    """One policy's summaries of a set of queries.

    Attributes:
        texts: ``n`` decoded summaries (up to their first EOS).
        responses: ``(n, response_length)`` long token ids, PAD after the first EOS.
        has_eos: ``(n,)`` bool, the summary ends with EOS within the response length
            (:func:`ends_with_eos`).
        lengths: ``(n,)`` long, tokens up to and including the last real token (the EOS,
            or all ``response_length`` without one).
    """

    texts: list[str]
    responses: torch.Tensor
    has_eos: torch.Tensor
    lengths: torch.Tensor


@torch.no_grad()
def summarize(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    queries: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    bf16: bool | str = False,
) -> Summaries:
    """Sample one summary per left-padded query, stopping at EOS, in batches of ``batch_size``.

    The SFT stage's, PPO's and the evaluation stage's summaries all come from here. The
    global RNG is seeded with ``seed`` first, so the same call gives the same summaries
    (callers that must not disturb their own RNG stream wrap it in ``torch.random.fork_rng``).

    Args:
        queries: ``(n, query_length)`` long token ids, left-padded (CPU or the model's device).
        max_new_tokens: the response length (the SFT response length of the data, Detail 4).
        bf16: the stage's precision setting (:func:`rlhf_core.training.autocast`).

    Returns:
        :class:`Summaries` with ``(n, max_new_tokens)`` responses, all on the CPU.
    """
    from .training import autocast  # training -> distributed -> ppo imports this module

    device = next(model.parameters()).device
    model.eval()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    texts, rows = [], []
    for start in range(0, len(queries), batch_size):
        q = trim_left_padding(queries[start : start + batch_size], pad).to(device)
        with autocast(device, bf16):
            responses = generate(model, q, pad, max_new_tokens, temperature, eos_token_id=eos)
        responses = truncate_after_eos(responses, eos, pad).cpu()
        rows.append(responses)
        texts += decode_responses(tokenizer, responses, eos, pad)
    responses = torch.cat(rows) if rows else torch.zeros(0, max_new_tokens, dtype=torch.long)
    return Summaries(texts, responses, ends_with_eos(responses, eos, pad), last_token_indices(responses, pad) + 1)
