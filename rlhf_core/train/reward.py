"""The reward-model stage: the scalar model, its loss, scoring, training and normalisation.

Huang et al. 2024, Details 10-15; the reward model's evaluation (Details 16-18) is
:mod:`rlhf_core.evaluation.reward_eval`.

A :class:`ScalarModel` is a transformer backbone (no language-model head) with a linear
head giving one scalar per position. The reward of a sequence is the head's output at its
EOS, found as the token before the first PAD of the response (Detail 12). The same class
serves as PPO's value model, initialised from the reward model (Detail 22).

A saved reward (or value) model is a Hugging Face sequence-classification checkpoint with one
label (``LlamaForSequenceClassification``, ``GPTNeoXForSequenceClassification``, ...), the
format TRL, OpenRLHF and verl exchange reward models in. Those heads have no bias, so the
head's bias, which carries the normalisation of Detail 15, is stored in the checkpoint's
config as ``rlhf_score_bias``. Load it with this package::

    from rlhf_core.train.reward import ScalarModel
    reward_model = ScalarModel.from_pretrained(".../artifacts/reward_norm/<key>/model")

or with ``transformers`` alone, adding the bias::

    model = AutoModelForSequenceClassification.from_pretrained(path)  # num_labels == 1
    score = model(input_ids, attention_mask=mask).logits[:, 0] + model.config.rlhf_score_bias

which equals our score for right-padded rows (the score is read at the last token that is not
PAD, the EOS of a finished summary; Detail 12).

An existing reward model (``ppo.reward: model:SOURCE``) is any such checkpoint with one label and
its own tokenizer (:mod:`rlhf_core.train.external_reward`): :func:`load_reward_model` loads either kind;
:func:`score_responses` scores with either.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..common.io import write_json_atomic
from ..common.tracking import NullTracker, Tracker
from ..config.settings import RewardConfig
from ..data.prepared import load_data_tokenizer, load_prepared, require_prompts
from ..models.saved import DTYPES, disable_dropout, save_pretrained_atomic
from .distributed import DataParallel, all_reduce_sum, is_sharded
from .external_reward import EXTERNAL_REWARD_KEY, ExternalRewardModel
from .forward import causal_forward, pair_forward, pair_layout
from .generation import ends_with_eos, last_token_indices, trim_left_padding
from .trainer import global_means, start_stage
from .training import autocast, pick_device

log = logging.getLogger(__name__)


class ScalarModelConfig(PretrainedConfig):
    """Config of a :class:`ScalarModel`: the backbone's config plus the head's size.

    ``normalization_mean`` records the mean score subtracted from the head's bias by
    :func:`normalize_reward_model` (Detail 15); it is bookkeeping only.
    """

    model_type = "rlhf_scalar"

    def __init__(
        self,
        base_config: dict | None = None,
        hidden_size: int | None = None,
        normalization_mean: float = 0.0,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.base_config = base_config or {}
        self.hidden_size = hidden_size
        self.normalization_mean = normalization_mean


def _backbone_config(config: ScalarModelConfig) -> PretrainedConfig:
    base = dict(config.base_config)
    return AutoConfig.for_model(base.pop("model_type"), **base)


class ScalarModel(PreTrainedModel):
    """Backbone + ``nn.Linear(hidden_size, 1)``: one scalar per token.

    ``forward(input_ids, attention_mask, position_ids)`` returns ``(batch, length)``
    float32 scalars. Dropout is off (Detail 7).
    """

    config_class = ScalarModelConfig
    base_model_prefix = "backbone"
    supports_gradient_checkpointing = True
    _supports_sdpa = True

    def __init__(self, config: ScalarModelConfig, backbone: nn.Module | None = None):
        super().__init__(config)
        self.backbone = backbone if backbone is not None else AutoModel.from_config(_backbone_config(config))
        self.head = nn.Linear(config.hidden_size, 1)
        self.post_init()
        disable_dropout(self)

    def _init_weights(self, module: nn.Module) -> None:  # weights come from the backbone or a checkpoint
        pass

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.head(hidden).squeeze(-1).float()

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Save as the backbone architecture's ``...ForSequenceClassification`` checkpoint with
        one label: backbone weights under its ``base_model_prefix``, the head's weight as
        ``score.weight``; the head's bias as the config's ``rlhf_score_bias`` and the
        normalisation mean of Detail 15 as ``rlhf_normalization_mean``, since those heads have
        no bias. Keyword arguments go to ``PreTrainedModel.save_pretrained``."""
        config = _backbone_config(self.config)
        config.num_labels = 1
        config.pad_token_id, config.eos_token_id = self.config.pad_token_id, self.config.eos_token_id
        config.dtype = self.head.weight.dtype
        with torch.device("meta"):
            shell = AutoModelForSequenceClassification.from_config(config)
        shell.config.architectures = [type(shell).__name__]
        shell.config.rlhf_score_bias = float(self.head.bias.detach().float().item())
        shell.config.rlhf_normalization_mean = float(self.config.normalization_mean)
        prefix = shell.base_model_prefix
        state = {f"{prefix}.{key}": value for key, value in self.backbone.state_dict().items()}
        state["score.weight"] = self.head.weight.detach()
        shell.save_pretrained(save_directory, state_dict=state, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *args: Any, **kwargs: Any) -> ScalarModel:
        """Load a model saved by :meth:`save_pretrained` (arguments as
        ``AutoModelForSequenceClassification.from_pretrained``, e.g. ``dtype``).

        Raises:
            ValueError: the checkpoint is not a one-label sequence-classification model with
                ``rlhf_score_bias`` in its config (not a reward model saved by this package).
        """
        config = AutoConfig.from_pretrained(str(path))
        bias = getattr(config, "rlhf_score_bias", None)
        if getattr(config, EXTERNAL_REWARD_KEY, None) is not None:
            raise ValueError(
                f"{path}: an existing reward model ({EXTERNAL_REWARD_KEY} {getattr(config, EXTERNAL_REWARD_KEY)!r}) "
                "with its own tokenizer: load it with rlhf_core.train.reward.load_reward_model"
            )
        if bias is None or config.num_labels != 1:
            raise ValueError(
                f"{path}: not a reward model saved by rlhf_core (its config.json needs num_labels 1 and "
                f"rlhf_score_bias; found num_labels {config.num_labels}, rlhf_score_bias {bias})"
            )
        hf = AutoModelForSequenceClassification.from_pretrained(str(path), *args, **kwargs)
        backbone = getattr(hf, hf.base_model_prefix)
        base = backbone.config.to_dict()
        for key in ("_name_or_path", "architectures", "id2label", "label2id", "problem_type"):
            base.pop(key, None)
        base = {k: v for k, v in base.items() if not k.startswith("rlhf_")}
        scalar_config = ScalarModelConfig(
            base_config=base,
            hidden_size=backbone.config.hidden_size,
            pad_token_id=config.pad_token_id,
            eos_token_id=config.eos_token_id,
            normalization_mean=getattr(config, "rlhf_normalization_mean", 0.0),
        )
        model = cls(scalar_config, backbone=backbone)
        with torch.no_grad():
            model.head.to(hf.score.weight.dtype)
            model.head.weight.copy_(hf.score.weight)
            model.head.bias.fill_(bias)
        return model


