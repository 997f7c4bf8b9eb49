"""PPO's maths: one update's data (:class:`Trajectory`) and its steps as pure functions
(Huang et al. 2024, arXiv 2403.17031, Details 21-25, Table 7). :func:`rlhf_core.ppo.trainer.run_ppo`
runs them in order:

1. the trajectory: sampled responses ended at their first EOS, the masks and the scores
   (:func:`make_trajectory`; the forward passes are :meth:`rlhf_core.ppo.trainer.PPOTrainer.generate_trajectory`);
2. per-token rewards, the KL penalty plus the score (:func:`kl_penalised_rewards`);
3. advantages and returns (:func:`estimate_advantages`: :func:`gae` and :func:`whiten`, or a
   group baseline);
4. the loss of a micro-batch (:func:`ppo_loss`: :func:`policy_loss`, :func:`value_loss`,
   :func:`aggregate_loss`).

Where it departs from the paper:

- ``score_position: eos``, the default, adds the score at the EOS; the paper's code adds it one
  position later (``after_eos``, a setting);
- settings beyond the paper, off by default: ``advantage_estimator`` rloo or grpo (a group
  baseline over each prompt's ``samples_per_prompt`` samples and no value model; GRPO's KL a
  term of the loss, not of the reward), ``loss_type`` other than ``paper`` (the minibatch's tokens
  or rows divide the loss, as TRL's ``GRPOTrainer``), ``value_init: zero_head``.

Shapes: ``(batch, response_length)`` unless stated; ``mask`` is a bool tensor, True on
valid positions. The whitening statistics are the global batch's (:func:`masked_mean_var`
all-reduces over the ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config.settings import PPOConfig
from ..train.distributed import all_reduce_sum, world
from ..train.generation import last_token_indices, truncate_after_eos
from ..train.reward import ResponseScores

#: Log-probability written at invalid (post-EOS) positions; never used in a loss.
INVALID_LOGPROB = 1.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is True (over ``axis``, or all).

    Raises:
        ValueError: ``mask`` selects nothing (the mean would be undefined).
    """
    mask = mask.to(values.dtype)
    if axis is None:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_mean: the mask selects no position")
        return (values * mask).sum() / count
    return (values * mask).sum(axis) / mask.sum(axis)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the masked positions (Bessel-corrected when ``unbiased``).

    Raises:
        ValueError: ``unbiased`` with fewer than two valid positions.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError("masked_var: an unbiased variance needs at least two valid positions")
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with masked statistics (Details 24, 25).

    With ``shift_mean=False`` the mean is added back, so only the scale changes (the
    reward whitening of Detail 24). Positions outside ``mask`` are transformed too; callers
    zero them.
    """
    return whiten(values, masked_mean(values, mask), masked_var(values, mask), shift_mean)


def whiten(values: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with given statistics (e.g. over all ranks'
    batches, :func:`masked_mean_var`); ``shift_mean=False`` adds the
    mean back. Any shape; ``mean`` and ``var`` are 0-d tensors."""
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def masked_mean_var(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of ``values`` over the positions where ``mask`` is True, on
    every rank together: the global batch's statistics, which Details 24-25 whiten with.

    Args:
        values: ``(rows, length)`` float on this rank; mask: the same shape, bool.

    Returns:
        ``(mean, var)``, 0-d tensors of ``values``' dtype and device, equal on every rank. On
        one rank exactly :func:`masked_mean` and :func:`masked_var`.

    Raises:
        ValueError: fewer than two valid positions over all ranks.
    """
    if world().size == 1:
        return masked_mean(values, mask), masked_var(values, mask)
    m = mask.to(torch.float64)
    v = values.detach().to(torch.float64)
    total, count = all_reduce_sum([(v * m).sum().item(), m.sum().item()])
    if count < 2:
        raise ValueError("masked_mean_var: an unbiased variance needs at least two valid positions over all ranks")
    mean = total / count
    (sq,) = all_reduce_sum([(((v - mean) ** 2) * m).sum().item()])
    var = sq / (count - 1)
    return (
        torch.tensor(mean, dtype=values.dtype, device=values.device),
        torch.tensor(var, dtype=values.dtype, device=values.device),
    )


def sampling_logits(logits: torch.Tensor, temperature: float, pad_token_id: int | None) -> torch.Tensor:
    """The logits of the distribution responses are sampled from: ``logits / temperature`` in
    float32, with PAD's logit at the float32 minimum (Detail 23).

    :func:`rlhf_core.train.generation.generate` samples at ``temperature`` and never samples PAD
    (PAD marks the end of a response, Details 3, 12). The rollout's, the reference's and the
    training pass's log-probabilities all go through this function, so the policy PPO trains
    is the one that sampled: the ratio is 1 before the first update and the KL penalty
    compares the two policies on the tokens they can sample. PAD's probability is exactly 0
    (``exp`` of the float32 minimum underflows); a finite minimum, unlike ``-inf``, keeps
    ``p * log p`` in the entropy at 0.

    Args:
        logits: ``(batch, length, vocab)`` raw language-model logits.
        pad_token_id: the PAD id, or ``None`` to keep every token.

    Returns:
        ``(batch, length, vocab)`` float32; gradients flow to the other tokens' logits.
    """
    tempered = logits.float() / temperature
    if pad_token_id is not None:
        tempered[..., pad_token_id] = torch.finfo(tempered.dtype).min
    return tempered


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, pad_token_id: int | None
) -> torch.Tensor:
    """Log-probability of ``tokens`` under the sampling distribution :func:`sampling_logits`
    (Detail 23: the sampling temperature; PAD is never sampled).

    Args:
        logits: ``(batch, length, vocab)``; tokens: ``(batch, length)`` long.

    Returns:
        ``(batch, length)`` float32.
    """
    logp = F.log_softmax(sampling_logits(logits, temperature, pad_token_id), dim=-1)
    return torch.gather(logp, 2, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position, in nats. ``(..., vocab)`` -> ``(...)``."""
    logits = logits.float()
    p = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def response_mask(last_token_indices: torch.Tensor, response_length: int, extra: int = 0) -> torch.Tensor:
    """True on positions ``0 .. last_token_indices + extra`` of each response.

    Args:
        last_token_indices: ``(batch,)`` index of each response's last real token (its EOS,
            or ``response_length - 1`` when there is none).
        extra: 1 to include the position after the EOS (``score_position: after_eos``).

    Returns:
        ``(batch, response_length)`` bool.
    """
    positions = torch.arange(response_length, device=last_token_indices.device).unsqueeze(0)
    return positions <= (last_token_indices + extra).unsqueeze(1)


@dataclass
class Trajectory:
    """One update's samples on this rank, with what steps 2 and 3 compute of them (Details 21-25).

    ``B`` rows, ``C`` query tokens (``context_length``, left padding trimmed), ``R`` response
    tokens. A response ends at its last real token once truncated after its first EOS: the
    EOS, or position ``R - 1`` when there is none. ``traj[idx]`` is the rows ``idx``.

    Attributes:
        query_responses: ``(B, C + R)`` long, query then the response as sampled.
        responses: ``(B, R)`` long, exactly ``R`` sampled tokens (not truncated; never PAD).
        logprobs, ref_logprobs: ``(B, R)`` float32 log-probabilities of the sampled tokens under
            the policy and the reference at the sampling temperature (:func:`logprobs_from_logits`),
            ``INVALID_LOGPROB`` after the last token.
        values: ``(B, R)`` float32, the value model's estimate before each token; ``None``
            without a value model.
        raw_scores, scores: ``(B,)`` float32, the score of the truncated response without and with
            the EOS trick (:class:`rlhf_core.train.reward.ResponseScores`).
        has_eos: ``(B,)`` bool, the truncated response ends with EOS.
        last_token_indices: ``(B,)`` long, the index of each response's last token.
        token_mask: ``(B, R)`` bool, positions ``0 .. last_token_indices``.
        context_length: ``C``.
        time_generate, time_score: seconds spent sampling, and computing log-probs, values and scores.
        rewards, non_score_reward, value_mask: step 2's (:func:`kl_penalised_rewards`); ``None`` before it.
        advantages, returns: step 3's (:func:`estimate_advantages`), ``(B, R)`` float32;
            ``returns`` ``None`` without a value model.
    """

    query_responses: torch.Tensor
    responses: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor | None
    raw_scores: torch.Tensor
    scores: torch.Tensor
    has_eos: torch.Tensor
    last_token_indices: torch.Tensor
    token_mask: torch.Tensor
    context_length: int
    time_generate: float = 0.0
    time_score: float = 0.0
    rewards: torch.Tensor | None = None
    non_score_reward: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def __getitem__(self, idx: torch.Tensor) -> Trajectory:
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v[idx] for k, v in tensors.items() if isinstance(v, torch.Tensor)})


