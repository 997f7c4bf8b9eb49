"""One PPO update's rollout as data, steps 2 and 3 on it, and the statistics logged of it.

Huang et al. 2024 (arXiv 2403.17031), Details 21-25. Step 1 of an update is its prompts
(:func:`prompt_indices`, Detail 21; each sampled ``ppo.samples_per_prompt`` times,
:func:`rollout_rows`) and a :class:`Trajectory` (the sampled responses, their
log-probabilities, values and scores; :func:`make_trajectory`); step 2 the per-token rewards
(:func:`kl_penalised_rewards`, a :class:`Rewards`); step 3 the advantages and returns
(:func:`estimate_advantages`: GAE, :func:`whitened_advantages`, or a critic-free group
baseline). Steps 2 and 3 whiten with the global batch's statistics (:func:`masked_mean_var`).
:func:`rollout_statistics`, :func:`throughput_statistics` and step 4's :class:`PPOStats`
(:func:`reduce_stats`) are what each update logs (TRL's names); the trainer that produces them
is :mod:`rlhf_core.ppo.trainer`.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..config.settings import PPOConfig
from ..train.distributed import World, all_gather_cat, all_reduce_sum, shard, world
from ..train.forward import causal_forward
from ..train.generation import last_token_indices, trim_left_padding, truncate_after_eos
from ..train.reward import ResponseScores, ScalarModel
from .algorithm import (
    INVALID_LOGPROB,
    gae,
    grpo_advantages,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    per_token_rewards,
    response_mask,
    rloo_advantages,
    sequence_returns,
    whiten,
)


def response_logits(
    model: PreTrainedModel, query_responses: torch.Tensor, pad_token_id: int, context_length: int
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
    value_model: ScalarModel, query_responses: torch.Tensor, pad_token_id: int, context_length: int
) -> torch.Tensor:
    """The value of the state before each response token: PPO's value of that token (Detail 22).

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


@torch.no_grad()
def token_logprobs(
    model: PreTrainedModel, queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int, temperature: float
) -> torch.Tensor:
    """``log pi(y_t | x, y_<t)`` of each response token under the sampling distribution at
    ``temperature``, as a rollout's ``logprobs`` are (:func:`rlhf_core.ppo.algorithm.logprobs_from_logits`,
    Detail 23).

    Args:
        queries: ``(n, query_length)`` long, left-padded; responses: ``(n, response_length)``
            long, truncated after their EOS and right-padded (:func:`rlhf_core.train.generation.summarize`).

    Returns:
        Shape: ``(n, response_length)``, float32, in nats, on the device of ``model``; the
        positions after a response's last real token hold the log-probability of PAD under the
        PAD-excluding distribution (mask them out).
    """
    device = next(model.parameters()).device
    queries = trim_left_padding(queries, pad_token_id).to(device)
    responses = responses.to(device)
    logits = response_logits(model, torch.cat([queries, responses], 1), pad_token_id, queries.size(1))
    return logprobs_from_logits(logits, responses, temperature, pad_token_id).float()


@torch.no_grad()
def summary_logprobs(
    model: PreTrainedModel, queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int, temperature: float
) -> torch.Tensor:
    """``log pi(y|x)`` of each summary under the sampling distribution at ``temperature``
    (:func:`token_logprobs`), summed over the response through its EOS (or all of it, without one).

    The difference of two models' values is the "k1" KL estimate of the rollouts
    (:func:`rollout_statistics`) for one summary: ``log pi(y|x) - log pi_sft(y|x)``.

    Args:
        queries: ``(n, query_length)`` long, left-padded; responses: ``(n, response_length)``
            long, truncated after their EOS and right-padded (:func:`rlhf_core.train.generation.summarize`).

    Returns:
        ``(n,)`` float32, in nats, on the CPU.
    """
    logprobs = token_logprobs(model, queries, responses, pad_token_id, temperature)
    mask = response_mask(last_token_indices(responses, pad_token_id), responses.size(1)).to(logprobs.device)
    return (logprobs * mask).sum(1).cpu()


