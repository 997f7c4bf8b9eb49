"""The PPO stage: RLHF fine-tuning of the SFT policy against the normalised reward model.

Follows Huang et al. (2024), Section 7 and Appendix F (Details 20-25, Table 7). Four
models: the policy and a frozen reference (both from SFT), the frozen reward model, and a
value model initialised from the reward model (Detail 22). Each update is four steps, each
one call in :func:`run_ppo`'s loop:

1. generate the trajectory (:meth:`PPOTrainer.generate_trajectory`, a
   :class:`rlhf_core.ppo.algorithm.Trajectory` built by :func:`rlhf_core.ppo.algorithm.make_trajectory`): ``batch_size`` prompts from the shuffled SFT
   train split (or the prompt-only ``prompt/train`` of ``data.prompt_splits``), reshuffled
   whenever it is used up (Detail 21); exactly ``response_length``
   tokens sampled at ``temperature``, never PAD, with the log-probabilities of policy and
   reference from the same distribution (logits divided by the temperature, PAD excluded:
   :func:`rlhf_core.ppo.algorithm.sampling_logits`) and the values (Detail 23); each response truncated
   after its first EOS, PAD after it, and scored at the EOS, a response without EOS getting
   ``non_eos_penalty`` (the EOS trick, :meth:`PPOTrainer.score`, applied in
   :func:`rlhf_core.train.reward.response_scores`: the reward model, or with
   ``ppo.reward: python:MODULE:FUNCTION`` a rule reward (:mod:`rlhf_core.train.rule_rewards`), and
   then no reward model is loaded);
2. per-token rewards, the KL penalty plus the score, optionally whitened (Detail 24;
   :func:`rlhf_core.ppo.algorithm.kl_penalised_rewards`);
3. GAE advantages and returns, the advantages whitened (Detail 25), or with
   ``ppo.advantage_estimator`` rloo or grpo a baseline over each prompt's ``samples_per_prompt``
   samples and no value model (:func:`rlhf_core.ppo.algorithm.estimate_advantages`);
4. ``ppo_epochs`` passes of clipped policy and value updates over minibatches
   (:meth:`PPOTrainer.optimise`; the loss :func:`rlhf_core.ppo.algorithm.ppo_loss`).

Under ``torchrun`` (:mod:`rlhf_core.run.launch`) each rank samples, scores and trains on its own
contiguous share of every update's prompts. What defines the algorithm is global: reward and
advantage whitening use the statistics of the whole batch (:func:`rlhf_core.ppo.algorithm.masked_mean_var`), each PPO
minibatch's gradient is the mean over all ranks' shares, and the logged rollout statistics are
computed on the gathered batch. Training statistics (losses, clip fractions, entropy) are means
of the ranks' equal-sized shares; timings and memory are rank 0's. Evaluation prompts
(:mod:`rlhf_core.ppo.eval`) are split over the ranks and the results gathered; rank 0 alone
logs, checkpoints and saves. ``ppo.strategy`` picks how the models are held
(:class:`rlhf_core.train.distributed.DataParallel`): ``ddp`` keeps all four whole on every rank;
``zero2`` shards the policy's and value model's gradients and optimiser state; ``fsdp`` shards
their parameters too, and the reference and reward models'. Under either sharded strategy the
policy is gathered whole for sampling (each rank samples its own responses) and for evaluation,
which every rank then runs without communicating.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import get_scheduler

from ..common.io import write_json_atomic, write_jsonl_atomic
from ..common.tracking import NullTracker, Tracker
from ..config.settings import PPOConfig
from ..data.prepared import load_data_tokenizer, load_prepared, ppo_query_tokens
from ..models.saved import load_causal_lm
from ..train.distributed import all_gather_object, all_reduce_sum, gather_to_main, world
from ..train.forward import response_logits, response_values
from ..train.generation import generate, trim_left_padding, truncate_after_eos
from ..train.reward import TOKEN_TABLE_RESPONSES, ResponseScores, ScalarModel, score_responses
from ..train.rule_rewards import RuleReward, describe_reward, load_reward_function
from ..train.trainer import save_trained
from ..train.training import (
    StepProgress,
    adamw,
    autocast,
    device_clock,
    micro_batches,
    pick_device,
    trainer_checkpoints,
)
from .algorithm import (
    INVALID_LOGPROB,
    Minibatch,
    Trajectory,
    entropy_from_logits,
    estimate_advantages,
    kl_penalised_rewards,
    logprobs_from_logits,
    make_trajectory,
    masked_mean,
    ppo_loss,
    sampling_logits,
)
from .eval import evaluate_policy, value_vs_reward, write_value_vs_reward
from .models import build_models, initial_value_model
from .rollout import PPOStats, reduce_stats, rollout_rows, rollout_statistics, throughput_statistics

log = logging.getLogger(__name__)


class PPOTrainer:
    """Holds the four models and runs rollouts, updates and evaluations. See :func:`run_ppo`.

    With ``ppo.lora.r`` above 0 it holds three: the policy and the value model train low-rank
    adapters (:func:`rlhf_core.train.lora.add_lora`), and the reference policy is the policy with its
    adapters off (``ref_parallel`` is a :class:`rlhf_core.train.lora.AdaptersDisabled`; ``ref_policy``
    is ``None``). With a critic-free ``ppo.advantage_estimator`` (rloo, grpo) there is no value
    model (``value_model``, ``value_parallel`` and ``value_adapted`` are ``None``). With
    ``ppo.offload_frozen`` the frozen models (reference policy, reward model) live in CPU memory
    between their forward passes (Detail 8, :mod:`rlhf_core.train.offload`)."""

    def __init__(
        self,
        cfg: PPOConfig,
        data_dir: str | os.PathLike,
        sft_model_dir: str | os.PathLike,
        reward_model_dir: str | os.PathLike | None,
        device: torch.device | None = None,
    ):
        self.cfg = cfg
        reward_fn = load_reward_function(cfg.reward)  # None: the reward model scores
        if reward_fn is None and reward_model_dir is None:
            raise ValueError("ppo.reward 'model' needs a reward model directory (reward_model_dir is None)")
        self.device = device or pick_device()
        sft, _, self.stats = load_prepared(data_dir)
        self.sft = sft
        self.tokenizer = load_data_tokenizer(data_dir)
        self.rule_reward = None if reward_fn is None else RuleReward(reward_fn, cfg.reward, self.tokenizer)
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        self.response_length = cfg.response_length or self.stats["padded_lengths"]["sft_response"]
        self.rollout_batch_size = cfg.rollout_batch_size or cfg.micro_batch_size
        self.queries = torch.tensor(ppo_query_tokens(data_dir, sft, self.stats))
        self.world = world()
        prompts = cfg.batch_size // cfg.samples_per_prompt
        if prompts % self.world.size or (cfg.batch_size // self.world.size) % cfg.num_minibatches:
            raise ValueError(
                f"ppo.batch_size {cfg.batch_size} must split into {self.world.size} rank(s) x "
                f"ppo.num_minibatches {cfg.num_minibatches} equal parts, with each prompt's "
                f"ppo.samples_per_prompt {cfg.samples_per_prompt} samples on one rank"
            )
        torch.manual_seed(cfg.seed)
        self.sft_model_dir, self.reward_model_dir = sft_model_dir, reward_model_dir
        # this rank's queries and summaries of the last evaluate(), (n, query_length) and (n, R)
        self.eval_responses: tuple[torch.Tensor, torch.Tensor] | None = None
        m = build_models(cfg, data_dir, sft_model_dir, reward_model_dir, self.tokenizer, self.device, reward_fn is None)
        self.policy, self.ref_policy, self.value_model = m.policy, m.ref_policy, m.value_model
        self.reward_model, self.models = m.reward_model, m.models
        self.policy_adapted, self.value_adapted = m.policy_adapted, m.value_adapted
        self.policy_parallel, self.ref_parallel = m.policy_parallel, m.ref_parallel
        self.value_parallel, self.reward_parallel = m.value_parallel, m.reward_parallel
        trained = [p for p in self.models.parameters() if p.requires_grad]  # all, or the adapters and value head
        self.optimizer = adamw(trained, lr=cfg.learning_rate, eps=cfg.adam_eps)
        self.num_updates = math.ceil(cfg.total_episodes / cfg.batch_size)
        self.scheduler = get_scheduler(
            cfg.scheduler, self.optimizer, num_warmup_steps=0, num_training_steps=self.num_updates
        )
        if self.world.rank:
            torch.manual_seed(cfg.seed + self.world.rank)  # each rank samples its own responses

    def initial_value_model(self) -> ScalarModel:
        """The value model before training, on the CPU (:func:`initial_value_model`)."""
        return initial_value_model(self.cfg, self.sft_model_dir, self.reward_model_dir, self.reward_model)

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def score(self, queries: torch.Tensor, responses: torch.Tensor) -> ResponseScores:
        """The score PPO maximises (``ppo.reward``), with the EOS trick (Detail 23), through
        :func:`rlhf_core.train.reward.score_responses`: the reward model's output at each response's
        last real token; an existing reward model's (``model:SOURCE``) on the decoded texts,
        re-encoded by its tokenizer; or a rule reward's value on the decoded texts and ids
        (``python:MODULE:FUNCTION``, a :class:`rlhf_core.train.rule_rewards.RuleReward`). Rollouts
        and evaluations score through here.

        Args:
            queries: ``(n, query_length)`` long token ids, left-padded.
            responses: ``(n, response_length)`` long token ids, PAD after the first EOS
                (:func:`rlhf_core.train.generation.truncate_after_eos`).

        Returns:
            :class:`rlhf_core.train.reward.ResponseScores` on the device of ``responses``.
        """
        cfg = self.cfg
        args = (queries, responses, self.pad_id, self.eos_id, cfg.non_eos_penalty, self.rollout_batch_size, cfg.bf16)
        if self.rule_reward is not None:
            return score_responses(self.rule_reward, *args)
        return self.reward_parallel.inference(score_responses, *args)  # type: ignore[union-attr]

    # --------------------------------------------------------- step 1: rollout

    @torch.no_grad()
    def generate_trajectory(self, queries: torch.Tensor) -> Trajectory:
        """Sample ``response_length`` tokens for each of this rank's left-padded ``queries``
        (``(B, query_length)`` long) and compute what PPO needs of them, in micro-batches of
        ``ppo.rollout_batch_size`` (unset: ``ppo.micro_batch_size``): the log-probs of the policy
        and the reference, the values, and the scores of the responses truncated after their
        first EOS (:meth:`score`)."""
        cfg, pad, eos, R = self.cfg, self.pad_id, self.eos_id, self.response_length
        queries = trim_left_padding(queries, pad).to(self.device)
        context = queries.size(1)
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        t_gen = t_score = 0.0
        self.policy.eval()  # KV cache in generation, no activation checkpointing
        if self.value_model is not None:
            self.value_model.eval()
        # A sharded policy is gathered once for all of this rank's samples; the other models'
        # forward passes, as many on every rank, gather block by block (DataParallel.inference).
        with self.policy_parallel.gathered():
            for mb in micro_batches(list(range(len(queries))), self.rollout_batch_size):
                q = queries[mb]
                t0 = device_clock(self.device)
                with autocast(self.device, cfg.bf16):
                    responses, logits = self.policy_parallel.inference(
                        generate, q, pad, R, cfg.temperature, eos_token_id=None, return_logits=True
                    )
                logprobs = logprobs_from_logits(logits, responses, cfg.temperature, pad)
                del logits
                t1 = device_clock(self.device)
                query_responses = torch.cat([q, responses], dim=1)
                with autocast(self.device, cfg.bf16):
                    ref_logits = self.ref_parallel.inference(response_logits, query_responses, pad, context)
                    ref_logprobs = logprobs_from_logits(ref_logits, responses, cfg.temperature, pad)
                    del ref_logits
                    if self.value_parallel is not None:
                        values = self.value_parallel.inference(response_values, query_responses, pad, context)
                        parts["values"].append(values.float())
                scored = self.score(q, truncate_after_eos(responses, eos, pad))
                t_gen += t1 - t0
                t_score += device_clock(self.device) - t1
                for name, value in (
                    ("query_responses", query_responses),
                    ("responses", responses),
                    ("logprobs", logprobs),
                    ("ref_logprobs", ref_logprobs),
                    ("raw_scores", scored.raw_scores),
                    ("scores", scored.scores),
                    ("has_eos", scored.has_eos),
                ):
                    parts[name].append(value)
        batch = {k: torch.cat(v) for k, v in parts.items()}
        scored = ResponseScores(batch.pop("raw_scores"), batch.pop("scores"), batch.pop("has_eos"))
        values = batch.pop("values", None)  # none without a value model
        return make_trajectory(
            **batch,
            values=values,
            scored=scored,
            context_length=context,
            eos_token_id=eos,
            pad_token_id=pad,
            time_generate=t_gen,
            time_score=t_score,
        )

    # -------------------------------------------------------- step 4: optimise

    def optimise(self, traj: Trajectory, update: int) -> PPOStats:
        """``ppo_epochs`` passes over this rank's share of the batch, each in ``num_minibatches``
        shuffled minibatches with one optimiser step per minibatch (Table 7).

        Args:
            traj: the update's :class:`Trajectory` after step 3 (its log-probs and values are the
                old policy's).
            update: 0-based update number (seeds the minibatch order).

        Returns:
            :class:`rlhf_core.ppo.rollout.PPOStats`, averaged over the minibatches and the ranks.

        Raises:
            _NonFinite: a loss was not finite on some rank (every rank raises together, before
                the minibatch's optimiser step: the parameters are the last good ones).
        """
        cfg, ranks = self.cfg, self.world.size
        n = traj.responses.size(0)
        minibatch_size = max(1, n // cfg.num_minibatches)
        # statistics stay on the device until the update ends: the host waits once per minibatch
        sums: dict[str, torch.Tensor] = {}
        ratios: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        steps = 0
        parallels = [p for p in (self.policy_parallel, self.value_parallel) if p is not None]
        for model in self.models.values():
            model.train()
        for epoch in range(cfg.ppo_epochs):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + update * 101 + epoch))
            on_device = perm.to(self.device)  # sliced into each micro-batch's indices without a copy per micro-batch
            for start in range(0, n, minibatch_size):
                end = min(start + minibatch_size, n)  # the minibatch: perm[start:end]
                mb_sums: dict[str, torch.Tensor] = {}
                micros = list(micro_batches(list(range(start, end)), cfg.micro_batch_size))  # positions in perm
                # the whole minibatch's rows and response tokens over the ranks, which a loss_type
                # other than the paper's divides by (rlhf_core.ppo.algorithm.aggregate_loss)
                sizes = (
                    (end - start, 0)
                    if cfg.loss_type == "paper"
                    else tuple(all_reduce_sum([end - start, traj.token_mask[on_device[start:end]].sum().item()]))
                )
                # the last micro-batch's backward passes sum each model's gradients over the ranks:
                # with each micro-batch's share, the global minibatch's mean gradient
                for micro, *_ in zip(*(parallel.accumulate(micros) for parallel in parallels)):
                    batch = traj[on_device[micro[0] : micro[-1] + 1]]
                    share = len(micro) / (end - start) / ranks
                    stats, ratio = self._ppo_step(batch, Minibatch(share, *sizes))
                    for key, value in stats.items():  # float64, the operations Python floats would do
                        mb_sums[key] = mb_sums.get(key, 0.0) + value.detach().double() * len(micro) / (end - start)
                    ratios.append(ratio)
                    masks.append(batch.token_mask)
                names = {"loss (policy)": "policy_loss", "loss (value)": "value_loss", "loss (KL)": "kl_loss"}
                _raise_if_non_finite(**{name: mb_sums.get(key) for name, key in names.items()})
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)  # no gradients held while sampling
                for key, value in mb_sums.items():
                    sums[key] = sums.get(key, 0.0) + value
                steps += 1
        ratios_on_tokens = torch.cat(ratios)[torch.cat(masks)].double().cpu()
        return reduce_stats({k: v.item() for k, v in sums.items()}, steps, ratios_on_tokens)

    def _ppo_step(self, batch: Trajectory, minibatch: Minibatch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Backpropagate the micro-batch ``batch``'s share of PPO's loss
        (:func:`rlhf_core.ppo.algorithm.ppo_loss`; ``minibatch``: its share of the minibatch's
        rows over the ranks, and the minibatch's counts): the forward passes, then each model's
        part of the loss backpropagated on its own.

        Returns:
            ``(stats, ratio)``: the loss's statistics and the entropy as scalar tensors on the
            device, and ``(rows, R)`` probability ratios (read on ``batch.token_mask``). A
            non-finite loss is backpropagated like any other (every rank joins every gradient
            all-reduce); :meth:`optimise` checks the losses before stepping.
        """
        cfg, pad, context = self.cfg, self.pad_id, batch.context_length
        qr, resp, token_mask = batch.query_responses, batch.responses, batch.token_mask
        # The policy's activations are freed before the value model's forward pass.
        with autocast(self.device, cfg.bf16):
            logits = self.policy_parallel(response_logits, qr, pad, context)
        new_logprobs = logprobs_from_logits(logits, resp, cfg.temperature, pad)
        new_logprobs = torch.masked_fill(new_logprobs, ~token_mask, INVALID_LOGPROB)
        loss, stats = ppo_loss(batch, new_logprobs, None, cfg, minibatch)
        loss.backward()
        with torch.no_grad():
            stats["entropy"] = masked_mean(
                entropy_from_logits(sampling_logits(logits, cfg.temperature, pad)), token_mask
            )
        del logits, new_logprobs
        ratio = stats.pop("ratio").detach().float()
        if self.value_parallel is not None:
            with autocast(self.device, cfg.bf16):
                vpred = self.value_parallel(response_values, qr, pad, context)
            loss, value_stats = ppo_loss(batch, None, vpred.float() * batch.value_mask, cfg, minibatch)
            loss.backward()
            stats |= value_stats
        return stats, ratio

    # --------------------------------------------------------------- evaluation

    def evaluate(self, split: str = "validation", against_sft: bool = False) -> tuple[dict[str, float], list[dict]]:
        """Evaluate the policy on held-out prompts (:func:`rlhf_core.ppo.eval.evaluate_policy`),
        keeping this rank's summaries for :meth:`value_vs_reward`."""
        metrics, samples, responses = evaluate_policy(self, split, against_sft)
        if responses is not None:
            self.eval_responses = responses
        return metrics, samples

    def value_vs_reward(self, n: int = TOKEN_TABLE_RESPONSES) -> list[dict] | None:
        """The value-vs-reward diagnostic of the last :meth:`evaluate`'s first ``n`` summaries
        (:func:`rlhf_core.ppo.eval.value_vs_reward`; Detail 22). Collective: every rank calls it."""
        return value_vs_reward(self, self.eval_responses, n)


class _NonFinite(RuntimeError):
    pass


def _raise_if_non_finite(**tensors: torch.Tensor | None) -> None:
    """Raise :class:`_NonFinite` on every rank when any rank has a non-finite value in ``tensors``
    (``None``, a value model's tensor without one, is skipped)."""
    bad = [name for name, t in tensors.items() if t is not None and not torch.isfinite(t).all()]
    if all_reduce_sum([len(bad)])[0]:
        raise _NonFinite(f"non-finite {bad[0]}" if bad else "non-finite value on another rank")


def _progress_summary(metrics: dict[str, float]) -> dict[str, str]:
    """The few figures of an update shown on the progress bar and in log lines."""
    seconds = metrics["time/generate"] + metrics["time/score"] + metrics["time/train"]
    return {
        "score": f"{metrics['objective/scores']:.3f}",
        "kl": f"{metrics['objective/kl']:.3f}",
        "no-eos": f"{metrics['response/no_eos_fraction']:.2f}",
        "len": f"{metrics['response/length_mean']:.1f}",
        "s": f"{seconds:.0f}",
    }


def run_ppo(
    cfg: PPOConfig,
    data_dir: str | os.PathLike,
    sft_model_dir: str | os.PathLike,
    reward_model_dir: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
) -> dict[str, float]:
    """Run (or resume) PPO and write ``out_dir/model`` (the policy), ``out_dir/value_model``
    (``ppo.advantage_estimator: gae`` only; with ``ppo.lora.r`` above 0 both merged, their adapters in ``out_dir/adapter`` and
    ``out_dir/value_adapter``: :mod:`rlhf_core.train.lora`),
    ``out_dir/samples.jsonl`` (the last evaluation), ``out_dir/metrics.json`` and, with a reward
    model and a value model, ``out_dir/value_vs_reward.json``: the trained value model's and the
    reward model's outputs at every token of the first few evaluation summaries (Detail 22), with
    PPO's per-token rewards and values of the same summaries (Figure 11;
    :meth:`PPOTrainer.value_vs_reward`, :func:`rlhf_core.ppo.eval.write_value_vs_reward`).

    ``reward_model_dir`` is the reward model (``ppo.reward: model``) and the value model's
    initialisation (Detail 22); with a rule reward (``ppo.reward: python:...``) it may be
    ``None``, and the value model starts from the SFT backbone with a zero head (values 0). The
    resolved reward is logged as the param ``ppo.reward_resolved``.

    Checkpoints (policy, value, optimiser, schedule, RNG, update count) are written to
    ``out_dir/checkpoints`` every ``cfg.checkpoint_every`` updates or, when that is unset, every
    ``cfg.checkpoint_every_minutes`` minutes (:meth:`rlhf_core.train.training.StepProgress.checkpoint_due`),
    the newest ``cfg.keep_checkpoints`` kept; a restarted run with the same configuration
    continues from the newest.

    Returns:
        The metrics of the last update and the final evaluation (flat keys).

    Raises:
        TrainingError: non-finite scores, rewards or losses (naming the update, after a
            checkpoint of the last good state), or a checkpoint of another configuration.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = PPOTrainer(cfg, data_dir, sft_model_dir, reward_model_dir)
    w = trainer.world
    tracker = (tracker or NullTracker()) if w.is_main else NullTracker()
    progress, start = _ppo_progress(trainer, sft_model_dir, reward_model_dir, out_dir, tracker)
    last: dict[str, float] = {}
    samples: list[dict] = []
    begin = time.perf_counter()
    for update in range(start, trainer.num_updates):
        # step 1. the trajectory: this rank's prompts (Detail 21), each samples_per_prompt times,
        #         the sampled responses ended at their first EOS, the log-probs of policy and
        #         reference, the values, and the scores with the EOS trick (Details 12, 23)
        traj = trainer.generate_trajectory(trainer.queries[rollout_rows(len(trainer.queries), cfg, update, w)])
        # step 2. per-token rewards: the KL penalty on each token plus the score at the last one,
        #         optionally whitened (Detail 24)
        traj = kl_penalised_rewards(traj, cfg)
        # step 3. advantages: GAE's with its returns, whitened (Detail 25), or a critic-free
        #         group baseline over each prompt's samples (ppo.advantage_estimator)
        traj = estimate_advantages(traj, cfg)
        # step 4. optimise: ppo_epochs passes of the clipped policy and value losses over minibatches
        t0 = device_clock(trainer.device)
        try:
            _raise_if_non_finite(
                scores=traj.scores, rewards=traj.rewards, advantages=traj.advantages, values=traj.values
            )
            stats = trainer.optimise(traj, update)
        except _NonFinite as exc:
            raise progress.stop(str(exc), update) from None
        t_train = device_clock(trainer.device) - t0
        lr = trainer.scheduler.get_last_lr()[0]
        trainer.scheduler.step()

        # plumbing: statistics, evaluation, logging, checkpoints
        metrics = (
            rollout_statistics(traj)
            | stats.metrics()
            | throughput_statistics(traj, t_train, cfg.ppo_epochs, trainer.device)
            | {"lr": lr, "episodes": float((update + 1) * cfg.batch_size)}
        )
        if (update + 1) % cfg.eval_every == 0 or update + 1 == trainer.num_updates:
            eval_metrics, samples = trainer.evaluate(against_sft=update + 1 == trainer.num_updates)
            metrics |= eval_metrics
            tracker.log_table("ppo_samples", samples[:16])
        last = metrics
        progress.report(update + 1, metrics, _progress_summary(metrics))
    progress.close()
    if not samples:  # resumed after the last update: evaluate once more
        eval_metrics, samples = trainer.evaluate(against_sft=True)
        last |= eval_metrics
    return _finish_ppo(trainer, sft_model_dir, out_dir, tracker, samples, last, begin)


def _ppo_progress(
    trainer: PPOTrainer,
    sft_model_dir: str | os.PathLike,
    reward_model_dir: str | os.PathLike | None,
    out_dir: Path,
    tracker: Tracker,
) -> tuple[StepProgress, int]:
    """The settings of a PPO run logged, its newest checkpoint of the same settings and inputs
    restored (each rank's sampling stream with it), and the :class:`rlhf_core.train.training.StepProgress`
    that reports its updates and saves the next checkpoints (collective: every rank saves its
    random state, rank 0 writes).

    Returns:
        ``(progress, start)``: ``start`` updates are done (0 for a fresh run).
    """
    cfg, w = trainer.cfg, trainer.world
    inputs = [
        trainer.stats,
        str(Path(sft_model_dir).resolve()),
        str(Path(reward_model_dir).resolve()) if reward_model_dir is not None else None,
    ]
    extra_params = {
        "ppo.response_length_used": trainer.response_length,
        "ppo.reward_resolved": describe_reward(cfg.reward, reward_model_dir),
    }
    checkpoints = trainer_checkpoints("ppo", cfg, trainer.device, out_dir, inputs, tracker, extra_params)
    resumed = checkpoints.load_latest(trainer.models, trainer.optimizer, trainer.scheduler)
    start = resumed["step"] if resumed else 0
    rank_rng = (resumed or {}).get("extra", {}).get("rank_rng") or []
    if len(rank_rng) == w.size:
        torch.set_rng_state(rank_rng[w.rank])  # each rank continues its own sampling stream

    def save_checkpoint(step: int) -> None:  # collective: every rank calls it, rank 0 writes
        states = all_gather_object(torch.get_rng_state())
        checkpoints.save(step, trainer.models, trainer.optimizer, trainer.scheduler, extra={"rank_rng": states})

    progress = StepProgress(
        "ppo",
        trainer.num_updates,
        start,
        tracker,
        save=save_checkpoint,
        checkpoint_every=cfg.checkpoint_every,
        checkpoint_root=checkpoints.root,
        unit="update",
        checkpoint_every_minutes=cfg.checkpoint_every_minutes,
    )
    return progress, start


def _finish_ppo(
    trainer: PPOTrainer,
    sft_model_dir: str | os.PathLike,
    out_dir: Path,
    tracker: Tracker,
    samples: list[dict],
    last: dict[str, float],
    begin: float,
) -> dict[str, float]:
    """PPO's finish, after the last update: the value-vs-reward diagnostic and the policy and the
    value model (if any) gathered whole to rank 0 (collective), which saves both (adapters saved and
    merged: :func:`rlhf_core.train.trainer.save_trained`), ``samples.jsonl``, the diagnostic and
    ``metrics.json``: ``last`` with ``ppo/updates`` and ``ppo/seconds`` since ``begin`` (``time.perf_counter()``).
    Other ranks save nothing and return ``{}``."""
    value_rows = trainer.value_vs_reward()  # after training: a diagnostic, no effect on it (Detail 22)
    # sharded models are gathered whole to rank 0 (collective), which saves
    policy = gather_to_main(trainer.policy, lambda: load_causal_lm(sft_model_dir))
    value_model = (
        None if trainer.value_model is None else gather_to_main(trainer.value_model, trainer.initial_value_model)
    )
    if not trainer.world.is_main:
        return {}
    save_trained(policy, trainer.policy_adapted, out_dir, tokenizer=trainer.tokenizer)
    if value_model is not None:
        save_trained(value_model, trainer.value_adapted, out_dir, name="value_model", adapter="value_adapter")
    write_jsonl_atomic(out_dir / "samples.jsonl", samples)
    if value_rows:
        tracker.log_artifact(write_value_vs_reward(value_rows, out_dir, trainer.cfg))
    last = dict(last, **{"ppo/updates": float(trainer.num_updates), "ppo/seconds": time.perf_counter() - begin})
    write_json_atomic(out_dir / "metrics.json", last)
    return last