def make_trajectory(
    query_responses: torch.Tensor,
    responses: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor | None,
    scored: ResponseScores,
    context_length: int,
    eos_token_id: int,
    pad_token_id: int,
    **times: float,
) -> Trajectory:
    """Step 1's :class:`Trajectory` from sampled responses: each ends at its first EOS (Detail
    23), and the log-probabilities after it are ``INVALID_LOGPROB``.

    Args:
        responses: ``(B, R)`` sampled token ids, not truncated.
        logprobs, ref_logprobs, values: ``(B, R)`` float32, over every sampled position
            (``values`` ``None`` without a value model).
        scored: the scores of ``truncate_after_eos(responses)``, ``(B,)`` each, the EOS trick applied.
    """
    truncated = truncate_after_eos(responses, eos_token_id, pad_token_id)
    last = torch.clamp(last_token_indices(truncated, pad_token_id), min=0)  # 0 for a response that starts with PAD
    token_mask = response_mask(last, responses.size(1))
    return Trajectory(
        query_responses=query_responses,
        responses=responses,
        logprobs=torch.masked_fill(logprobs, ~token_mask, INVALID_LOGPROB),
        ref_logprobs=torch.masked_fill(ref_logprobs, ~token_mask, INVALID_LOGPROB),
        values=values,
        raw_scores=scored.raw_scores,
        scores=scored.scores,
        has_eos=scored.has_eos,
        last_token_indices=last,
        token_mask=token_mask,
        context_length=context_length,
        **times,
    )