def prompt_indices(n_rows: int, batch_size: int, update: int, seed: int) -> list[int]:
    """Rows of the prompts of update ``update`` (0-based) (Detail 21).

    Prompts are drawn without replacement from a permutation of the split; when it is used
    up, a new permutation (seeded ``seed + pass``) continues. A pure function of its
    arguments, so a resumed run needs only the update number.
    """
    start = update * batch_size
    out: list[int] = []
    perms: dict[int, list[int]] = {}
    for position in range(start, start + batch_size):
        epoch, offset = divmod(position, n_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        out.append(perms[epoch][offset])
    return out


def rollout_rows(n_rows: int, cfg: PPOConfig, update: int, w: World | None = None) -> list[int]:
    """This rank's rows of update ``update``'s episodes: ``batch_size / samples_per_prompt``
    prompts (:func:`prompt_indices`), this rank's contiguous share of them
    (:func:`rlhf_core.train.distributed.shard`), each repeated ``samples_per_prompt`` times in
    consecutive rows. A prompt's samples therefore lie on one rank, next to each other, as the
    group baselines of :func:`estimate_advantages` need. With one sample per prompt, the
    rows of :func:`prompt_indices` sharded.

    Raises:
        ValueError: the prompts do not split evenly over the ranks (naming the settings).
    """
    k, w = cfg.samples_per_prompt, w or world()
    prompts = prompt_indices(n_rows, cfg.batch_size // k, update, cfg.seed)
    if len(prompts) % w.size:
        raise ValueError(
            f"ppo.batch_size {cfg.batch_size} / ppo.samples_per_prompt {k} = {len(prompts)} prompts per update "
            f"do not split over {w.size} ranks: a prompt's samples must stay on one rank"
        )
    return [row for row in shard(prompts, w) for _ in range(k)]


@dataclass
class Trajectory:
    """One update's samples on this rank: step 1 of the update (Details 21, 23).

    ``B`` prompts, ``C`` query tokens (``context_length``, left padding trimmed), ``R``
    response tokens (``response_length``). A response ends at its last real token once
    truncated after its first EOS: the EOS, or position ``R - 1`` when there is none.

    Attributes:
        query_responses: ``(B, C + R)`` long, query then the response as sampled.
        responses: ``(B, R)`` long, exactly ``R`` sampled tokens (not truncated; never PAD).
        logprobs, ref_logprobs: ``(B, R)`` float32 log-probabilities of the sampled tokens under
            the policy and the reference at the sampling temperature
            (:func:`rlhf_core.ppo.algorithm.logprobs_from_logits`), ``INVALID_LOGPROB`` after the last token.
        values: ``(B, R)`` float32, the value model's estimate before each token; ``None``
            without a value model (``ppo.advantage_estimator`` rloo or grpo).
        raw_scores, scores: ``(B,)`` float32, the score of the truncated response without and with
            the EOS trick (:meth:`rlhf_core.ppo.trainer.PPOTrainer.score`).
        has_eos: ``(B,)`` bool, the truncated response ends with EOS.
        last_token_indices: ``(B,)`` long, the index of each response's last token.
        token_mask: ``(B, R)`` bool, positions ``0 .. last_token_indices``.
        context_length: ``C``.
        time_generate, time_score: seconds spent sampling, and computing log-probs, values and scores.
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
    """A :class:`Trajectory` from sampled responses: each ends at its first EOS (Detail 23), and
    the log-probabilities after it are ``INVALID_LOGPROB``.

    Args:
        responses: ``(B, R)`` sampled token ids, not truncated.
        logprobs, ref_logprobs, values: ``(B, R)`` float32, over every sampled position
            (``values`` ``None`` without a value model).
        scored: the scores of ``truncate_after_eos(responses)``, ``(B,)`` each.
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


@dataclass
class Rewards:
    """Per-token rewards of a :class:`Trajectory`: step 2 of the update (Details 23, 24).

    Attributes:
        rewards: ``(B, R)`` float32, ``non_score_reward`` plus the score at the scored position,
            rescaled by the global batch's standard deviation when ``ppo.whiten_rewards``; 0
            outside ``value_mask``.
        non_score_reward: ``(B, R)`` float32, the KL penalty ``-kl_coef * (logprobs - ref_logprobs)``
            on the response tokens, 0 elsewhere.
        value_mask: ``(B, R)`` bool, the positions that carry rewards and values: up to the last
            token (``score_position: eos``) or one further (``after_eos``).
    """

    rewards: torch.Tensor
    non_score_reward: torch.Tensor
    value_mask: torch.Tensor


def rollout_statistics(
    traj: Trajectory, rewards: Rewards, advantages: torch.Tensor, returns: torch.Tensor | None
) -> dict[str, float]:
    """Statistics of the global batch (every rank's share gathered; the identity on one rank):
    score, KL to the reference (nats per response and per token), rewards, advantages,
    returns (with a value model), response length and EOS rate, under TRL's names.

    ``rewards/mean`` and ``rewards/std`` are the mean and the (unbiased) standard deviation of
    step 2's per-token rewards, the ones step 3 reads, over the positions of ``value_mask``: with
    ``ppo.whiten_rewards`` the standard deviation is 1 and the mean that of the rewards before
    whitening (Detail 24, ``shift_mean=False``)."""
    gather = all_gather_cat
    token_mask, value_mask = gather(traj.token_mask), gather(rewards.value_mask)
    per_token = gather(rewards.rewards)
    logprobs, ref_logprobs, scores = gather(traj.logprobs), gather(traj.ref_logprobs), gather(traj.scores)
    advantages, has_eos = gather(advantages), gather(traj.has_eos)
    kl = ((logprobs - ref_logprobs) * token_mask).sum(1)  # the "k1" estimator, http://joschu.net/blog/kl-approx.html
    non_score = gather(rewards.non_score_reward).sum(1)
    lengths = (gather(traj.last_token_indices) + 1).float()
    if returns is not None:
        returns = gather(returns)
        returns_stats = {
            "returns/mean": masked_mean(returns, value_mask).item(),
            "returns/var": masked_var(returns, value_mask).item(),
        }
    else:
        returns_stats = {}
    return returns_stats | {
        "objective/scores": scores.mean().item(),
        "objective/kl": kl.mean().item(),  # nats per response
        "objective/kl_per_token": (kl.sum() / token_mask.sum().clamp(min=1)).item(),
        "objective/entropy": (-logprobs * token_mask).sum(1).mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        "objective/rlhf_reward": (scores + non_score).mean().item(),
        "rewards/mean": masked_mean(per_token, value_mask).item(),
        "rewards/std": masked_var(per_token, value_mask).sqrt().item(),
        "advantages/mean": masked_mean(advantages, token_mask).item(),
        "advantages/var": masked_var(advantages, token_mask).item(),
        "advantages/min": advantages[token_mask].min().item(),
        "advantages/max": advantages[token_mask].max().item(),
        "response/length_mean": lengths.mean().item(),
        "response/length_score_corr": _pearson(lengths, scores),
        "response/no_eos_fraction": 1.0 - has_eos.float().mean().item(),
        "response/eos_rate": has_eos.float().mean().item(),
    }


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum()) / denom if denom > 0 else 0.0


def throughput_statistics(traj: Trajectory, t_train: float, ppo_epochs: int, device: torch.device) -> dict[str, float]:
    """Seconds per phase (rank 0's), tokens per second (all ranks') and peak memory of an update."""
    generated = traj.responses.numel() * world().size
    trained = ppo_epochs * all_reduce_sum([traj.token_mask.sum().item()])[0]
    return {
        "time/generate": traj.time_generate,
        "time/score": traj.time_score,
        "time/train": t_train,
        "time/generate_tokens_per_s": generated / max(traj.time_generate, 1e-9),
        "time/train_tokens_per_s": trained / max(t_train, 1e-9),
        "memory/peak_mb": _peak_memory_mb(device),
    }


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def masked_mean_var(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of ``values`` over the positions where ``mask`` is True, on
    every rank together: the statistics of the global batch (Huang et al. 2024, Details 24-25
    whiten over the whole batch, not over one rank's share).

    Args:
        values: ``(rows, length)`` float on this rank; mask: the same shape, bool.

    Returns:
        ``(mean, var)``, 0-d tensors of ``values``' dtype and device, equal on every rank. On
        one rank exactly :func:`rlhf_core.ppo.algorithm.masked_mean` and :func:`~rlhf_core.ppo.algorithm.masked_var`.

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


def kl_penalised_rewards(traj: Trajectory, cfg: PPOConfig) -> Rewards:
    """Step 2: the KL penalty on every response token plus the score at the last one
    (:func:`rlhf_core.ppo.algorithm.per_token_rewards`; Huang et al. 2024, arXiv 2403.17031, eq. 3, per token as in Figure 11),
    optionally whitened without shifting the mean over the global batch (Detail 24)."""
    rewards, non_score_reward, value_mask = per_token_rewards(
        traj.logprobs, traj.ref_logprobs, traj.scores, traj.last_token_indices, cfg.kl_coef, cfg.score_position
    )
    if cfg.whiten_rewards:  # Detail 24
        rewards = whiten(rewards, *masked_mean_var(rewards, value_mask), shift_mean=False) * value_mask
    return Rewards(rewards, non_score_reward, value_mask)


def whitened_advantages(traj: Trajectory, rewards: Rewards, cfg: PPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: GAE advantages and returns (:func:`rlhf_core.ppo.algorithm.gae`; Schulman et
    al. 2015, arXiv 1506.02438), the advantages whitened over the response tokens of the global
    batch (Detail 25).

    Returns:
        ``(advantages, returns)``, each ``(B, R)`` float32; advantages 0 outside
        ``traj.token_mask``, returns 0 outside ``rewards.value_mask``.
    """
    advantages, returns = gae(rewards.rewards, traj.values, rewards.value_mask, cfg.gamma, cfg.lam)
    advantages = whiten(advantages, *masked_mean_var(advantages, traj.token_mask)) * traj.token_mask  # Detail 25
    return advantages, returns


def estimate_advantages(traj: Trajectory, rewards: Rewards, cfg: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step 3, by ``ppo.advantage_estimator``; the one place the estimator is chosen.

    - ``gae`` (the paper's): :func:`whitened_advantages`, with the value model's returns.
    - ``rloo`` (critic-free): each response's return ``R``, its score minus ``kl_coef`` times
      its summed KL (:func:`rlhf_core.ppo.algorithm.sequence_returns` of step 2's rewards: the KL stays in
      the reward, as Ahmadian et al. 2024 and TRL's ``RLOOTrainer`` keep it), compared with the
      other samples of its prompt (:func:`rlhf_core.ppo.algorithm.rloo_advantages`).
    - ``grpo`` (critic-free): each response's score alone (``traj.scores``), compared with its
      prompt's samples by ``ppo.scale_rewards`` (:func:`rlhf_core.ppo.algorithm.grpo_advantages`); the KL
      is a term of the loss (Shao et al. 2024, arXiv 2402.03300, eq. 3;
      :func:`rlhf_core.ppo.algorithm.ppo_loss`), not of the reward.

    A critic-free advantage is given to every token of its response, not whitened. The
    ``samples_per_prompt`` samples of a prompt are consecutive rows of this rank
    (:func:`rollout_rows`).

    Returns:
        ``(advantages, returns)``: ``(B, R)`` float32 advantages, 0 outside ``traj.token_mask``;
        the returns ``(B, R)`` for the value loss, ``None`` without a value model.

    Raises:
        ValueError: a critic-free estimator's rows do not fall into groups of one query each
            (they were not laid out by :func:`rollout_rows`).
    """
    if cfg.advantage_estimator == "gae":
        return whitened_advantages(traj, rewards, cfg)
    k, context, rows = cfg.samples_per_prompt, traj.context_length, traj.query_responses.size(0)
    queries = traj.query_responses[:, :context]
    grouped = queries.reshape(-1, k, context) if rows % k == 0 else None
    if grouped is None or not bool((grouped == grouped[:, :1]).all()):  # one host sync per update
        raise ValueError(
            f"each group of ppo.samples_per_prompt {k} consecutive rows (of {rows}) must hold one prompt's samples"
        )
    if cfg.advantage_estimator == "rloo":
        per_response = rloo_advantages(sequence_returns(rewards.rewards), k)
    else:
        scores = traj.scores.float()
        batch_std = None
        if cfg.scale_rewards == "batch":  # the std of every score of the global batch
            batch_std = masked_mean_var(scores[None], torch.ones_like(scores[None], dtype=torch.bool))[1].sqrt()
        per_response = grpo_advantages(scores, k, cfg.scale_rewards, batch_std)
    return per_response.unsqueeze(1) * traj.token_mask, None


@dataclass
class PPOStats:
    """Step 4's statistics: means over an update's minibatches (and ranks) of the clipped PPO
    losses (:func:`rlhf_core.ppo.algorithm.policy_loss`, :func:`rlhf_core.ppo.algorithm.value_loss`), and the
    probability ratio over every trained token."""

    policy_loss: float
    clipfrac: float
    approxkl: float
    entropy: float
    ratio_mean: float
    ratio_var: float
    #: None without a value model (ppo.advantage_estimator rloo or grpo)
    value_loss: float | None = None
    value_clipfrac: float | None = None
    #: grpo's KL term of the loss (the mean k3 KL, before kl_coef); None for gae and rloo
    kl_loss: float | None = None

    def metrics(self) -> dict[str, float]:
        """The statistics under their logged names (TRL's); the value model's only when there is one."""
        metrics = {
            "loss/policy": self.policy_loss,
            "loss/value": self.value_loss,
            "policy/clipfrac": self.clipfrac,
            "policy/approxkl": self.approxkl,
            "val/clipfrac": self.value_clipfrac,
            "policy/entropy": self.entropy,
            "val/ratio": self.ratio_mean,
            "val/ratio_var": self.ratio_var,
            "loss/kl": self.kl_loss,
        }
        return {key: value for key, value in metrics.items() if value is not None}


def reduce_stats(sums: dict[str, float], steps: int, ratios: torch.Tensor) -> PPOStats:
    """:class:`PPOStats` from this rank's per-minibatch sums and token ratios, averaged over the ranks."""
    keys = sorted(sums)
    ranks = world().size
    reduced = all_reduce_sum([sums[k] for k in keys] + [ratios.sum().item(), ratios.numel()])
    means = {k: v / (steps * ranks) for k, v in zip(keys, reduced)}
    ratio_mean, count = reduced[-2] / reduced[-1], reduced[-1]
    (ratio_sq,) = all_reduce_sum([((ratios - ratio_mean) ** 2).sum().item()])
    return PPOStats(**means, ratio_mean=ratio_mean, ratio_var=ratio_sq / (count - 1) if count > 1 else 0.0)
