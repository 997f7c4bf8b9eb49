"""The chunked language-model head: ``hidden @ weight.T (+ bias)`` a chunk of rows at a time, never the full logits.

It implements SFT's summed next-token cross-entropy (:func:`linear_cross_entropy_sum`) and DPO's
per-token log-probabilities (:func:`linear_logprobs`), both equal with their gradients to the
full-logit computations, on one chunk loop (:func:`_chunk_loop`): each chunk's float32 logits go
to the caller, whose gradient with respect to them the loop turns into the gradients with respect
to the hidden states, the weight and the bias. :func:`head_chunking` picks the matrix products'
dtype and the rows per chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .training import device_tuning

# (rows, logits, targets) -> the chunk's float32 d(output)/d(logits), or None when no gradient is wanted
ChunkFn = Callable[[slice, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def _chunk_loop(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    compute_dtype: torch.dtype,
    chunk_size: int,
    needs: tuple[bool, bool, bool],
    chunk_fn: ChunkFn,
    addmm_weight: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Runs ``chunk_fn(rows, logits, targets[rows])`` on the float32 logits of each chunk of
    ``chunk_size`` rows (matrix product in ``compute_dtype``, autocast off) and accumulates the
    gradient it returns with respect to those logits (``(rows, vocab)`` float32; ``None``: none)
    into the gradients of ``hidden``, ``weight`` and ``bias``.

    ``needs`` says which of the three are wanted; ``chunk_fn`` may modify the logits in place.
    With ``addmm_weight`` and float32 products the weight's gradient is accumulated in place
    (``addmm_``, no ``(vocab, d_model)`` temporary), else each chunk's product is added to it: the
    two round differently, and each caller keeps its own.

    Returns:
        ``(grad_hidden, grad_weight, grad_bias)``: ``hidden``'s dtype, float32 and float32, each
        ``None`` when not wanted.
    """
    need_h, need_w, need_b = needs
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows].to(compute_dtype)
            logits = (h @ w.T).float()
            if bias is not None:
                logits += bias.float()
            grad_logits = chunk_fn(rows, logits, targets[rows])
            if grad_logits is None:
                continue
            if need_b:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(compute_dtype)
            if need_h:
                grad_hidden[rows] = grad_logits @ w
            if need_w and addmm_weight and compute_dtype == torch.float32:
                grad_weight.addmm_(grad_logits.T, h)
            elif need_w:
                grad_weight += (grad_logits.T @ h).float()
    return grad_hidden, grad_weight, grad_bias


class _LinearCrossEntropySum(torch.autograd.Function):
    """Forward: the summed loss, chunk by chunk; the gradients are computed there too and saved."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, compute_dtype, chunk_size):  # noqa: D102
        needs = ctx.needs_input_grad[:3]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)

        def chunk_fn(rows, logits, t):
            lse = torch.logsumexp(logits, dim=-1)
            loss.add_((lse - logits.gather(1, t[:, None]).squeeze(1)).sum())
            if not any(needs):
                return None
            # d(sum of -log softmax at t) / d logits = softmax - one_hot(t)
            grad_logits = logits.sub_(lse[:, None]).exp_()
            grad_logits[torch.arange(t.numel(), device=t.device), t] -= 1.0
            return grad_logits

        grads = _chunk_loop(hidden, weight, bias, targets, compute_dtype, chunk_size, needs, chunk_fn, True)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: D102
        grads = [None if g is None else (g * grad_loss).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return (*grads, None, None, None)


class _LinearLogprobs(torch.autograd.Function):
    """Forward: each row's log-softmax at its target, chunk by chunk (logits never all at once);
    backward: the chunks' logits again, scaled by each row's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, compute_dtype, chunk_size):  # noqa: D102
        out = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)

        def chunk_fn(rows, logits, t):
            out[rows] = logits.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(logits, -1)

        _chunk_loop(hidden, weight, bias, targets, compute_dtype, chunk_size, (False, False, False), chunk_fn)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.compute_dtype, ctx.chunk_size = compute_dtype, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        hidden, weight, bias, targets = ctx.saved_tensors

        def chunk_fn(rows, logits, t):
            # d log softmax(logits)[t] / d logits = one_hot(t) - softmax(logits)
            grad_logits = logits.softmax(-1).neg_()
            grad_logits[torch.arange(t.numel(), device=t.device), t] += 1.0
            grad_logits *= grad_out[rows, None]
            return grad_logits

        needs = ctx.needs_input_grad[:3]
        grads = _chunk_loop(hidden, weight, bias, targets, ctx.compute_dtype, ctx.chunk_size, needs, chunk_fn)
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return (*(None if g is None else g.to(d) for g, d in zip(grads, dtypes)), None, None, None)


