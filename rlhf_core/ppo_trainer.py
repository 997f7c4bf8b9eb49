"""The PPO stage: RLHF fine-tuning of the SFT policy against the normalised reward model.

Follows Huang et al. (2024), Section 7 and Appendix F (Details 20-25, Table 7). Four
models: the policy and a frozen reference (both from SFT), the frozen reward model, and a
value model initialised from the reward model (Detail 22). Each update:

1. takes ``batch_size`` prompts from the shuffled SFT train split, reshuffled whenever it
   is used up (Detail 21);
2. samples exactly ``response_length`` tokens at ``temperature`` (Detail 23), never PAD,
   with the log-probabilities of policy and reference from the same distribution (logits
   divided by the temperature, PAD excluded: :func:`rlhf_core.ppo.sampling_logits`);
3. truncates after the first EOS, fills with PAD, scores with the reward model at the EOS,
   and gives responses without EOS the score ``non_eos_penalty`` (the EOS trick,
   :func:`rlhf_core.reward.score_responses`); with ``ppo.reward: python:MODULE:FUNCTION`` a
   rule reward (:mod:`rlhf_core.rule_rewards`) gives the score in place of the reward model,
   which is then not loaded (:meth:`PPOTrainer.score`);
4. forms per-token rewards (KL penalty plus the score), optionally whitens them
   (Detail 24), computes GAE advantages and whitens them (Detail 25);
5. runs ``ppo_epochs`` passes of clipped policy and value updates.

Under ``torchrun`` (:mod:`rlhf_core.launch`) each rank samples, scores and trains on its own
contiguous share of every update's prompts. What defines the algorithm is global: reward and
advantage whitening use the statistics of the whole batch
(:func:`rlhf_core.distributed.masked_mean_var`), each PPO minibatch's gradient is the mean
over all ranks' shares, and the logged rollout statistics are computed on the gathered batch.
Training statistics (losses, clip fractions, entropy) are means of the ranks' equal-sized
shares; timings and memory are rank 0's. Evaluation prompts are split over the ranks and
the results gathered; rank 0 alone logs, checkpoints and saves.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel, get_scheduler

from .config import PPOConfig
from .data import load_data_tokenizer, load_prepared
from .distributed import (
    all_gather_cat,
    all_gather_object,
    all_reduce_gradients,
    all_reduce_sum,
    masked_mean_var,
    shard,
    split_range,
    world,
)
from .generation import generate, last_token_indices, summarize, trim_left_padding, truncate_after_eos
from .io import write_json_atomic
from .models import load_causal_lm, save_pretrained_atomic
from .ppo import (
    INVALID_LOGPROB,
    compute_advantages,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    per_token_rewards,
    policy_loss,
    response_mask,
    sampling_logits,
    value_loss,
    whiten,
)
from .reward import (
    ResponseScores,
    ScalarModel,
    causal_forward,
    response_scores,
    reward_model_from_causal_lm,
    score_responses,
)
from .rule_rewards import describe_reward, load_reward_function, rule_scores
from .tracking import NullTracker, Tracker
from .training import (
    CheckpointManager,
    TrainingError,
    autocast,
    config_digest,
    enable_activation_checkpointing,
    micro_batches,
    pick_device,
    precision_name,
)

log = logging.getLogger(__name__)


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


def response_logits(model: PreTrainedModel, query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> torch.Tensor:
    """Language-model logits at the positions that predict the response tokens only.

    Args:
        query_responses: ``(batch, context_length + response_length)``, query left-padded.

    Returns:
        ``(batch, response_length, vocab)``: no full-vocabulary logits for the query.
    """
    hidden = causal_forward(
        lambda ids, mask, pos: model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                                use_cache=False).last_hidden_state,
        query_responses, pad_token_id,
    )
    return model.get_output_embeddings()(hidden[:, context_length - 1 : -1])


def response_values(value_model: ScalarModel, query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> torch.Tensor:
    """Value of the state before each response token. ``(batch, response_length)`` float32."""
    values = causal_forward(
        lambda ids, mask, pos: value_model(input_ids=ids, attention_mask=mask, position_ids=pos),
        query_responses, pad_token_id,
    )
    return values[:, context_length - 1 : -1]


def rollout_targets(
    responses: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    scored: ResponseScores,
    cfg: PPOConfig,
    eos_token_id: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Masks, per-token rewards, advantages and returns of a batch of sampled responses (Details 23-25).

    A response ends at its last real token once truncated after its first EOS: the EOS, or
    the last position when there is none (Detail 23). Up to and including that token
    (``token_mask``) the log-probabilities count and the KL penalty applies; the score lands
    on it (``cfg.score_position: eos``) or one position later (``after_eos``), and
    ``value_mask`` covers the positions up to the score. Rewards are optionally whitened
    (Detail 24) and advantages whitened (Detail 25), with the statistics of the global
    batch (every rank's share, :func:`rlhf_core.distributed.masked_mean_var`).

    Args:
        responses: ``(batch, response_length)`` sampled token ids, not truncated.
        logprobs, ref_logprobs: ``(batch, response_length)`` float32 log-probabilities of the
            sampled tokens under the policy and the reference
            (:func:`rlhf_core.ppo.logprobs_from_logits`).
        values: ``(batch, response_length)`` float32, the value before each token.
        scored: the scores of ``truncate_after_eos(responses)`` (:meth:`PPOTrainer.score`: the
            reward model's, :func:`rlhf_core.reward.score_responses`, or a rule reward's),
            ``(batch,)`` each.

    Returns:
        ``sequence_lengths`` ``(batch,)`` long (index of the last real token; 0 for a
        response that starts with PAD); ``token_mask``, ``value_mask`` ``(batch,
        response_length)`` bool; ``logprobs``, ``ref_logprobs`` (``INVALID_LOGPROB`` outside
        ``token_mask``), ``values``, ``rewards``, ``non_score_reward``, ``advantages``,
        ``returns`` ``(batch, response_length)`` float32, 0 outside their mask.
    """
    post = truncate_after_eos(responses, eos_token_id, pad_token_id)
    sequence_lengths = torch.clamp(last_token_indices(post, pad_token_id), min=0)
    token_mask = response_mask(sequence_lengths, responses.size(1))
    logprobs = torch.masked_fill(logprobs, ~token_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, ~token_mask, INVALID_LOGPROB)
    rewards, non_score_reward, value_mask = per_token_rewards(
        logprobs, ref_logprobs, scored.scores, sequence_lengths, cfg.kl_coef, cfg.score_position)
    values = values * value_mask
    if cfg.whiten_rewards:  # Detail 24
        rewards = whiten(rewards, *masked_mean_var(rewards, value_mask), shift_mean=False) * value_mask
    advantages, returns = compute_advantages(rewards, values, value_mask, cfg.gamma, cfg.lam)
    advantages = whiten(advantages, *masked_mean_var(advantages, token_mask)) * token_mask  # Detail 25
    return {"sequence_lengths": sequence_lengths, "token_mask": token_mask, "value_mask": value_mask,
            "logprobs": logprobs, "ref_logprobs": ref_logprobs, "values": values, "rewards": rewards,
            "non_score_reward": non_score_reward, "advantages": advantages, "returns": returns}


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum()) / denom if denom > 0 else 0.0


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class PPOTrainer:
    """Holds the four models and runs rollouts, updates and evaluations. See :func:`run_ppo`."""

    def __init__(self, cfg: PPOConfig, data_dir: str | os.PathLike, sft_model_dir: str | os.PathLike,
                 reward_model_dir: str | os.PathLike | None, device: torch.device | None = None):
        self.cfg = cfg
        self.reward_fn = load_reward_function(cfg.reward)  # None: the reward model scores
        if self.reward_fn is None and reward_model_dir is None:
            raise ValueError("ppo.reward 'model' needs a reward model directory (reward_model_dir is None)")
        self.device = device or pick_device()
        sft, _, self.stats = load_prepared(data_dir)
        self.sft = sft
        self.tokenizer = load_data_tokenizer(data_dir)
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        self.response_length = cfg.response_length or self.stats["padded_lengths"]["sft_response"]
        self.queries = torch.tensor(sft["train"]["query_token"])
        self.world = world()
        if cfg.batch_size % self.world.size or (cfg.batch_size // self.world.size) % cfg.num_minibatches:
            raise ValueError(f"ppo.batch_size {cfg.batch_size} must split into {self.world.size} rank(s) x "
                             f"ppo.num_minibatches {cfg.num_minibatches} equal parts")
        torch.manual_seed(cfg.seed)
        self.policy = load_causal_lm(sft_model_dir).to(self.device)
        self.ref_policy = load_causal_lm(sft_model_dir).to(self.device).eval().requires_grad_(False)
        self.reward_model = None if self.reward_fn is not None else (
            ScalarModel.from_pretrained(str(reward_model_dir)).to(self.device).eval().requires_grad_(False))
        if reward_model_dir is not None:
            self.value_model = ScalarModel.from_pretrained(str(reward_model_dir)).to(self.device)  # Detail 22
        else:  # no reward model (a rule reward): the SFT backbone with a zero head (V = 0 until it
            # learns), so the first advantages are the lambda-returns of the rewards. Detail 11's random
            # head gives SmolLM2-135M per-token values of sd ~1.3 that dwarf a score in [-1, 0].
            self.value_model = reward_model_from_causal_lm(sft_model_dir, seed=cfg.seed).to(self.device)
            nn.init.zeros_(self.value_model.head.weight)
        enable_activation_checkpointing(self.policy, cfg.gradient_checkpointing)
        enable_activation_checkpointing(self.value_model, cfg.gradient_checkpointing)
        self.models = nn.ModuleDict({"policy": self.policy, "value": self.value_model})
        self.optimizer = torch.optim.AdamW(self.models.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps)
        self.num_updates = math.ceil(cfg.total_episodes / cfg.batch_size)
        self.scheduler = get_scheduler(cfg.scheduler, self.optimizer, num_warmup_steps=0,
                                       num_training_steps=self.num_updates)
        if self.world.rank:
            torch.manual_seed(cfg.seed + self.world.rank)  # each rank samples its own responses

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def score(self, queries: torch.Tensor, responses: torch.Tensor) -> ResponseScores:
        """The score PPO maximises (``ppo.reward``), with the EOS trick (Detail 23).

        ``model``: the reward model's output at each response's last real token
        (:func:`rlhf_core.reward.score_responses`); ``python:MODULE:FUNCTION``: the function's
        value on the decoded texts and ids (:func:`rlhf_core.rule_rewards.rule_scores`). Either
        is ``raw_scores``; ``scores`` replaces it by ``ppo.non_eos_penalty`` for a response
        without EOS. Rollouts and evaluations score through here.

        Args:
            queries: ``(n, query_length)`` long token ids, left-padded.
            responses: ``(n, response_length)`` long token ids, PAD after the first EOS
                (:func:`rlhf_core.generation.truncate_after_eos`).

        Returns:
            :class:`rlhf_core.reward.ResponseScores` on the device of ``responses``.
        """
        cfg, pad, eos = self.cfg, self.pad_id, self.eos_id
        if self.reward_fn is None:
            return score_responses(self.reward_model, queries, responses, pad, eos, cfg.non_eos_penalty,
                                   cfg.micro_batch_size, cfg.bf16)
        raw = rule_scores(self.reward_fn, cfg.reward, self.tokenizer, queries, responses, pad, eos)
        return response_scores(raw.to(responses.device), responses, eos, pad, cfg.non_eos_penalty)

    # ------------------------------------------------------------------ rollout

    @torch.no_grad()
    def rollout(self, queries: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sample, score and compute advantages for one batch of left-padded queries.

        Returns tensors on the device: ``query_responses`` ``(B, C + R)``, ``responses``,
        ``logprobs``, ``ref_logprobs``, ``values``, ``rewards``, ``non_score_reward``,
        ``advantages``, ``returns`` ``(B, R)``, ``token_mask`` and ``value_mask`` ``(B, R)``
        bool, ``scores``, ``raw_scores`` ``(B,)``, ``has_eos`` ``(B,)`` bool,
        ``sequence_lengths`` ``(B,)``, and timings (see :func:`rollout_targets`).
        """
        cfg, pad, eos, R = self.cfg, self.pad_id, self.eos_id, self.response_length
        queries = trim_left_padding(queries, pad).to(self.device)
        context = queries.size(1)
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        t_gen = t_score = 0.0
        self.policy.eval()  # KV cache in generation, no activation checkpointing
        self.value_model.eval()
        for mb in micro_batches(list(range(len(queries))), cfg.micro_batch_size):
            q = queries[mb]
            t0 = time.perf_counter()
            with autocast(self.device, cfg.bf16):
                responses, logits = generate(self.policy, q, pad, R, cfg.temperature, eos_token_id=None,
                                             return_logits=True)
            logprobs = logprobs_from_logits(logits, responses, cfg.temperature, pad)
            del logits
            t1 = time.perf_counter()
            query_responses = torch.cat([q, responses], dim=1)
            post = truncate_after_eos(responses, eos, pad)
            with autocast(self.device, cfg.bf16):
                ref_logprobs = logprobs_from_logits(response_logits(self.ref_policy, query_responses, pad, context),
                                                    responses, cfg.temperature, pad)
                values = response_values(self.value_model, query_responses, pad, context)
            scored = self.score(q, post)
            t_gen += t1 - t0
            t_score += time.perf_counter() - t1
            for name, value in (("query_responses", query_responses), ("responses", responses),
                                ("logprobs", logprobs), ("ref_logprobs", ref_logprobs), ("values", values.float()),
                                ("raw_scores", scored.raw_scores), ("scores", scored.scores),
                                ("has_eos", scored.has_eos)):
                parts[name].append(value)
        batch = {k: torch.cat(v) for k, v in parts.items()}
        scored = ResponseScores(batch["raw_scores"], batch["scores"], batch["has_eos"])
        batch.update(rollout_targets(batch["responses"], batch["logprobs"], batch["ref_logprobs"], batch["values"],
                                     scored, cfg, eos, pad))
        batch.update(context_length=torch.tensor(context), time_generate=torch.tensor(t_gen),
                     time_score=torch.tensor(t_score))
        return batch

    # ------------------------------------------------------------------- update

    def train_on(self, batch: dict[str, torch.Tensor], update: int) -> dict[str, float]:
        """``ppo_epochs`` passes of clipped PPO over ``batch`` (this rank's share); returns
        statistics averaged over the minibatches and the ranks."""
        cfg, pad, ranks = self.cfg, self.pad_id, self.world.size
        context = int(batch["context_length"])
        n = batch["responses"].size(0)
        minibatch_size = max(1, n // cfg.num_minibatches)
        sums: dict[str, float] = defaultdict(float)
        ratios: list[torch.Tensor] = []
        count = 0
        self.policy.train()
        self.value_model.train()
        for epoch in range(cfg.ppo_epochs):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + update * 101 + epoch))
            for start in range(0, n, minibatch_size):
                minibatch = perm[start : start + minibatch_size].tolist()
                self.optimizer.zero_grad(set_to_none=True)
                mb_sums: dict[str, float] = defaultdict(float)
                failure = ""
                for micro in micro_batches(minibatch, cfg.micro_batch_size):
                    idx = torch.tensor(micro, device=self.device)
                    qr, resp = batch["query_responses"][idx], batch["responses"][idx]
                    token_mask, value_mask = batch["token_mask"][idx], batch["value_mask"][idx]
                    # loss = policy loss + vf_coef * value loss, and the two models share no parameters,
                    # so each part is backpropagated on its own: the policy's activations are freed
                    # before the value model's forward pass, and peak memory holds one model's only.
                    # Summed over the ranks below: the gradient of the global minibatch's mean loss.
                    scale = len(micro) / len(minibatch) / ranks
                    with autocast(self.device, cfg.bf16):
                        logits = response_logits(self.policy, qr, pad, context)
                    new_logprobs = logprobs_from_logits(logits, resp, cfg.temperature, pad)
                    new_logprobs = torch.masked_fill(new_logprobs, ~token_mask, INVALID_LOGPROB)
                    pl = policy_loss(new_logprobs, batch["logprobs"][idx], batch["advantages"][idx], token_mask, cfg.cliprange)
                    if not torch.isfinite(pl["loss"]):
                        failure = f"non-finite loss (policy {pl['loss'].item()})"
                        break
                    (pl["loss"] * scale).backward()
                    with torch.no_grad():
                        entropy = masked_mean(entropy_from_logits(sampling_logits(logits, cfg.temperature, pad)),
                                              token_mask)
                    del logits, new_logprobs
                    with autocast(self.device, cfg.bf16):
                        vpred = response_values(self.value_model, qr, pad, context)
                    vpred = vpred.float() * value_mask
                    vl = value_loss(vpred, batch["values"][idx], batch["returns"][idx], value_mask, cfg.cliprange_value)
                    if not torch.isfinite(vl["loss"]):
                        failure = f"non-finite loss (value {vl['loss'].item()})"
                        break
                    (cfg.vf_coef * vl["loss"] * scale).backward()
                    with torch.no_grad():
                        weight = len(micro) / len(minibatch)
                        for key, value in (("loss/policy", pl["loss"]), ("loss/value", vl["loss"]),
                                           ("policy/clipfrac", pl["clipfrac"]), ("policy/approxkl", pl["approxkl"]),
                                           ("val/clipfrac", vl["clipfrac"]), ("policy/entropy", entropy)):
                            mb_sums[key] += value.item() * weight
                        ratios.append(pl["ratio"][token_mask].detach().float().cpu())
                if all_reduce_sum([1.0 if failure else 0.0])[0]:  # every rank stops together
                    raise _NonFinite(failure or "non-finite loss on another rank")
                all_reduce_gradients(self.models)
                self.optimizer.step()
                for key, value in mb_sums.items():
                    sums[key] += value
                count += 1
        keys = sorted(sums)
        all_ratios = torch.cat(ratios).double()
        reduced = all_reduce_sum([sums[k] for k in keys] + [all_ratios.sum().item(), all_ratios.numel()])
        out = {k: v / (count * ranks) for k, v in zip(keys, reduced)}
        ratio_mean = reduced[-2] / reduced[-1]
        (ratio_sq,) = all_reduce_sum([((all_ratios - ratio_mean) ** 2).sum().item()])
        out["val/ratio"] = ratio_mean
        out["val/ratio_var"] = ratio_sq / (reduced[-1] - 1) if reduced[-1] > 1 else 0.0
        return out

    # --------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(self, split: str = "validation") -> tuple[dict[str, float], list[dict]]:
        """Near-greedy policy summaries on held-out prompts, scored as in training (:meth:`score`:
        the reward model, or the rule reward of ``ppo.reward``) against the references.

        ``eval/score_policy`` is the mean score with the EOS trick (``non_eos_penalty`` for a
        summary without EOS, Detail 23), the score PPO optimises; ``eval/raw_score_policy``
        the mean score without the trick (the reward model's own output) and ``eval/eos_rate_policy`` the share of
        summaries that end with EOS. The references always end with EOS. The prompts are split
        over the ranks and the results gathered, in order, on every rank.
        """
        cfg = self.cfg
        ds = self.sft[split]
        ds = ds.select(range(min(len(ds), cfg.eval_max_samples or len(ds))))
        mine = ds.select(split_range(len(ds), self.world))
        rows: list[tuple[float, float, bool, float, str]] = []
        self.policy.eval()
        if len(mine):
            queries = torch.tensor(mine["query_token"])
            references = torch.tensor(mine["reference_response_token"])
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                # the same samples every time, training's RNG untouched
                summaries = summarize(self.policy, self.tokenizer, queries, self.response_length, cfg.eval_temperature,
                                      cfg.micro_batch_size, cfg.seed + self.world.rank, cfg.bf16)
            policy = self.score(queries, summaries.responses)
            reference = self.score(queries, references)
            rows = list(zip(policy.scores.tolist(), policy.raw_scores.tolist(), policy.has_eos.tolist(),
                            reference.scores.tolist(), summaries.texts))
        rows = [row for rank_rows in all_gather_object(rows) for row in rank_rows]
        sp, raw, has_eos, sr = (torch.tensor([row[i] for row in rows], dtype=torch.float64) for i in range(4))
        metrics = {
            "eval/score_policy": sp.mean().item(),
            "eval/raw_score_policy": raw.mean().item(),
            "eval/eos_rate_policy": has_eos.mean().item(),
            "eval/score_reference": sr.mean().item(),
            "eval/rm_win_rate_vs_reference": (sp > sr).double().mean().item(),
        }
        samples = [{"post": p, "reference": r.strip(), "policy": row[4], "score_policy": row[0],
                    "raw_score_policy": row[1], "score_reference": row[3]}
                   for p, r, row in zip(ds["post"], ds["reference_response"], rows)]
        return metrics, samples


class _NonFinite(RuntimeError):
    pass


def _rollout_metrics(local: dict[str, torch.Tensor]) -> dict[str, float]:
    """Statistics of the global batch: every rank's share gathered (the identity on one rank)."""
    batch = {k: all_gather_cat(local[k]) for k in ("token_mask", "value_mask", "logprobs", "ref_logprobs",
                                                    "non_score_reward", "sequence_lengths", "scores", "returns",
                                                    "advantages", "has_eos")}
    token_mask = batch["token_mask"]
    kl = ((batch["logprobs"] - batch["ref_logprobs"]) * token_mask).sum(1)
    non_score = batch["non_score_reward"].sum(1)
    lengths = (batch["sequence_lengths"] + 1).float()
    return {
        "objective/scores": batch["scores"].mean().item(),
        "objective/kl": kl.mean().item(),  # nats per response
        "objective/kl_per_token": (kl.sum() / token_mask.sum().clamp(min=1)).item(),
        "objective/entropy": (-batch["logprobs"] * token_mask).sum(1).mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        "objective/rlhf_reward": (batch["scores"] + non_score).mean().item(),
        "returns/mean": masked_mean(batch["returns"], batch["value_mask"]).item(),
        "returns/var": masked_var(batch["returns"], batch["value_mask"]).item(),
        "advantages/mean": masked_mean(batch["advantages"], token_mask).item(),
        "advantages/var": masked_var(batch["advantages"], token_mask).item(),
        "advantages/min": batch["advantages"][token_mask].min().item(),
        "advantages/max": batch["advantages"][token_mask].max().item(),
        "response/length_mean": lengths.mean().item(),
        "response/length_score_corr": _pearson(lengths, batch["scores"]),
        "response/no_eos_fraction": 1.0 - batch["has_eos"].float().mean().item(),
        "response/eos_rate": batch["has_eos"].float().mean().item(),
    }


def run_ppo(
    cfg: PPOConfig,
    data_dir: str | os.PathLike,
    sft_model_dir: str | os.PathLike,
    reward_model_dir: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
) -> dict[str, float]:
    """Run (or resume) PPO and write ``out_dir/model`` (the policy), ``out_dir/value_model``,
    ``out_dir/samples.jsonl`` (the last evaluation) and ``out_dir/metrics.json``.

    ``reward_model_dir`` is the reward model (``ppo.reward: model``) and the value model's
    initialisation (Detail 22); with a rule reward (``ppo.reward: python:...``) it may be
    ``None``, and the value model starts from the SFT backbone with a zero head (values 0). The
    resolved reward is logged as the param ``ppo.reward_resolved``.

    Checkpoints (policy, value, optimiser, schedule, RNG, update count) are written to
    ``out_dir/checkpoints`` every ``cfg.checkpoint_every`` updates; a restarted run with the
    same configuration continues from the newest.

    Returns:
        The metrics of the last update and the final evaluation (flat keys).

    Raises:
        TrainingError: non-finite scores, rewards or losses (naming the update, after a
            checkpoint of the last good state), or a checkpoint of another configuration.
    """
    tracker = tracker or NullTracker()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = PPOTrainer(cfg, data_dir, sft_model_dir, reward_model_dir)
    w = trainer.world
    if not w.is_main:
        tracker = NullTracker()
    digest = config_digest(cfg.model_dump_json(), json.dumps(trainer.stats, sort_keys=True),
                     str(Path(sft_model_dir).resolve()),
                     str(Path(reward_model_dir).resolve()) if reward_model_dir is not None else "none")
    checkpoints = CheckpointManager(out_dir / "checkpoints", digest)
    resumed = checkpoints.load_latest(trainer.models, trainer.optimizer, trainer.scheduler)
    start = resumed["step"] if resumed else 0
    rank_rng = (resumed or {}).get("extra", {}).get("rank_rng") or []
    if len(rank_rng) == w.size:
        torch.set_rng_state(rank_rng[w.rank])  # each rank continues its own sampling stream

    def save_checkpoint(step: int) -> None:  # collective: every rank calls it, rank 0 writes
        states = all_gather_object(torch.get_rng_state())
        checkpoints.save(step, trainer.models, trainer.optimizer, trainer.scheduler, extra={"rank_rng": states})

    tracker.log_params({f"ppo.{k}": v for k, v in cfg.model_dump().items()}
                      | {"ppo.response_length_used": trainer.response_length,
                         "ppo.reward_resolved": describe_reward(cfg.reward, reward_model_dir),
                         "ppo.precision": precision_name(cfg.bf16, trainer.device)})
    interactive = sys.stderr.isatty() and w.is_main
    bar = tqdm(total=trainer.num_updates, initial=start, desc="ppo", disable=not interactive, dynamic_ncols=True)
    log_every = max(1, trainer.num_updates // 20)
    last: dict[str, float] = {}
    samples: list[dict] = []
    begin = time.perf_counter()
    n_rows = len(trainer.queries)
    for update in range(start, trainer.num_updates):
        idx = shard(prompt_indices(n_rows, cfg.batch_size, update, cfg.seed), w)
        batch = trainer.rollout(trainer.queries[idx])
        try:
            bad = [name for name in ("scores", "rewards", "advantages", "values") if not torch.isfinite(batch[name]).all()]
            if all_reduce_sum([len(bad)])[0]:
                raise _NonFinite(f"non-finite {bad[0]}" if bad else "non-finite rollout on another rank")
            t0 = time.perf_counter()
            train_stats = trainer.train_on(batch, update)
        except _NonFinite as exc:
            save_checkpoint(update)
            raise TrainingError(f"ppo: {exc} at update {update + 1}; parameters from before the failing step "
                                f"saved in {checkpoints.root}") from None
        t_train = time.perf_counter() - t0
        lr = trainer.scheduler.get_last_lr()[0]
        trainer.scheduler.step()
        generated = batch["responses"].numel() * w.size
        metrics = _rollout_metrics(batch) | train_stats | {
            "lr": lr,
            "episodes": float((update + 1) * cfg.batch_size),
            "time/generate": float(batch["time_generate"]),
            "time/score": float(batch["time_score"]),
            "time/train": t_train,
            "time/generate_tokens_per_s": generated / max(float(batch["time_generate"]), 1e-9),
            "time/train_tokens_per_s": cfg.ppo_epochs * all_reduce_sum([batch["token_mask"].sum().item()])[0]
            / max(t_train, 1e-9),
            "memory/peak_mb": _peak_memory_mb(trainer.device),
        }
        if (update + 1) % cfg.eval_every == 0 or update + 1 == trainer.num_updates:
            eval_metrics, samples = trainer.evaluate()
            metrics |= eval_metrics
            tracker.log_table("ppo_samples", samples[:16])
        tracker.log_metrics(metrics, step=update + 1)
        last = metrics
        bar.update(1)
        bar.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
        if not interactive and w.is_main and ((update + 1) % log_every == 0 or update + 1 == trainer.num_updates):
            log.info("ppo update %d/%d: score %.3f kl %.3f no-eos %.2f len %.1f (%.0f s)", update + 1,
                     trainer.num_updates, metrics["objective/scores"], metrics["objective/kl"],
                     metrics["response/no_eos_fraction"], metrics["response/length_mean"],
                     metrics["time/generate"] + metrics["time/score"] + t_train)
        if (update + 1) % cfg.checkpoint_every == 0 and update + 1 < trainer.num_updates:
            save_checkpoint(update + 1)
    bar.close()
    if not samples:  # resumed after the last update: evaluate once more
        eval_metrics, samples = trainer.evaluate()
        last |= eval_metrics
    if not w.is_main:
        return {}  # rank 0 saves
    trainer.policy.eval()
    save_pretrained_atomic(trainer.policy, out_dir / "model", trainer.tokenizer)
    save_pretrained_atomic(trainer.value_model, out_dir / "value_model")
    with open(out_dir / "samples.jsonl", "w") as fh:
        fh.writelines(json.dumps(s) + "\n" for s in samples)
    last = dict(last, **{"ppo/updates": float(trainer.num_updates), "ppo/seconds": time.perf_counter() - begin})
    write_json_atomic(out_dir / "metrics.json", last)
    return last
