"""PPO's four models, built: the policy and the reference policy from SFT, the frozen reward model,
and the value model initialised from the reward model (Huang et al. 2024, Section 7, Detail 22),
with low-rank adapters, activation checkpointing, offloading and their data-parallel wrappers as
the ``ppo`` section asks. The setup of the PPO recipe (:mod:`rlhf_core.ppo.trainer`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import peft
import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..config.settings import PPOConfig
from ..models.saved import load_causal_lm
from ..train import lora
from ..train.distributed import DataParallel
from ..train.external_reward import ExternalRewardModel
from ..train.reward import ScalarModel, load_reward_model, reward_model_from_causal_lm
from ..train.training import enable_activation_checkpointing


class PPOModels(NamedTuple):
    """The models PPO holds (:func:`build_models`), each where it runs: the trained ones on the
    device, the frozen ones there or, with ``ppo.offload_frozen``, in CPU memory between their
    forward passes (Detail 8). ``models`` holds the trained ones (policy, and value model with
    GAE) for the optimiser and the checkpoints; each ``*_parallel`` is a model's data-parallel
    wrapper (:class:`rlhf_core.train.distributed.DataParallel`), ``ref_parallel`` the policy with its
    adapters off (:class:`rlhf_core.train.lora.AdaptersDisabled`) under ``ppo.lora.r`` above 0."""

    policy: PreTrainedModel
    ref_policy: PreTrainedModel | None
    reward_model: nn.Module | None
    value_model: ScalarModel | None
    policy_adapted: peft.PeftModel | None
    value_adapted: peft.PeftModel | None
    models: nn.ModuleDict
    policy_parallel: DataParallel
    value_parallel: DataParallel | None
    ref_parallel: DataParallel | lora.AdaptersDisabled
    reward_parallel: DataParallel | None


def build_models(
    cfg: PPOConfig,
    data_dir: str | os.PathLike,
    sft_model_dir: str | os.PathLike,
    reward_model_dir: str | os.PathLike | None,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    with_reward_model: bool = True,
) -> PPOModels:
    """The four models of PPO (Huang et al. 2024, Section 7), loaded and wrapped: the policy
    and the reference policy from SFT, the reward model from ``reward_model_dir`` (none without
    ``with_reward_model``: a rule reward scores), and with GAE the value model
    (:func:`initial_value_model`; Detail 22). ``ppo.lora.r`` above 0 adds low-rank adapters to
    the policy and the value model (whose head trains in full), and the reference policy is the
    policy with its adapters off, not a second copy. Random draws (a zero or random head, the
    adapters' initialisation) follow the global generator, seeded by the caller.
    """
    policy = load_causal_lm(sft_model_dir).to(device)
    # ppo.offload_frozen: the frozen models stay in CPU memory, their DataParallel copies
    # them to the device for each forward pass (Detail 8)
    frozen_home = torch.device("cpu") if cfg.offload_frozen else device
    reward_model = None
    if with_reward_model:  # frozen, in eval mode, where the frozen models live
        reward_model = load_reward_model(reward_model_dir, tokenizer, data_dir)  # type: ignore[arg-type]
        reward_model = reward_model.to(frozen_home).eval().requires_grad_(False)
    # the value model of GAE (Detail 22); none for a critic-free estimator (rloo, grpo)
    critic = cfg.advantage_estimator == "gae"
    value_model = initial_value_model(cfg, sft_model_dir, reward_model_dir, reward_model).to(device) if critic else None
    policy_adapted = lora.add_lora(policy, cfg.lora, cfg.seed)
    value_adapted = lora.add_lora(value_model, cfg.lora, cfg.seed, trained_in_full=["head"]) if critic else None
    ref_policy = (
        load_causal_lm(sft_model_dir).to(frozen_home).eval().requires_grad_(False) if policy_adapted is None else None
    )
    enable_activation_checkpointing(policy, cfg.gradient_checkpointing)
    models = nn.ModuleDict({"policy": policy})
    if value_model is not None:
        enable_activation_checkpointing(value_model, cfg.gradient_checkpointing)
        models["value"] = value_model
    # One wrapper per model, before the optimiser (FSDP2 shards in place): the policy's and the
    # value model's losses are backpropagated one after the other; the frozen models are sharded
    # under fsdp only (DataParallel), and offloaded with ppo.offload_frozen.
    policy_parallel = DataParallel(policy, cfg.strategy)
    value_parallel = None if value_model is None else DataParallel(value_model, cfg.strategy)
    offload = {"offload": cfg.offload_frozen, "device": device}
    ref_parallel = (
        DataParallel(ref_policy, cfg.strategy, **offload)
        if policy_adapted is None
        else lora.AdaptersDisabled(policy_parallel, policy_adapted)
    )
    reward_parallel = None if reward_model is None else DataParallel(reward_model, cfg.strategy, **offload)
    return PPOModels(
        policy=policy,
        ref_policy=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        policy_adapted=policy_adapted,
        value_adapted=value_adapted,
        models=models,
        policy_parallel=policy_parallel,
        value_parallel=value_parallel,
        ref_parallel=ref_parallel,
        reward_parallel=reward_parallel,
    )


def initial_value_model(
    cfg: PPOConfig,
    sft_model_dir: str | os.PathLike,
    reward_model_dir: str | os.PathLike | None,
    reward_model: nn.Module | None,
) -> ScalarModel:
    """The value model before training, on the CPU: the reward model (Detail 22), with its
    head zeroed under ``ppo.value_init: zero_head``; without one (a rule reward) the SFT
    backbone with a zero head. A zero head gives V = 0 until the value model learns, so the
    first advantages are the lambda-returns of the rewards; Detail 11's random head gives
    values that dwarf a score in [-1, 0] (benchmarks/README.md). An existing reward model
    (``ppo.reward: model:SOURCE``) reads other tokens than the policy's: the value model
    starts from the SFT backbone with a zero head, as without a reward model."""
    if reward_model_dir is not None and not isinstance(reward_model, ExternalRewardModel):
        model = ScalarModel.from_pretrained(str(reward_model_dir))
        if cfg.value_init == "reward_model":
            return model
    else:
        model = reward_model_from_causal_lm(sft_model_dir, seed=cfg.seed)
    nn.init.zeros_(model.head.weight)
    nn.init.zeros_(model.head.bias)
    return model