def head_chunking(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_bytes: int | None = None
) -> tuple[torch.dtype, int]:
    """How a chunked output layer runs ``hidden @ weight.T``: the matmul dtype (autocast's, else
    the inputs' promoted dtype) and the rows per chunk, at least 1: ``chunk_bytes`` of float32
    logits, by default the ``head_chunk_bytes`` of ``hidden``'s device
    (:func:`rlhf_core.train.training.device_tuning`).

    Raises:
        ValueError: ``hidden`` is not ``(n, d)`` or ``targets`` not ``(n,)``.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: expected (n, d) and (n,)")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if chunk_bytes is None:
        chunk_bytes = device_tuning(hidden.device).head_chunk_bytes
    return compute_dtype, max(1, chunk_bytes // (4 * weight.size(0)))


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, without full logits.

    Equal, with its gradients, to ``F.cross_entropy(F.linear(hidden, weight, bias).float(),
    targets, reduction="sum")``, but the ``(n, vocab)`` logits exist only a chunk of rows at a
    time (``chunk_bytes`` of float32 logits, by default the device's: :func:`head_chunking`):
    the forward pass computes each chunk's loss and its gradients with respect to ``hidden``,
    ``weight`` and ``bias`` right away, and backward only scales them. The language-model head
    of SFT on the full sequence would otherwise hold ``n x vocab`` float32 logits, their
    log-softmax and their gradient (0.9 GB each for 8 x 562 tokens and SmolLM2's 49,153 tokens).
    Under autocast the matrix products run in the autocast dtype, like ``F.linear``; logits and
    the softmax are float32.

    Args:
        hidden: ``(n, d_model)`` hidden states at the positions that predict a target.
        weight: ``(vocab, d_model)`` output embedding (tied or not).
        targets: ``(n,)`` long token ids in ``[0, vocab)``.
        bias: optional ``(vocab,)``.

    Returns:
        A float32 scalar: the summed loss in nats.

    Raises:
        ValueError: ``hidden`` and ``targets`` differ in length.
    """
    compute_dtype, chunk_size = head_chunking(hidden, weight, targets, chunk_bytes)
    return _LinearCrossEntropySum.apply(hidden, weight, bias, targets, compute_dtype, chunk_size)


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T (+ bias))`` at each row's target, without full logits.

    Equal, with its gradients, to ``F.log_softmax(F.linear(hidden, weight, bias).float(),
    -1).gather(1, targets[:, None]).squeeze(1)``, but ``(n, vocab)`` logits exist only a chunk of
    rows (``chunk_bytes`` of float32 logits, by default the device's: :func:`head_chunking`) at a
    time, in the forward pass and again in the backward pass, which recomputes them (the per-row
    incoming gradients are known only then). Under autocast the matrix products run in the
    autocast dtype; logits and the softmax are float32. SFT's summed loss uses
    :func:`linear_cross_entropy_sum` instead, which needs no recomputation since its incoming
    gradient is one scalar.

    Args:
        hidden: ``(n, d_model)`` hidden states at the positions that predict a target.
        weight: ``(vocab, d_model)`` output embedding.
        targets: ``(n,)`` long token ids.
        bias: optional ``(vocab,)``.

    Returns:
        ``(n,)`` float32 log-probabilities in nats.

    Raises:
        ValueError: ``hidden`` and ``targets`` differ in length.
    """
    compute_dtype, chunk_size = head_chunking(hidden, weight, targets, chunk_bytes)
    return _LinearLogprobs.apply(hidden, weight, bias, targets, compute_dtype, chunk_size)
