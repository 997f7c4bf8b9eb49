"""What one PPO update samples from and logs: its prompts (:func:`prompt_indices`, Detail 21;
each sampled ``ppo.samples_per_prompt`` times, :func:`rollout_rows`), the log-probabilities of
summaries under a model (:func:`token_logprobs`, :func:`summary_logprobs`), and the statistics
of a :class:`rlhf_core.ppo.algorithm.Trajectory` and of step 4 (:func:`rollout_statistics`,
:func:`throughput_statistics`, :class:`PPOStats`; TRL's names). Huang et al. 2024 (arXiv
2403.17031); the update itself is :func:`rlhf_core.ppo.trainer.run_ppo`.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..config.settings import PPOConfig
from ..train.distributed import World, all_gather_cat, all_reduce_sum, shard, world
from ..train.forward import response_logits
from ..train.generation import last_token_indices, trim_left_padding
from .algorithm import Trajectory, logprobs_from_logits, masked_mean, masked_var, response_mask


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


def rollout_statistics(traj: Trajectory) -> dict[str, float]:
    """Statistics of the global batch (every rank's share gathered; the identity on one rank):
    score, KL to the reference (nats per response and per token), rewards, advantages,
    returns (with a value model), response length and EOS rate, under TRL's names.

    ``rewards/mean`` and ``rewards/std`` are the mean and the (unbiased) standard deviation of
    step 2's per-token rewards, the ones step 3 reads, over the positions of ``value_mask``: with
    ``ppo.whiten_rewards`` the standard deviation is 1 and the mean that of the rewards before
    whitening (Detail 24, ``shift_mean=False``)."""
    gather = all_gather_cat
    token_mask, value_mask = gather(traj.token_mask), gather(traj.value_mask)
    per_token = gather(traj.rewards)
    logprobs, ref_logprobs, scores = gather(traj.logprobs), gather(traj.ref_logprobs), gather(traj.scores)
    advantages, has_eos, returns = gather(traj.advantages), gather(traj.has_eos), traj.returns
    kl = ((logprobs - ref_logprobs) * token_mask).sum(1)  # the "k1" estimator, http://joschu.net/blog/kl-approx.html
    non_score = gather(traj.non_score_reward).sum(1)
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
