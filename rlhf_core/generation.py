"""Sampling responses from left-padded queries, and post-processing them (Details 5, 23)."""

from __future__ import annotations

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

    Sampling is plain temperature sampling (no top-k, no top-p). With ``eos_token_id`` a
    sequence stops at its EOS and is padded; with ``None`` exactly ``max_new_tokens``
    tokens are sampled, EOS or not (PPO rollouts, Detail 23). Position ids follow the
    attention mask, so left padding does not shift positions (Detail 14).

    Args:
        queries: ``(batch, query_length)`` token ids, left-padded with ``pad_token_id``.
        return_logits: also return the raw (untempered) logits of every sampled position.

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
        output_logits=return_logits,
        return_dict_in_generate=True,
    )
    # generate() falls back on the model's own EOS when none is given; clear it to sample through.
    saved_eos = model.generation_config.eos_token_id
    if eos_token_id is None:
        model.generation_config.eos_token_id = None
    try:
        out = model.generate(input_ids=queries, attention_mask=attention_mask, generation_config=config)
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