def per_token_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    last_token_indices: torch.Tensor,
    kl_coef: float,
    score_position: str = "eos",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KL-penalised rewards: ``-kl_coef * (logprob - ref_logprob)`` per token, plus the score.

    ``score_position="eos"`` adds the score at the response's last real token (its EOS);
    ``"after_eos"`` adds it one position later, as the reference implementation does, where
    the value function carries it back by one step (at the last position when there is
    no room after it).

    Args:
        logprobs, ref_logprobs: ``(batch, response_length)`` of the sampled tokens.
        scores: ``(batch,)``; last_token_indices: ``(batch,)`` EOS index per response.

    Returns:
        ``(rewards, non_score_reward, mask)``: rewards and the KL part alone, 0 outside
        ``mask``, the positions that carry rewards and values (bool).
    """
    length = logprobs.size(1)
    token_mask = response_mask(last_token_indices, length)
    extra = 1 if score_position == "after_eos" else 0
    if score_position not in ("eos", "after_eos"):
        raise ValueError(f"score_position must be 'eos' or 'after_eos', not {score_position!r}")
    mask = response_mask(last_token_indices, length, extra)
    non_score_reward = -kl_coef * (logprobs - ref_logprobs) * token_mask
    rewards = non_score_reward.clone()
    end = torch.clamp(last_token_indices + extra, max=length - 1)
    rewards[torch.arange(rewards.size(0), device=rewards.device), end] += scores
    return rewards, non_score_reward, mask


def kl_penalised_rewards(traj: Trajectory, cfg: PPOConfig) -> Trajectory:
    """Step 2: ``traj`` with its per-token rewards, the KL penalty on every response token plus
    the score at the last one (:func:`per_token_rewards`; eq. 3, per token as in Figure 11),
    rescaled by the global batch's standard deviation under ``whiten_rewards`` (Detail 24)."""
    rewards, non_score_reward, value_mask = per_token_rewards(
        traj.logprobs, traj.ref_logprobs, traj.scores, traj.last_token_indices, cfg.kl_coef, cfg.score_position
    )
    if cfg.whiten_rewards:  # Detail 24: the scale only, the mean kept
        rewards = whiten(rewards, *masked_mean_var(rewards, value_mask), shift_mean=False) * value_mask
    return replace(traj, rewards=rewards, non_score_reward=non_score_reward, value_mask=value_mask)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid positions of each response
    (Schulman et al. 2015, arXiv 1506.02438, eqs. 11-16).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    with ``V`` and ``r`` taken as 0 outside ``mask`` (the episode ends at the last valid
    position).

    Args:
        rewards, values: ``(batch, response_length)`` float.
        mask: ``(batch, response_length)`` bool, True on valid positions (a prefix of each row).

    Returns:
        ``(advantages, returns)``, both ``(batch, response_length)``, 0 outside ``mask``;
        ``returns = advantages + values``.
    """
    maskf = mask.to(values.dtype)
    rewards, values = rewards * maskf, values * maskf
    length = rewards.size(1)
    lastgaelam = torch.zeros_like(rewards[:, 0])
    reversed_adv = []
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t + 1 < length else torch.zeros_like(values[:, 0])
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_adv.append(lastgaelam)
    advantages = torch.stack(reversed_adv[::-1], dim=1) * maskf
    returns = (advantages + values) * maskf
    return advantages, returns


def sequence_returns(rewards: torch.Tensor) -> torch.Tensor:
    """``(batch,)`` returns ``R = sum_t rewards_t`` of ``(batch, R)`` per-token rewards
    (:func:`per_token_rewards`): the score minus ``kl_coef`` times the summed KL."""
    return rewards.sum(1)


def _groups(returns: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    if samples_per_prompt < 2 or returns.dim() != 1 or returns.numel() % samples_per_prompt:
        raise ValueError(
            f"a group baseline needs samples_per_prompt >= 2 dividing the batch: {returns.numel()} returns "
            f"in groups of {samples_per_prompt}"
        )
    groups = returns.view(-1, samples_per_prompt)
    # both advantages are unchanged by a shift of a group's returns; measured from its first
    # return, a group of equal returns is exactly 0, so its advantages are exactly 0
    return groups - groups[:, :1]


def rloo_advantages(returns: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024, arXiv 2402.14740; Kool et al.
    2019): each sample's return minus the mean return of the other ``k - 1`` samples
    of its prompt, ``A_i = R_i - (sum_j R_j - R_i) / (k - 1)``. A group's advantages sum to 0.

    Args:
        returns: ``(batch,)`` float, the ``k = samples_per_prompt`` samples of each prompt in
            consecutive rows (``batch = prompts * k``).

    Returns:
        ``(batch,)``, one advantage per response (every one of its tokens gets it).

    Raises:
        ValueError: ``samples_per_prompt`` below 2 or not dividing ``batch``.
    """
    groups = _groups(returns, samples_per_prompt)
    baseline = (groups.sum(1, keepdim=True) - groups) / (samples_per_prompt - 1)  # mean of the others
    return (groups - baseline).reshape(-1)