def load_reward_model(
    path: str | os.PathLike, policy_tokenizer: PreTrainedTokenizerBase, data_dir: str | os.PathLike | None = None
) -> ScalarModel | ExternalRewardModel:
    """The reward model saved in ``path``: an :class:`ExternalRewardModel` when its config names
    an existing model's spec (:data:`EXTERNAL_REWARD_KEY`, :func:`import_reward_model`), reading
    the ids of ``policy_tokenizer`` and, with ``data_dir`` (the prepared data), the
    conversational rows' own messages (:meth:`ExternalRewardModel.read_conversations`); else a
    :class:`ScalarModel` (the policy's tokenizer).

    Raises:
        ValueError: not a reward model (:meth:`ScalarModel.from_pretrained`).
    """
    if getattr(AutoConfig.from_pretrained(str(path)), EXTERNAL_REWARD_KEY, None) is not None:
        model = ExternalRewardModel.from_pretrained(path, policy_tokenizer)
        if data_dir is not None and policy_tokenizer is not None:
            model.read_conversations(data_dir, policy_tokenizer.pad_token_id)
        return model
    return ScalarModel.from_pretrained(str(path))


def init_head(head: nn.Linear, d_model: int, generator: torch.Generator | None = None) -> None:
    """Weights ~ N(0, std = 1/sqrt(d_model + 1)), bias 0 (Huang et al. 2024, Detail 11)."""
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / math.sqrt(d_model + 1), generator=generator)
        head.bias.zero_()


