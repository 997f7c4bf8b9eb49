"""The models' forward passes without padding's effects: padding-aware inputs, the causal layout
(queries and responses packed to the left, Detail 14) and the chosen/rejected pair layout that
shares their common prefix, and the forward passes over them; PPO's two, the policy's logits and the
value model's values at the response tokens (:func:`response_logits`, :func:`response_values`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .generation import first_true_indices
from .training import device_tuning


def padding_aware_inputs(
    query_responses: torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention mask and position ids that make left padding invisible (Detail 14).

    Args:
        query_responses: ``(batch, length)`` ids, PAD anywhere (left of the query, right of
            the response).

    Returns:
        ``(input_ids, attention_mask, position_ids)``, each ``(batch, length)``: PAD
        replaced by 0, mask 1 on real tokens, positions counting real tokens from 0.
    """
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return input_ids, attention_mask.long(), position_ids


@dataclass(frozen=True)
class CausalLayout:
    """Where the real tokens of a batch's rows are: what :func:`causal_forward` decides its call from.

    Attributes:
        contiguous: every row is one run of real tokens (PAD only before and after it).
        width: the columns ``fn`` is called with: the longest run (at least 1) rounded up to a
            multiple of ``width_multiple`` and capped at the batch's length.
        start: ``(batch,)`` long, the column of each row's first real token (the length for a
            row of PAD only).
        n_real: ``(batch,)`` long, each row's number of real tokens.
    """

    contiguous: bool
    width: int
    start: torch.Tensor
    n_real: torch.Tensor

    def to(self, device: torch.device | str) -> CausalLayout:
        """The same layout with its tensors on ``device``, copied without waiting for the copy
        (``non_blocking``): from the CPU the copy is queued behind the device's work, in order."""
        return CausalLayout(
            self.contiguous,
            self.width,
            self.start.to(device, non_blocking=True),
            self.n_real.to(device, non_blocking=True),
        )