#: Added to a group's standard deviation in :func:`grpo_advantages` (TRL's GRPOTrainer), so a group
#: of equal returns gets advantages 0, not NaN.
GRPO_EPS = 1e-4


def grpo_advantages(
    scores: torch.Tensor,
    samples_per_prompt: int,
    scale: str = "group",
    batch_std: torch.Tensor | None = None,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """Group-relative advantages (Shao et al. 2024, arXiv 2402.03300, Section 4.1.2, outcome
    supervision; TRL's ``GRPOTrainer``): ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the
    ``k`` samples of a prompt, from the scores alone (the KL penalty is a term of the loss,
    :func:`k3_kl`, not of the reward), ``std`` Bessel-corrected as in TRL.

    Args:
        scores: ``(batch,)`` float, the ``k = samples_per_prompt`` samples of each prompt in
            consecutive rows.
        scale: ``group`` divides by the group's std; ``batch`` by ``batch_std``, the std of
            every score of the global batch (TRL's ``scale_rewards="batch"``); ``none`` does
            not divide (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783).
        batch_std: 0-d, needed with ``scale="batch"``.

    Returns:
        ``(batch,)``; exactly 0 for every sample of a group whose scores are all equal.

    Raises:
        ValueError: ``samples_per_prompt`` below 2 or not dividing ``batch``; an unknown
            ``scale``, or ``batch`` without ``batch_std``.
    """
    groups = _groups(scores, samples_per_prompt)
    centred = groups - groups.mean(1, keepdim=True)
    if scale == "group":
        centred = centred / (groups.std(1, keepdim=True) + eps)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError("grpo_advantages: scale 'batch' needs batch_std")
        centred = centred / (batch_std + eps)
    elif scale != "none":
        raise ValueError(f"grpo_advantages: scale must be group, batch or none, not {scale!r}")
    return centred.reshape(-1)


def estimate_advantages(traj: Trajectory, cfg: PPOConfig) -> Trajectory:
    """Step 3: ``traj`` (after step 2) with its advantages and returns, by ``advantage_estimator``.

    - ``gae`` (the paper's): :func:`gae` of the rewards and values (Schulman et al. 2015, arXiv
      1506.02438), the advantages whitened over the global batch's response tokens (Detail 25).
    - ``rloo``: each response's return, its score minus ``kl_coef`` times its summed KL
      (:func:`sequence_returns`), against its prompt's other samples (:func:`rloo_advantages`;
      the KL stays in the reward, as Ahmadian et al. 2024 and TRL's ``RLOOTrainer`` keep it).
    - ``grpo``: each response's score alone, against its prompt's samples by ``scale_rewards``
      (:func:`grpo_advantages`); the KL is a term of the loss (:func:`ppo_loss`).

    A critic-free advantage is given to every token of its response, not whitened; a prompt's
    ``samples_per_prompt`` samples are consecutive rows (:func:`rlhf_core.ppo.rollout.rollout_rows`).
    Advantages are 0 outside ``token_mask``, returns (``None`` without a value model) outside ``value_mask``.

    Raises:
        ValueError: step 2 has not run; a critic-free estimator's rows do not fall into groups
            of one query each.
    """
    if traj.rewards is None or traj.value_mask is None:
        raise ValueError("estimate_advantages: the trajectory has no rewards (run kl_penalised_rewards first)")
    if cfg.advantage_estimator == "gae":
        advantages, returns = gae(traj.rewards, traj.values, traj.value_mask, cfg.gamma, cfg.lam)  # type: ignore[arg-type]
        advantages = whiten(advantages, *masked_mean_var(advantages, traj.token_mask)) * traj.token_mask  # Detail 25
        return replace(traj, advantages=advantages, returns=returns)
    k, context, rows = cfg.samples_per_prompt, traj.context_length, traj.query_responses.size(0)
    queries = traj.query_responses[:, :context]
    grouped = queries.reshape(-1, k, context) if rows % k == 0 else None
    if grouped is None or not bool((grouped == grouped[:, :1]).all()):  # one host sync per update
        raise ValueError(
            f"each group of ppo.samples_per_prompt {k} consecutive rows (of {rows}) must hold one prompt's samples"
        )
    if cfg.advantage_estimator == "rloo":
        per_response = rloo_advantages(sequence_returns(traj.rewards), k)
    else:
        scores = traj.scores.float()
        batch_std = None
        if cfg.scale_rewards == "batch":  # the std of every score of the global batch
            batch_std = masked_mean_var(scores[None], torch.ones_like(scores[None], dtype=torch.bool))[1].sqrt()
        per_response = grpo_advantages(scores, k, cfg.scale_rewards, batch_std)
    return replace(traj, advantages=per_response.unsqueeze(1) * traj.token_mask, returns=None)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-token "k3" estimate of KL(policy || reference) that GRPO adds to its loss
    (Shao et al. 2024, arXiv 2402.03300, eq. 4; http://joschu.net/blog/kl-approx.html):
    ``exp(ref - logp) - (ref - logp) - 1``, non-negative, 0 where the two agree.

    Args:
        logprobs: ``(batch, response_length)`` float, the policy's (with gradients).
        ref_logprobs: ``(batch, response_length)`` float, the reference policy's.
        mask: ``(batch, response_length)`` bool, the response tokens.

    Returns:
        ``(batch, response_length)``, 0 outside ``mask``.
    """
    diff = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
    return torch.exp(diff) - diff - 1


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
) -> dict[str, torch.Tensor]:
    """PPO's clipped surrogate loss over the valid response tokens (Schulman et al. 2017,
    arXiv 1707.06347, eq. 7, negated to minimise): ``max(-A * r, -A * clip(r, 1 - eps, 1 + eps))``
    with ``r = exp(new_logprobs - old_logprobs)``.

    Returns:
        ``loss`` (scalar, to minimise: the mean over the valid tokens), ``per_token`` (the
        ``(batch, length)`` terms it averages, for :func:`aggregate_loss`), ``clipfrac`` (share
        of tokens where the clipped term is the larger loss), ``approxkl`` (``0.5 *
        mean(log-ratio^2)``, the "k2" estimator of KL(old || new),
        http://joschu.net/blog/kl-approx.html), ``ratio`` (``(batch, length)``).
    """
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.max(losses, losses_clipped)
    return {
        "loss": masked_mean(per_token, mask),
        "per_token": per_token,
        "clipfrac": masked_mean((losses_clipped > losses).float(), mask),
        "approxkl": 0.5 * masked_mean(log_ratio**2, mask),
        "ratio": ratio,
    }


class Minibatch(NamedTuple):
    """A micro-batch's place in its minibatch: ``share``, its rows over the minibatch's rows on
    every rank, and ``rows``, ``tokens``, the minibatch's rows and response tokens on every rank
    (read by every ``loss_type`` but ``paper``, which reads ``share`` alone)."""

    share: float
    rows: int
    tokens: int


def aggregate_loss(
    terms: list[tuple[float, torch.Tensor]], mask: torch.Tensor, loss_type: str, minibatch: Minibatch
) -> torch.Tensor:
    """A micro-batch's share of a minibatch's loss ``sum_k c_k * l_k`` from per-token terms
    ``(c_k, l_k)``, for ``ppo.loss_type`` (TRL's ``GRPOTrainer`` ``loss_type``); summed over the
    micro-batches (and ranks) of a minibatch it is the same whatever the micro-batches, except
    under ``paper``.

    - ``paper``: each term's token mean, ``sum_k c_k * mean_tokens(l_k) * share`` (the paper's
      PPO: it moves with the micro-batch).
    - ``dapo``: ``sum(l) / tokens``, the mean over the minibatch's tokens (Yu et al. 2025,
      arXiv 2503.14476).
    - ``grpo``: ``sum_i mean_t(l_i) / rows``, each response's token mean, then the mean over
      responses (Shao et al. 2024, arXiv 2402.03300, eq. 3).
    - ``dr_grpo``: ``sum(l) / (rows * R)`` (Liu et al. 2025, arXiv 2503.20783).

    with ``l = sum_k c_k * l_k``.

    Args:
        terms: ``(coefficient, (rows, R) float loss of each token)``, the first one's
            coefficient 1.
        mask: ``(rows, R)`` bool, the response tokens.
        minibatch: the micro-batch's share and the minibatch's counts (:class:`Minibatch`).

    Returns:
        A scalar.

    Raises:
        ValueError: an unknown ``loss_type``, or a first coefficient other than 1.
    """
    (coef, first), rest = terms[0], terms[1:]
    if coef != 1.0:
        raise ValueError(f"aggregate_loss: the first term's coefficient is 1, not {coef}")
    if loss_type == "paper":
        mean = masked_mean(first, mask)
        for coef, per_token in rest:
            mean = mean + coef * masked_mean(per_token, mask)
        return mean * minibatch.share
    for coef, per_token in rest:
        first = first + coef * per_token
    m = mask.to(first.dtype)
    if loss_type == "dapo":
        return (first * m).sum() / minibatch.tokens
    if loss_type == "grpo":
        return ((first * m).sum(1) / m.sum(1).clamp(min=1.0)).sum() / minibatch.rows
    if loss_type == "dr_grpo":
        return (first * m).sum() / (minibatch.rows * first.size(1))
    raise ValueError(f"loss_type must be paper, dapo, grpo or dr_grpo, not {loss_type!r}")


def value_loss(
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> dict[str, torch.Tensor]:
    """Clipped value loss ``0.5 * mean(max((V - R)^2, (V_clip - R)^2))`` over valid positions
    (value-function loss clipping of OpenAI baselines' ``ppo2``: Huang et al. 2022, "The 37
    Implementation Details of Proximal Policy Optimization", ICLR blog track, detail 9).

    ``V_clip = old_values + clamp(new_values - old_values, -cliprange_value, cliprange_value)``.

    Returns:
        ``loss`` (scalar) and ``clipfrac`` (share of positions where the clipped error is larger).
    """
    clipped = old_values + torch.clamp(new_values - old_values, -cliprange_value, cliprange_value)
    losses = (new_values - returns) ** 2
    losses_clipped = (clipped - returns) ** 2
    return {
        "loss": 0.5 * masked_mean(torch.max(losses, losses_clipped), mask),
        "clipfrac": masked_mean((losses_clipped > losses).float(), mask),
    }


def ppo_loss(
    batch: Trajectory,
    new_logprobs: torch.Tensor | None,
    new_values: torch.Tensor | None,
    cfg: PPOConfig,
    minibatch: Minibatch,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Step 4: the micro-batch ``batch``'s share of PPO's loss:

    1. the clipped surrogate over the response tokens (Schulman et al. 2017, arXiv 1707.06347,
       eq. 7; :func:`policy_loss`);
    2. under ``advantage_estimator: grpo``, plus ``kl_coef`` times the k3 KL from the reference
       (Shao et al. 2024, arXiv 2402.03300, eq. 3; :func:`k3_kl`);
    3. aggregated under ``loss_type`` (:func:`aggregate_loss`);
    4. plus ``vf_coef`` times the clipped value loss, times ``minibatch.share``
       (:func:`value_loss`; detail 9 of the 37, Table 7 of the N+).

    ``new_logprobs`` ``None`` leaves out 1-3, ``new_values`` ``None`` leaves out 4: the policy
    and the value model share no parameters, so each part may be backpropagated on its own.

    Args:
        batch: the micro-batch's rows of the trajectory after step 3 (``traj[idx]``).
        new_logprobs: ``(rows, R)`` float, the policy's log-probabilities now
            (``INVALID_LOGPROB`` off ``batch.token_mask``), or ``None``.
        new_values: ``(rows, R)`` float, the value model's predictions now (0 off
            ``batch.value_mask``), or ``None``.

    Returns:
        ``(loss, stats)``: a scalar, and scalar tensors ``policy_loss``, ``clipfrac``,
        ``approxkl`` and ``ratio`` (``(rows, R)``) with the policy's part, under grpo ``kl_loss``
        (the mean k3 KL), and ``value_loss``, ``value_clipfrac`` with the value model's.

    Raises:
        ValueError: neither ``new_logprobs`` nor ``new_values`` given; an unknown ``loss_type``.
    """
    parts, stats = [], {}
    if new_logprobs is not None:
        pl = policy_loss(new_logprobs, batch.logprobs, batch.advantages, batch.token_mask, cfg.cliprange)
        terms = [(1.0, pl["per_token"])]
        stats |= {
            "policy_loss": pl["loss"],
            "clipfrac": pl["clipfrac"],
            "approxkl": pl["approxkl"],
            "ratio": pl["ratio"],
        }
        if cfg.advantage_estimator == "grpo":
            per_token_kl = k3_kl(new_logprobs, batch.ref_logprobs, batch.token_mask)
            terms.append((cfg.kl_coef, per_token_kl))
            stats["kl_loss"] = masked_mean(per_token_kl, batch.token_mask)
        parts.append(aggregate_loss(terms, batch.token_mask, cfg.loss_type, minibatch))
    if new_values is not None:
        vl = value_loss(new_values, batch.values, batch.returns, batch.value_mask, cfg.cliprange_value)
        parts.append(cfg.vf_coef * vl["loss"] * minibatch.share)
        stats |= {"value_loss": vl["loss"], "value_clipfrac": vl["clipfrac"]}
    if not parts:
        raise ValueError("ppo_loss: neither new_logprobs nor new_values given")
    return (parts[0] if len(parts) == 1 else parts[0] + parts[1]), stats
