"""PPO's evaluation: the policy's held-out scores, its learning check, the value-vs-reward diagnostic.

:func:`evaluate_policy` is what :meth:`rlhf_core.ppo.trainer.PPOTrainer.evaluate` runs every
``ppo.eval_every`` updates and at the end, then with :func:`learning_check_metrics` (scores
with the EOS trick, Huang et al. 2024, Detail 23); :func:`value_vs_reward` and
:func:`write_value_vs_reward` read the trained value model as a per-token reward model after
training (Detail 22), with the per-token rewards and values PPO reads of the same summaries
(Figure 11, :func:`ppo_rewards_and_values`). Each reads the trainer's models through
:class:`TrainerView`.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol

import datasets
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..common.io import write_json_atomic
from ..config.settings import PPOConfig
from ..metrics.statistics import paired_difference, wilson_interval
from ..metrics.text import repetition_rate
from ..train.distributed import DataParallel, World, all_gather_object, split_range
from ..train.external_reward import ExternalRewardModel
from ..train.forward import response_values
from ..train.generation import last_token_indices, summarize, trim_left_padding
from ..train.lora import AdaptersDisabled
from ..train.reward import (
    TOKEN_TABLE_RESPONSES,
    ResponseScores,
    response_reward_logits,
    token_table,
)
from ..train.training import autocast, micro_batches
from .algorithm import per_token_rewards
from .rollout import summary_logprobs, token_logprobs


class TrainerView(Protocol):
    """What PPO's evaluation reads of :class:`rlhf_core.ppo.trainer.PPOTrainer`: the settings,
    the SFT data, the tokenizer, the models and their :class:`rlhf_core.train.distributed.DataParallel`
    wrappers (``ref_parallel``: the frozen SFT policy; ``reward_parallel``: None with a rule
    reward), and the training score (:meth:`rlhf_core.ppo.trainer.PPOTrainer.score`)."""

    cfg: PPOConfig
    sft: datasets.DatasetDict
    tokenizer: PreTrainedTokenizerBase
    pad_id: int
    eos_id: int
    response_length: int
    device: torch.device
    world: World
    policy: PreTrainedModel
    policy_parallel: DataParallel
    ref_parallel: DataParallel | AdaptersDisabled
    value_parallel: DataParallel | None
    reward_parallel: DataParallel | None

    def score(self, queries: torch.Tensor, responses: torch.Tensor) -> ResponseScores: ...


@torch.no_grad()
def evaluate_policy(
    trainer: TrainerView, split: str = "validation", against_sft: bool = False
) -> tuple[dict[str, float], list[dict], tuple[torch.Tensor, torch.Tensor] | None]:
    """Near-greedy policy summaries on held-out prompts of ``trainer.sft[split]`` (at most
    ``ppo.eval_max_samples``), scored as in training (``trainer.score``: the reward model, or the
    rule reward of ``ppo.reward``) against the references. Collective: every rank calls it.

    ``eval/score_policy`` is the mean score with the EOS trick (``non_eos_penalty`` for a
    summary without EOS, Detail 23), the score PPO optimises; ``eval/raw_score_policy``
    the mean score without the trick (the reward model's own output) and ``eval/eos_rate_policy`` the share of
    summaries that end with EOS. The references always end with EOS. The prompts are split
    over the ranks and the results gathered, in order, on every rank.

    With ``against_sft`` (the last evaluation), the SFT policy (the frozen reference) also
    summarises the same prompts with the same seeds, and the stage's learning check is
    measured here, so that a run stopped after PPO has it: ``eval/score_gain_vs_sft`` (the
    mean paired difference of the scores, with ``_ci_low``/``_ci_high``, a 95% Student's
    t interval), the RLHF objective's gain ``eval/objective_gain_vs_sft`` (score minus
    ``kl_coef`` times the summary's KL from SFT, ``eval/kl_vs_sft``, both with the policy's
    summaries' log-probabilities under both models at the training temperature),
    ``eval/eos_rate_policy_ci_low``/``_ci_high`` (95% Wilson), ``eval/score_sft``,
    ``eval/eos_rate_sft``, and ``eval/repetition_rate_policy``/``_sft`` (share of summaries
    with a :func:`rlhf_core.metrics.text.repetition_loop`; :func:`learning_check_metrics`).

    Returns:
        ``(metrics, samples, responses)``: the metrics above (floats, equal on every rank); one
        record per prompt (``post``, ``reference``, ``policy`` and their scores, with
        ``against_sft`` also ``sft``, ``score_sft`` and ``kl_vs_sft``), in the split's order;
        and this rank's ``(queries, summaries)``, ``(n, query_length)`` and ``(n, response_length)`` long token
        ids, for :func:`value_vs_reward` (None on a rank without prompts).
    """
    cfg = trainer.cfg
    ds = trainer.sft[split]
    ds = ds.select(range(min(len(ds), cfg.eval_max_samples or len(ds))))
    mine = ds.select(split_range(len(ds), trainer.world))
    rows: list[tuple[float, float, bool, float, str, float, bool, str | None, float]] = []
    trainer.policy.eval()

    def sample(parallel):  # the same samples every time, training's RNG untouched
        # The ranks' shares differ in size and summaries stop at EOS, so sharded models are
        # gathered whole first; a rank without prompts joins the gathering and computes nothing.
        rng = torch.random.fork_rng(devices=[trainer.device] if trainer.device.type == "cuda" else [])
        with parallel.gathered(), rng:
            if len(mine):
                return parallel.inference(
                    summarize,
                    trainer.tokenizer,
                    queries,
                    trainer.response_length,
                    cfg.eval_temperature,
                    cfg.micro_batch_size,
                    cfg.seed + trainer.world.rank,
                    cfg.bf16,
                )
        return None

    queries = torch.tensor(mine["query_token"]) if len(mine) else None
    summaries = sample(trainer.policy_parallel)
    # the SFT policy (the frozen reference) on the same prompts, with the same seeds, and the
    # KL of the policy's summaries from it: log pi(y|x) - log pi_sft(y|x)
    sft_summaries = sample(trainer.ref_parallel) if against_sft else None
    kl = policy_kl_from_sft(trainer, queries, summaries.responses if len(mine) else None) if against_sft else None
    with trainer.reward_parallel.gathered() if trainer.reward_parallel is not None else nullcontext():
        if len(mine):
            policy = trainer.score(queries, summaries.responses)
            reference = trainer.score(queries, torch.tensor(mine["reference_response_token"]))
            sft = trainer.score(queries, sft_summaries.responses) if against_sft else None
    responses = None
    if len(mine):
        responses = (queries, summaries.responses)  # for value_vs_reward (Detail 22)
        rows = list(
            zip(
                policy.scores.tolist(),
                policy.raw_scores.tolist(),
                policy.has_eos.tolist(),
                reference.scores.tolist(),
                summaries.texts,
                sft.scores.tolist() if sft is not None else [math.nan] * len(mine),
                sft.has_eos.tolist() if sft is not None else [False] * len(mine),
                sft_summaries.texts if against_sft else [None] * len(mine),
                kl.tolist() if kl is not None else [math.nan] * len(mine),
            )
        )
    rows = [row for rank_rows in all_gather_object(rows) for row in rank_rows]
    sp, raw, has_eos, sr = (torch.tensor([row[i] for row in rows], dtype=torch.float64) for i in range(4))
    metrics = {
        "eval/score_policy": sp.mean().item(),
        "eval/raw_score_policy": raw.mean().item(),
        "eval/eos_rate_policy": has_eos.mean().item(),
        "eval/score_reference": sr.mean().item(),
        "eval/rm_win_rate_vs_reference": (sp > sr).double().mean().item(),
    }
    if against_sft:
        metrics |= learning_check_metrics(rows, cfg.kl_coef)
    samples = [
        {
            "post": p,
            "reference": r.strip(),
            "policy": row[4],
            "score_policy": row[0],
            "raw_score_policy": row[1],
            "score_reference": row[3],
            **({"sft": row[7], "score_sft": row[5], "kl_vs_sft": row[8]} if against_sft else {}),
        }
        for p, r, row in zip(ds["post"], ds["reference_response"], rows)
    ]
    return metrics, samples, responses


def policy_kl_from_sft(
    trainer: TrainerView, queries: torch.Tensor | None, responses: torch.Tensor | None
) -> torch.Tensor | None:
    """Each of this rank's policy summaries' KL from the SFT policy (the frozen reference),
    ``log pi(y|x) - log pi_sft(y|x)`` at the training temperature
    (:func:`rlhf_core.ppo.rollout.summary_logprobs`), in micro-batches of ``ppo.micro_batch_size``.
    Collective (each model is gathered whole first): every rank calls it, a rank without
    prompts with ``None``.

    Args:
        queries: ``(n, query_length)`` long, left-padded; responses: ``(n, response_length)``.

    Returns:
        ``(n,)`` float32 nats on the CPU; None on a rank without prompts.
    """
    cfg = trainer.cfg

    def logprobs(parallel) -> torch.Tensor | None:
        with parallel.gathered():
            if queries is None or responses is None:
                return None
            parts = []
            for mb in micro_batches(list(range(len(queries))), cfg.micro_batch_size):
                with autocast(trainer.device, cfg.bf16):
                    args = (queries[mb], responses[mb], trainer.pad_id, cfg.temperature)
                    parts.append(parallel.inference(summary_logprobs, *args))
            return torch.cat(parts)

    policy, sft = logprobs(trainer.policy_parallel), logprobs(trainer.ref_parallel)
    return policy - sft if policy is not None and sft is not None else None


@torch.no_grad()
def value_vs_reward(
    trainer: TrainerView, responses: tuple[torch.Tensor, torch.Tensor] | None, n: int = TOKEN_TABLE_RESPONSES
) -> list[dict] | None:
    """The value model read as a per-token reward model (Huang et al. 2024, Detail 22): its
    output at every token of the first ``n`` of ``responses`` (this rank's ``(queries,
    summaries)`` of the last :func:`evaluate_policy`; None before any evaluation),
    beside the reward model's logits there (Detail 13), one forward pass of each
    (:func:`rlhf_core.train.reward.response_reward_logits`); and the rewards and values of the same
    summaries as PPO reads them (Figure 11: :func:`ppo_rewards_and_values`). Collective: every
    rank calls it.

    ``values`` are read at the same positions as ``reward_logits``, the state after each
    token: PPO's value of response token ``t`` (:func:`rlhf_core.train.forward.response_values`, the state before
    it) is ``values[t - 1]``. The value model starts as the reward model (Detail 22), so the
    two are equal before training.

    Returns:
        :func:`rlhf_core.train.reward.token_table` rows with ``row`` (the evaluation prompt's
        index, as in ``samples.jsonl``), ``reward_logits``, ``values`` and ``value_at_eos``, and
        :func:`ppo_rewards_and_values`'s fields; None on ranks other than 0, with a rule reward
        (no reward model) or an existing reward model of its own tokenizer (``ppo.reward:
        model:SOURCE``), without a value model (``ppo.advantage_estimator`` rloo or grpo), or
        before any evaluation.
    """
    if trainer.value_parallel is None:
        return None  # a critic-free estimator
    if trainer.reward_parallel is None or isinstance(trainer.reward_parallel.model, ExternalRewardModel):
        return None  # no reward model, or one that reads other tokens than the policy's
    pad, eos, bf16 = trainer.pad_id, trainer.eos_id, trainer.cfg.bf16
    queries, summaries = (responses[0][:n].cpu(), responses[1][:n].cpu()) if responses is not None else (None, None)
    # Figure 11's KL penalties: the policy's and the reference's log-probabilities (collective)
    logprobs = _main_token_logprobs(trainer, trainer.policy_parallel, queries, summaries)
    ref_logprobs = _main_token_logprobs(trainer, trainer.ref_parallel, queries, summaries)
    # gathered whole (collective) so that rank 0 alone may run its forward passes
    with trainer.value_parallel.gathered(), trainer.reward_parallel.gathered():
        if not trainer.world.is_main or queries is None or summaries is None:
            return None
        logits, scores, indices = trainer.reward_parallel.inference(
            response_reward_logits, queries, summaries, pad, bf16
        )
        values, _, _ = trainer.value_parallel.inference(response_reward_logits, queries, summaries, pad, bf16)
        q = trim_left_padding(queries, pad)  # PPO's values: the state before each token, as the rollouts read them
        with autocast(trainer.device, bf16):
            qr = torch.cat([q, summaries], 1).to(trainer.device)
            ppo_values = trainer.value_parallel.inference(response_values, qr, pad, q.size(1)).float().cpu()
        ppo_scores = trainer.score(queries, summaries).scores  # the score PPO adds, the EOS trick applied
    rows = token_table(
        trainer.tokenizer, summaries, scores, indices, eos, pad, {"reward_logits": logits, "values": values}
    )
    figure_11 = ppo_rewards_and_values(trainer.cfg, summaries, logprobs, ref_logprobs, ppo_scores, ppo_values, pad)
    return [
        {
            "row": i,
            **row,
            "value_at_eos": row["values"][row["eos_index"]] if row["eos_index"] >= 0 else None,
            **ppo_row,
        }
        for i, (row, ppo_row) in enumerate(zip(rows, figure_11))
    ]


def _main_token_logprobs(
    trainer: TrainerView,
    parallel: DataParallel | AdaptersDisabled,
    queries: torch.Tensor | None,
    summaries: torch.Tensor | None,
) -> torch.Tensor | None:
    """Rank 0's per-token log-probabilities of ``summaries`` under the model of ``parallel`` at the
    training temperature (:func:`rlhf_core.ppo.rollout.token_logprobs`), ``(n, response_length)``
    float32 on the CPU; None on other ranks or without summaries. Collective (the model is
    gathered whole first): every rank calls it."""
    with parallel.gathered():
        if not trainer.world.is_main or queries is None or summaries is None:
            return None
        with autocast(trainer.device, trainer.cfg.bf16):
            args = (queries, summaries, trainer.pad_id, trainer.cfg.temperature)
            return parallel.inference(token_logprobs, *args).cpu()


def ppo_rewards_and_values(
    cfg: PPOConfig,
    summaries: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    ppo_values: torch.Tensor,
    pad_token_id: int,
) -> list[dict]:
    """The rewards and values of a few summaries as PPO's step 2 reads them (Huang et al. 2024,
    Detail 22, Figure 11): per token the KL penalty ``-kl_coef * (log pi - log pi_ref)`` and
    the score (with the EOS trick, Detail 23) added at the position ``ppo.score_position`` names
    (:func:`rlhf_core.ppo.algorithm.per_token_rewards`, the function the rollouts use), beside the
    value of each token (the state before it). The rewards are those before the optional
    whitening (Detail 24), which rescales a whole batch's and has no meaning for a few summaries.

    Args:
        summaries: ``(n, response_length)`` long, PAD after the first EOS.
        logprobs, ref_logprobs: Shape: ``(n, response_length)``, float32 nats of the summaries'
            tokens under the policy and the reference at the training temperature.
        scores: ``(n,)`` float32, each summary's score with the EOS trick
            (:meth:`rlhf_core.ppo.trainer.PPOTrainer.score`).
        ppo_values: ``(n, response_length)`` float32 (:func:`rlhf_core.train.forward.response_values`).

    Returns:
        One dict per summary, over the positions that carry rewards and values (through the
        EOS, or one further under ``score_position: after_eos``): ``kl_penalty``, ``rewards`` and
        ``ppo_values`` (lists of floats), ``score_index`` (where the score is added) and
        ``ppo_score`` (the score added: the raw score, or ``non_eos_penalty`` for a summary
        without EOS).
    """
    last = torch.clamp(last_token_indices(summaries, pad_token_id), min=0)
    rewards, kl_penalty, mask = per_token_rewards(logprobs, ref_logprobs, scores, last, cfg.kl_coef, cfg.score_position)
    extra = 1 if cfg.score_position == "after_eos" else 0
    out = []
    for i in range(len(summaries)):
        m = int(mask[i].sum())
        out.append(
            {
                "kl_penalty": [float(v) for v in kl_penalty[i, :m].tolist()],
                "rewards": [float(v) for v in rewards[i, :m].tolist()],
                "ppo_values": [float(v) for v in ppo_values[i, :m].tolist()],
                "score_index": min(int(last[i]) + extra, summaries.size(1) - 1),
                "ppo_score": float(scores[i]),
            }
        )
    return out


def learning_check_metrics(rows: list[tuple], kl_coef: float) -> dict[str, float]:
    """PPO's learning check on the evaluation prompts, from :func:`evaluate_policy`'s rows
    ``(score_policy, raw_score_policy, has_eos_policy, score_reference, text_policy, score_sft,
    has_eos_sft, text_sft, kl_vs_sft)``.

    - ``eval/objective_gain_vs_sft`` (with ``_ci_low``/``_ci_high``): the RLHF objective that
      PPO maximises, ``score - kl_coef * KL`` per summary (Huang et al. 2024, arXiv 2403.17031:
      "our PPO implementation at least optimizes the RLHF objective"), the policy's minus SFT's
      on the same prompt; SFT's KL from itself is 0. The KL of a summary is its log-ratio
      ``log pi(y|x) - log pi_sft(y|x)`` at the training temperature
      (:func:`rlhf_core.ppo.rollout.summary_logprobs`), ``eval/kl_vs_sft`` its mean, in nats.
    - ``eval/score_gain_vs_sft``: the paired score gain alone.
    - PPO's EOS rate with its Wilson interval, SFT's, and both policies' repetition rates.

    Intervals are 95%, Student's t for the paired differences
    (:func:`rlhf_core.metrics.statistics.paired_difference`).
    """
    policy, sft = [row[0] for row in rows], [row[5] for row in rows]
    kl = [row[8] for row in rows]
    gain = paired_difference(policy, sft)
    objective = paired_difference([s - kl_coef * k for s, k in zip(policy, kl)], sft)
    eos = sum(bool(row[2]) for row in rows)
    low, high = wilson_interval(eos, len(rows))
    return {
        "eval/score_sft": sum(sft) / len(sft),
        "eval/eos_rate_sft": sum(bool(row[6]) for row in rows) / len(rows),
        "eval/score_gain_vs_sft": gain["mean"],
        "eval/score_gain_vs_sft_ci_low": gain["ci_low"],
        "eval/score_gain_vs_sft_ci_high": gain["ci_high"],
        "eval/kl_vs_sft": sum(kl) / len(kl),
        "eval/objective_gain_vs_sft": objective["mean"],
        "eval/objective_gain_vs_sft_ci_low": objective["ci_low"],
        "eval/objective_gain_vs_sft_ci_high": objective["ci_high"],
        "eval/eos_rate_policy_ci_low": low,
        "eval/eos_rate_policy_ci_high": high,
        "eval/repetition_rate_policy": repetition_rate([row[4] for row in rows])["rate"],
        "eval/repetition_rate_sft": repetition_rate([row[7] for row in rows])["rate"],
    }


def write_value_vs_reward(rows: list[dict], out_dir: str | os.PathLike, cfg: PPOConfig | None = None) -> Path:
    """Write :func:`value_vs_reward`'s rows as ``value_vs_reward.json`` (``{"responses": rows}``,
    with ``cfg`` also the settings its rewards were computed with: ``kl_coef``, ``score_position``,
    ``non_eos_penalty`` and ``whiten_rewards``, whose whitening the rows' rewards are before) to
    ``out_dir``; returns its path. The report draws them
    (:func:`rlhf_core.report.run_report.per_token_sections`): no plotting code runs in the PPO stage."""
    settings = {}
    if cfg is not None:
        keys = ("kl_coef", "score_position", "non_eos_penalty", "whiten_rewards")
        settings = {"settings": {key: getattr(cfg, key) for key in keys}}
    return write_json_atomic(Path(out_dir) / "value_vs_reward.json", {"responses": rows} | settings)