def reward_model_from_causal_lm(path: str | os.PathLike, seed: int = 0, dtype: str = "float32") -> ScalarModel:
    """A new reward model: the backbone of the causal LM at ``path`` and a fresh head (Details 10, 11)."""
    backbone = AutoModel.from_pretrained(str(path), dtype=DTYPES[dtype])
    base_config = backbone.config.to_dict()
    base_config.pop("_name_or_path", None)  # where it was loaded from: not part of the model
    config = ScalarModelConfig(
        base_config=base_config,
        hidden_size=backbone.config.hidden_size,
        pad_token_id=backbone.config.pad_token_id,
        eos_token_id=backbone.config.eos_token_id,
    )
    model = ScalarModel(config, backbone=backbone)
    init_head(model.head, config.hidden_size, torch.Generator().manual_seed(seed))
    return model.to(DTYPES[dtype])


def get_reward(
    model: ScalarModel, query_responses: torch.Tensor, pad_token_id: int, context_length: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scalars at every position, and the reward at each sequence's EOS (Details 12, 14).

    The EOS index is the index before the first PAD after ``context_length``; with no PAD
    it is the last position (whose score PPO's EOS trick replaces, Detail 23).

    Args:
        query_responses: ``(batch, length)`` token ids; the query may be left-padded when
            ``context_length`` is its padded length, and the response right-padded.
        context_length: where responses start (0 for right-padded query+response rows).

    Returns:
        ``(reward_logits (batch, length) float32, scores (batch,) float32,
        score_indices (batch,) long)``, where ``score_indices`` is the position in
        ``query_responses`` of each response's last real token (its EOS, when it has one).
    """
    reward_logits = causal_forward(
        lambda ids, mask, pos: model(input_ids=ids, attention_mask=mask, position_ids=pos),
        query_responses,
        pad_token_id,
    )
    score_indices = last_token_indices(query_responses[:, context_length:], pad_token_id) + context_length
    scores = reward_logits[torch.arange(reward_logits.size(0), device=reward_logits.device), score_indices]
    return reward_logits, scores, score_indices


@torch.no_grad()
def response_reward_logits(
    model: ScalarModel,
    queries: torch.Tensor,
    responses: torch.Tensor,
    pad_token_id: int,
    bf16: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's output at every response token: the reward logits of Huang et al. (2024),
    Detail 13 / Figure 3, or read from a value model, its values as a per-token reward model
    (Detail 22).

    One :func:`get_reward` pass over the whole batch, laid out as :func:`score_responses` lays
    out each of its batches (the shared left padding trimmed, then the responses), so
    ``scores`` is the score that path reads (Details 12, 14). For a few rows: no batching.

    Args:
        queries: ``(n, query_length)`` long token ids, left-padded.
        responses: ``(n, response_length)`` long token ids, PAD after the first EOS.
        bf16: the stage's precision setting (:func:`rlhf_core.train.training.autocast`).

    Returns:
        ``(logits, scores, score_indices)`` on the CPU: ``logits`` ``(n, response_length)``
        float32, the head's output at each response token (Shape: ``(b, response_len)``);
        ``scores`` ``(n,)`` float32, the raw score; ``score_indices`` ``(n,)`` long, the index in
        the response of its last real token (its EOS when it has one; -1 when the response
        starts with PAD, whose score is read at the query's last token), so that
        ``logits[i, score_indices[i]] == scores[i]`` wherever ``score_indices[i] >= 0``.
    """
    device = next(model.parameters()).device
    model.eval()
    q = trim_left_padding(queries, pad_token_id).to(device)
    with autocast(device, bf16):
        logits, scores, indices = get_reward(
            model, torch.cat([q, responses.to(device)], dim=1), pad_token_id, q.size(1)
        )
    return logits[:, q.size(1) :].float().cpu(), scores.float().cpu(), (indices - q.size(1)).cpu()


def pair_scores(
    model: ScalarModel, chosen: torch.Tensor, rejected: torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of chosen and rejected rows, running the tokens they share (the query) once.

    A causal model's hidden state at a token depends only on the tokens before it, so the
    common prefix of a pair (its query, plus any identical first response tokens) gives the
    same keys and values in both rows. The prefix runs once, without an attention mask; each
    row's remaining tokens up to its EOS then run against that prefix's key/value cache, with
    the pair's two rows side by side (:func:`rlhf_core.train.forward.pair_forward`). Scores and
    gradients equal those of :func:`get_reward` on ``torch.cat([chosen, rejected])``
    (Details 12, 14) up to kernel rounding, for about half of the forward and backward work
    when responses are short next to their queries, as in TL;DR. Rows that are not right-padded, pairs that share
    nothing, and models with gradient checkpointing (which cannot build a cache in training)
    take :func:`get_reward` instead, and so do models sharded by ZeRO-2/FSDP
    (:class:`rlhf_core.train.distributed.DataParallel`), whose blocks free their gathered weights
    between the two passes.

    Args:
        chosen: ``(batch, length)`` right-padded query+response token ids.
        rejected: ``(batch, length)`` the same queries with the other responses.

    Returns:
        ``(chosen_scores, rejected_scores)``, each ``(batch,)`` float32, read at each row's EOS
        (the index before its first PAD).
    """
    batch = chosen.size(0)
    right_padded, eos, common = pair_layout(chosen, rejected, pad_token_id)
    prefix = torch.minimum(common, eos.min(1).values)  # (batch,): at least each row's EOS runs in the second pass
    checkpointing = getattr(model.backbone, "gradient_checkpointing", False)
    if (
        not batch
        or int(prefix.max()) == 0
        or not right_padded
        or bool(eos.min() < 0)
        or checkpointing
        or is_sharded(model)
    ):
        _, scores, _ = get_reward(model, torch.cat([chosen, rejected]), pad_token_id)
        return scores[:batch], scores[batch:]
    hidden, _, valid = pair_forward(model.backbone, chosen, rejected, prefix, eos + 1)
    last = hidden[torch.arange(2 * batch, device=chosen.device), valid.sum(1) - 1]  # (2 * batch, hidden): each EOS
    scores = model.head(last).squeeze(-1).float().view(batch, 2)
    return scores[:, 0], scores[:, 1]


def preference_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """``-log sigmoid(r_chosen - r_rejected)`` per pair (Detail 10). Shapes ``(batch,)`` -> ``(batch,)``."""
    return -F.logsigmoid(chosen_scores - rejected_scores)


def run_reward_training(
    cfg: RewardConfig,
    data_dir: str | os.PathLike,
    sft_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
) -> dict[str, float]:
    """Train a reward model on the preference train split, initialised from the SFT model.

    Writes ``out_dir/model`` (a :class:`ScalarModel` with the tokenizer) and
    ``out_dir/metrics.json``; checkpoints in ``out_dir/checkpoints`` make it resumable. With
    ``reward.lora.r`` above 0 the backbone trains through low-rank adapters and the head in
    full (:mod:`rlhf_core.train.lora`); ``out_dir/adapter`` holds both, ``out_dir/model`` the merged
    model.

    Returns:
        Flat metrics of the last step: ``train/loss``, ``train/accuracy``,
        ``train/chosen_reward``, ``train/rejected_reward``, ``train/steps``, ``train/seconds``.
    """
    stage = start_stage("reward", cfg, data_dir, out_dir, tracker)
    device, pad_id = stage.device, stage.pad_id
    model = reward_model_from_causal_lm(sft_model_dir, seed=cfg.seed).to(device)
    adapted = stage.adapt(model, trained_in_full=["head"])  # adapters: None unless reward.lora.r > 0
    train = stage.pref["train"].with_format("torch", columns=["query_chosen_token", "query_rejected_token"])

    def step_fn(indices: list[int], parallel: DataParallel) -> dict[str, float]:
        rows = train[indices]
        chosen_all, rejected_all = rows["query_chosen_token"], rows["query_rejected_token"]
        n = int(all_reduce_sum([len(indices)])[0])  # pairs in the global batch, over every rank
        sums = dict.fromkeys(["loss", "accuracy", "chosen_reward", "rejected_reward"], 0.0)
        lengths = torch.maximum((chosen_all != pad_id).sum(1), (rejected_all != pad_id).sum(1))
        for mb in stage.micro_batches(parallel, lengths):
            with stage.autocast():
                chosen, rejected = parallel(pair_scores, chosen_all[mb].to(device), rejected_all[mb].to(device), pad_id)
            loss = preference_loss(chosen, rejected).sum()
            (loss / n).backward()
            sums["loss"] += loss.item()
            sums["accuracy"] += (chosen > rejected).float().sum().item()
            sums["chosen_reward"] += chosen.detach().sum().item()
            sums["rejected_reward"] += rejected.detach().sum().item()
        return global_means(sums, n, (chosen_all != pad_id).sum().item() + (rejected_all != pad_id).sum().item())

    model, last = stage.train(
        model,
        len(train),
        step_fn,
        sft_model_dir,
        lambda: reward_model_from_causal_lm(sft_model_dir, seed=cfg.seed).to(device),
    )
    return stage.finish(model, adapted, last)  # rank 0 saves


@dataclass
class ResponseScores:
    """The reward model's verdict on a batch of responses (Details 12, 23).

    Attributes:
        raw_scores: ``(n,)`` float32, the reward model's output at each response's last real
            token (the one before its first PAD), or a rule reward's value (``ppo.reward``,
            :meth:`rlhf_core.ppo.trainer.PPOTrainer.score`).
        scores: ``(n,)`` float32, ``raw_scores`` with the EOS trick: ``non_eos_penalty`` where
            the response has no EOS.
        has_eos: ``(n,)`` bool, the last real token is EOS
            (:func:`rlhf_core.train.generation.ends_with_eos`).
    """

    raw_scores: torch.Tensor
    scores: torch.Tensor
    has_eos: torch.Tensor


def response_scores(
    raw_scores: torch.Tensor,
    responses: torch.Tensor,
    eos_token_id: int,
    pad_token_id: int,
    non_eos_penalty: float | None,
) -> ResponseScores:
    """:class:`ResponseScores` from raw scores: the EOS trick (Detail 23), here alone. Every
    response without an EOS scores ``non_eos_penalty`` (``None``: no trick, ``scores`` equal
    ``raw_scores``). A response has an EOS when the token its score is read at, the one before
    its first PAD (Detail 12), is EOS (:func:`rlhf_core.train.generation.ends_with_eos`): one
    that starts with PAD, or has a PAD before its EOS, was not scored at an EOS.

    Args:
        raw_scores: ``(n,)`` scores read at each response's last real token.
        responses: ``(n, response_length)`` token ids, PAD after the first EOS.

    Returns:
        :class:`ResponseScores` on the device of ``raw_scores``, float32.
    """
    raw_scores = raw_scores.float()
    has_eos = ends_with_eos(responses, eos_token_id, pad_token_id)
    scores = raw_scores
    if non_eos_penalty is not None:
        scores = torch.where(has_eos, raw_scores, torch.full_like(raw_scores, non_eos_penalty))
    return ResponseScores(raw_scores=raw_scores, scores=scores, has_eos=has_eos)


class TextScorer(Protocol):
    """What scores responses without reading the policy's hidden states:
    :class:`ExternalRewardModel` and :class:`rlhf_core.train.rule_rewards.RuleReward`."""

    def score(
        self,
        queries: torch.Tensor,
        responses: torch.Tensor,
        pad_token_id: int,
        eos_token_id: int,
        batch_size: int,
        bf16: bool | str = False,
    ) -> torch.Tensor: ...


@torch.no_grad()
def score_responses(
    reward_model: ScalarModel | ExternalRewardModel | TextScorer,
    queries: torch.Tensor,
    responses: torch.Tensor,
    pad_token_id: int,
    eos_token_id: int,
    non_eos_penalty: float | None,
    batch_size: int,
    bf16: bool | str = False,
) -> ResponseScores:
    """Reward-model scores of query + response pairs, in batches, without gradients (Details 12, 14, 23).

    Every sampled or reference response scored outside reward-model training goes through
    here: PPO's rollouts and evaluations, the evaluation stage, and the reference summaries of
    reward normalisation (which end with EOS, Detail 3, so that their ``scores`` equal their
    ``raw_scores``). Preference pairs are scored by :func:`pair_scores` (training) and
    :func:`score_pairs` (evaluation), which read the same position. The score is read at each
    response's last real token; queries may be left-padded (the padding is invisible, Detail 14).
    An :class:`ExternalRewardModel` (``ppo.reward: model:SOURCE``) scores the decoded texts
    through its own tokenizer instead (:meth:`ExternalRewardModel.score`), a
    :class:`rlhf_core.train.rule_rewards.RuleReward` (``ppo.reward: python:...``) by its rule
    (a :class:`TextScorer` each). The EOS trick is applied here, for every caller
    (:func:`response_scores`).

    Args:
        queries: ``(n, query_length)`` long token ids, left-padded.
        responses: ``(n, response_length)`` long token ids, PAD after the first EOS
            (:func:`rlhf_core.train.generation.truncate_after_eos`).
        non_eos_penalty: the score of a response without EOS (``ppo.non_eos_penalty``;
            ``None``: no EOS trick, ``scores`` equal ``raw_scores``).
        bf16: the stage's precision setting (:func:`rlhf_core.train.training.autocast`).

    Returns:
        :class:`ResponseScores` on the device of ``responses``.
    """
    if not isinstance(reward_model, ScalarModel):  # an ExternalRewardModel or a rule: the decoded texts
        raw_scores = reward_model.score(queries, responses, pad_token_id, eos_token_id, batch_size, bf16)
        raw_scores = raw_scores.to(responses.device)
    else:
        device = next(reward_model.parameters()).device
        reward_model.eval()
        raw = []
        for start in range(0, len(queries), batch_size):
            q = trim_left_padding(queries[start : start + batch_size], pad_token_id)
            query_responses = torch.cat([q, responses[start : start + batch_size].to(q.device)], dim=1).to(device)
            with autocast(device, bf16):
                _, scores, _ = get_reward(reward_model, query_responses, pad_token_id, q.size(1))
            raw.append(scores.float().to(responses.device))
        raw_scores = torch.cat(raw) if raw else torch.zeros(0, device=responses.device)
    return response_scores(raw_scores, responses, eos_token_id, pad_token_id, non_eos_penalty)


@torch.no_grad()
def score_pairs(
    model: ScalarModel,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    pad_token_id: int,
    batch_size: int,
    bf16: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of preference pairs, in batches, without gradients: the training pass
    (:func:`pair_scores`, the shared query run once) in evaluation mode.

    Args:
        chosen, rejected: ``(n, length)`` right-padded query+response token ids of each pair.
        bf16: the stage's precision setting (:func:`rlhf_core.train.training.autocast`).

    Returns:
        ``(chosen_scores, rejected_scores)``, each ``(n,)`` float32 on the CPU, read at each
        response's EOS (Details 12, 14).
    """
    device = next(model.parameters()).device
    model.eval()
    out_chosen, out_rejected = [], []
    for start in range(0, len(chosen), batch_size):
        with autocast(device, bf16):
            c, r = pair_scores(
                model,
                chosen[start : start + batch_size].to(device),
                rejected[start : start + batch_size].to(device),
                pad_token_id,
            )
        out_chosen.append(c.float().cpu())
        out_rejected.append(r.float().cpu())
    empty = torch.zeros(0)
    return (torch.cat(out_chosen) if out_chosen else empty), (torch.cat(out_rejected) if out_rejected else empty)


def normalize_reward_model(
    cfg: RewardConfig,
    data_dir: str | os.PathLike,
    reward_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
) -> dict[str, float]:
    """Shift the reward so that SFT reference summaries score 0 on average (Detail 15).

    Scores ``query + reference_response`` of the SFT split ``cfg.normalization_split``
    (its first ``cfg.normalization_max_samples`` rows when set; the paper uses all),
    subtracts their mean from the head's bias, scores them again, and writes the
    normalised model to ``out_dir/model``. With ``cfg.normalize`` false the references are
    scored all the same and the model is written unchanged (no shift, ``mean_after`` equals
    ``mean_before``).

    Returns:
        ``normalization/mean_before``, ``normalization/mean_after`` (within float error of
        0 when normalising), ``normalization/shift`` (the mean subtracted; 0 when not
        normalising), ``normalization/std``, ``normalization/count``.

    An existing reward model (:func:`import_reward_model`) is normalised the same way, through
    its ``bias`` (:class:`ExternalRewardModel`), and written with its own tokenizer.
    """
    tracker = tracker or NullTracker()
    out_dir = Path(out_dir)
    sft, _, stats = load_prepared(data_dir)
    require_prompts(stats, cfg.normalization_split, "reward.normalization_split")
    tokenizer = load_data_tokenizer(data_dir)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    device = pick_device()
    model = load_reward_model(reward_model_dir, tokenizer, data_dir).to(device)
    ds = sft[cfg.normalization_split]
    ds = ds.select(range(min(len(ds), cfg.normalization_max_samples or len(ds))))
    rows = ds.with_format("torch", columns=["query_token", "reference_response_token"])[:]
    queries, references = rows["query_token"], rows["reference_response_token"]

    def reference_scores() -> torch.Tensor:  # references end with EOS (Detail 3): their raw scores
        return score_responses(
            model, queries, references, pad, eos, float("nan"), cfg.micro_batch_size, cfg.bf16
        ).raw_scores

    before = reference_scores()
    mean = before.double().mean().item()
    shift = mean if cfg.normalize else 0.0
    if cfg.normalize and isinstance(model, ExternalRewardModel):
        model.bias -= shift
        config = model.model.config
        config.rlhf_normalization_mean = getattr(config, "rlhf_normalization_mean", 0.0) + shift
        after = reference_scores()
    elif cfg.normalize:
        with torch.no_grad():
            model.head.bias -= shift
        model.config.normalization_mean = model.config.normalization_mean + shift
        after = reference_scores()
    else:
        after = before
    metrics = {
        "normalization/mean_before": mean,
        "normalization/mean_after": after.double().mean().item(),
        "normalization/shift": shift,
        "normalization/std": before.double().std().item() if len(before) > 1 else 0.0,
        "normalization/count": float(len(before)),
    }
    # an existing reward model is saved with its own tokenizer
    own_tokenizer = None if isinstance(model, ExternalRewardModel) else tokenizer
    save_pretrained_atomic(model, out_dir / "model", own_tokenizer)  # type: ignore[arg-type]
    tracker.log_metrics(metrics)
    write_json_atomic(out_dir / "metrics.json", metrics)
    if cfg.normalize:
        log.info(
            "reward normalisation: mean %.4f -> %.2e over %d references",
            mean,
            metrics["normalization/mean_after"],
            len(before),
        )
    else:
        log.info(
            "reward normalisation off (reward.normalize: false): model written unchanged; mean %.4f over %d references",
            mean,
            len(before),
        )
    return metrics


#: Responses shown per token by :func:`write_reward_logits` and the PPO stage's value table.
TOKEN_TABLE_RESPONSES = 4


def token_table(
    tokenizer: PreTrainedTokenizerBase,
    responses: torch.Tensor,
    scores: torch.Tensor,
    score_indices: torch.Tensor,
    eos_token_id: int,
    pad_token_id: int,
    outputs: dict[str, torch.Tensor],
) -> list[dict[str, Any]]:
    """Per-token outputs of a few responses as JSON rows (Huang et al. 2024, Figure 3 and
    Figure 11): each response's tokens up to its last real token, and each output there.

    Args:
        responses: ``(n, response_length)`` long token ids, PAD after the first EOS.
        scores: ``(n,)`` the raw score of each response.
        score_indices: ``(n,)`` long, the index in the response of its last real token (-1 when
            it starts with PAD), as :func:`rlhf_core.train.reward.response_reward_logits` returns.
        outputs: ``{name: (n, response_length) float}``, e.g. ``{"reward_logits": ...,
            "values": ...}``, aligned with ``responses``.

    Returns:
        One dict per response: ``token_ids`` and ``tokens`` (each id decoded alone) of positions
        ``0 .. eos_index``, one list per output name over the same positions, ``eos_index``
        (where the score is read, Detail 12), ``ends_with_eos`` (the token there is EOS, else
        the score is one PPO's EOS trick replaces, Detail 23) and ``score``.
    """
    has_eos = ends_with_eos(responses, eos_token_id, pad_token_id)
    rows = []
    for i in range(len(responses)):
        end = int(score_indices[i]) + 1
        ids = responses[i, :end].tolist()
        rows.append(
            {
                "token_ids": ids,
                "tokens": [tokenizer.decode([t]) for t in ids],
                **{name: [float(v) for v in values[i, :end].tolist()] for name, values in outputs.items()},
                "eos_index": end - 1,
                "ends_with_eos": bool(has_eos[i]),
                "score": float(scores[i]),
            }
        )
    return rows