def causal_layout(
    query_responses: torch.Tensor,
    pad_token_id: int,
    device: torch.device | str | None = None,
    width_multiple: int | None = None,
) -> CausalLayout:
    """The :class:`CausalLayout` of ``query_responses``, for a :func:`causal_forward` on ``device``.

    Reading ``contiguous`` and ``width`` makes the host wait for ``query_responses``' device;
    computed from a CPU copy before the ids move to a GPU, the layout costs the GPU no
    synchronisation, and its tensors are then copied to ``device`` (:meth:`CausalLayout.to`).

    Args:
        query_responses: ``(batch, length)`` token ids, on any device.
        device: where the forward pass runs, and where the returned tensors are
            (default: ``query_responses``' device).
        width_multiple: round the width up to a multiple of this (default: the
            ``width_multiple`` of ``device``, :func:`rlhf_core.train.training.device_tuning`; 1 on the
            CPU, which keeps the longest run's width).

    Raises:
        ValueError: ``width_multiple`` below 1.
    """
    device = query_responses.device if device is None else torch.device(device)
    multiple = device_tuning(device).width_multiple if width_multiple is None else width_multiple
    if multiple < 1:
        raise ValueError(f"width_multiple must be at least 1, not {multiple}")
    real = query_responses != pad_token_id
    length = query_responses.size(1)
    n_real = real.sum(1)
    start = first_true_indices(real)
    positions = torch.arange(length, device=query_responses.device)
    contiguous = bool((real == ((positions >= start[:, None]) & (positions < (start + n_real)[:, None]))).all())
    width = max(int(n_real.max()), 1) if len(n_real) else 1
    width = min(-(-width // multiple) * multiple, length)
    return CausalLayout(contiguous, width, start, n_real).to(device)


def causal_forward(
    fn: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor],
    query_responses: torch.Tensor,
    pad_token_id: int,
    layout: CausalLayout | None = None,
) -> torch.Tensor:
    """``fn(input_ids, attention_mask, position_ids)`` with padding invisible, at the cost of no mask.

    When every row is one contiguous run of real tokens (left-padded query, right-padded
    response: the layout of every batch in this project), each row is rotated so that its
    run starts at position 0, the PAD columns after the longest run are dropped, and ``fn``
    is called with ``attention_mask=None, position_ids=None``: the model then uses its plain
    causal attention (fused SDPA kernels, no ``(batch, 1, length, length)`` mask) and the
    default positions, which equal :func:`padding_aware_inputs`' positions on the rotated
    rows. Outputs are rotated back; at PAD positions they are 0. A row with a PAD between real
    tokens sends the whole batch through the mask of :func:`padding_aware_inputs` instead.
    Real positions get the same values as the masked call (Detail 14), up to kernel rounding.

    The width of the call is the layout's (:func:`causal_layout`): on a device whose
    ``width_multiple`` is above 1 (CUDA) the longest run rounded up, the extra columns token 0
    after every row's run, which causal attention keeps from every real position (their outputs
    are dropped). Pass ``layout``, computed from a CPU copy of the ids, to spare the host the
    wait for the device that deciding the call from device tensors costs.

    Args:
        fn: a model call returning ``(batch, width, ...)`` for ``(batch, width)`` inputs.
        query_responses: ``(batch, length)`` token ids.
        layout: :func:`causal_layout` of ``query_responses`` (any copy), its tensors on
            ``query_responses``' device; computed here when not given.

    Returns:
        ``(batch, length, ...)``, the output of ``fn`` with gradients flowing through it.
    """
    if layout is None:
        layout = causal_layout(query_responses, pad_token_id)
    if not layout.contiguous:
        return fn(*padding_aware_inputs(query_responses, pad_token_id))
    batch, length = query_responses.shape
    width, start, n_real = layout.width, layout.start, layout.n_real
    positions = torch.arange(width, device=query_responses.device)
    gather = (positions[None, :] + start[:, None]) % length  # (batch, width): rotated column -> original
    real = positions[None, :] < n_real[:, None]  # (batch, width)
    input_ids = torch.gather(query_responses, 1, gather).masked_fill(~real, 0)
    out = fn(input_ids, None, None)  # (batch, width, ...)
    rotated_back = out.new_zeros((batch, length, *out.shape[2:]))
    index = gather.view(batch, width, *([1] * (out.dim() - 2))).expand_as(out)
    keep = real.view(batch, width, *([1] * (out.dim() - 2)))
    return rotated_back.scatter(1, index, out * keep)


# ---------------------------------------------------------------- pairs sharing their query


def pair_layout(
    chosen: torch.Tensor, rejected: torch.Tensor, pad_token_id: int
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Where the rows of preference pairs end and how many first tokens each pair shares: what
    :func:`pair_forward`'s callers decide its split from.

    Args:
        chosen, rejected: ``(batch, length)`` token ids of the same queries.

    Returns:
        ``(right_padded, last, common)``: whether every row is its tokens followed only by PAD;
        ``(batch, 2)`` long, the index of each row's last token before its first PAD
        (``[:, 0]`` chosen, ``[:, 1]`` rejected; ``-1`` for a row that starts with PAD);
        ``(batch,)`` long, the number of first tokens the two rows share, PAD excluded.
    """
    rows = torch.stack([chosen, rejected], 1)  # (batch, 2, length)
    last = first_true_indices((rows == pad_token_id).flatten(0, 1)).view(-1, 2) - 1
    positions = torch.arange(chosen.size(1), device=chosen.device)
    right_padded = bool(((rows != pad_token_id) == (positions < (last + 1)[..., None])).all())
    common = first_true_indices((chosen != rejected) | (chosen == pad_token_id))
    return right_padded, last, common


def pair_forward(
    backbone: nn.Module, chosen: torch.Tensor, rejected: torch.Tensor, prefix: torch.Tensor, ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backbone's hidden states of a pair's two rows, running the tokens they share once.

    A causal model's hidden state at a token depends only on the tokens before it, so tokens
    that two rows share from their start (a pair's query) give both the same keys and values.
    The first ``prefix[i]`` tokens of pair ``i`` run once, with plain causal attention; each
    row's tokens from there up to (not including) its end then run against that prefix's
    key/value cache, the pair's two rows side by side. Used by the reward model's
    :func:`rlhf_core.train.reward.pair_scores` and DPO's :func:`rlhf_core.train.dpo.pair_logprobs`; the
    caller checks that the rows share their first ``prefix`` tokens and that the backbone can
    build a cache (no activation checkpointing in training).

    Args:
        backbone: a transformers decoder (``model.base_model``).
        chosen, rejected: ``(batch, length)`` token ids.
        prefix: ``(batch,)`` long, the shared tokens to run once, at least 1 somewhere.
        ends: ``(batch, 2)`` long, the exclusive end position of each row's second pass, each
            above ``prefix``: ``ends[:, 0]`` for ``chosen``, ``ends[:, 1]`` for ``rejected``.

    Returns:
        ``(hidden, positions, valid)``: hidden states ``(2 * batch, width, d_model)`` of rows
        ``chosen_0, rejected_0, chosen_1, ...``, each at the positions ``(2 * batch, width)``
        from its pair's ``prefix`` on; ``valid`` ``(2 * batch, width)`` bool marks the
        positions before the row's end (the others hold position 0 and are to be ignored).
    """
    batch, length = chosen.shape
    device = chosen.device
    width = int(prefix.max())
    prefix_out = backbone(input_ids=chosen[:, :width], use_cache=True)
    # transformers >= 5.2x names the key/value cache `cache`; `past_key_values` before (removed in 5.40)
    new_name = "cache" in inspect.signature(backbone.forward).parameters
    cache = prefix_out.cache if new_name else prefix_out.past_key_values
    cache.batch_repeat_interleave(2)  # rows (chosen_0, rejected_0, chosen_1, ...)
    rows = torch.stack([chosen, rejected], 1).reshape(2 * batch, length)
    start = prefix.repeat_interleave(2)  # (2 * batch,)
    n_suffix = ends.reshape(-1) - start  # (2 * batch,), each >= 1
    offsets = torch.arange(int(n_suffix.max()), device=device)
    valid = offsets < n_suffix[:, None]
    positions = (start[:, None] + offsets).masked_fill(~valid, 0)
    input_ids = torch.gather(rows, 1, positions).masked_fill(~valid, 0)
    attention_mask = torch.cat([torch.arange(width, device=device) < start[:, None], valid], 1).long()
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        **{"cache" if new_name else "past_key_values": cache},
    ).last_hidden_state
    return hidden, positions, valid


def response_logits(
    model: nn.Module, query_responses: torch.Tensor, pad_token_id: int, context_length: int
) -> torch.Tensor:
    """Language-model logits at the positions that predict the response tokens only.

    Args:
        query_responses: ``(batch, context_length + response_length)``, query left-padded.

    Returns:
        ``(batch, response_length, vocab)``: no full-vocabulary logits for the query.
    """
    hidden = causal_forward(
        lambda ids, mask, pos: (
            model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        ),
        query_responses,
        pad_token_id,
    )
    return model.get_output_embeddings()(hidden[:, context_length - 1 : -1])


def response_values(
    value_model: nn.Module, query_responses: torch.Tensor, pad_token_id: int, context_length: int
) -> torch.Tensor:
    """The value of the state before each response token: PPO's value of that token (Detail 22;
    ``value_model`` a :class:`rlhf_core.train.reward.ScalarModel`).

    Args:
        query_responses: ``(batch, context_length + response_length)``, query left-padded.

    Returns:
        Shape: ``(batch, response_length)``, the value model's output at the positions
        ``context_length - 1 .. -2`` (the query's last token, then each response token but the
        last), in the model's dtype.
    """
    values = causal_forward(
        lambda ids, mask, pos: value_model(input_ids=ids, attention_mask=mask, position_ids=pos),
        query_responses,
        pad_token_id,
    )
    return values[:, context_length - 1 : -1]
