"""DPO's implicit reward model evaluated as the explicit one is: the DPO policy against its
reference scores the reward model's evaluation pairs (Huang et al. 2024, Detail 19, Figure 6).
The ``dpo_eval`` stage; apart from DPO's training, so that the evaluation's code never re-runs it.
"""

from __future__ import annotations

import os

import torch

from ..common.tracking import Tracker
from ..config.settings import DPOConfig, RewardConfig
from ..data.prepared import load_data_tokenizer
from ..models.saved import load_causal_lm
from ..train.dpo import load_reference, score_pairs
from ..train.training import pick_device
from .reward_eval import evaluate_pairs


def evaluate_dpo_reward(
    cfg: DPOConfig,
    eval_cfg: RewardConfig,
    data_dir: str | os.PathLike,
    policy_dir: str | os.PathLike,
    sft_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
) -> dict[str, float]:
    """The DPO policy's implicit reward model evaluated as the explicit one is
    (:func:`rlhf_core.evaluation.reward_eval.evaluate_pairs`: the same splits, rows, groups and keys, from
    ``eval_cfg``, the ``reward`` section), so the two accuracies compare pair for pair
    (Detail 19, Figure 6)."""
    tokenizer = load_data_tokenizer(data_dir)
    device = pick_device()
    policy, reference = load_causal_lm(policy_dir).to(device), load_reference(sft_model_dir, device)

    def score(rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return score_pairs(
            policy,
            reference,
            rows["query_chosen_token"],
            rows["query_rejected_token"],
            rows["query_token_len"],
            tokenizer.pad_token_id,
            cfg.beta,
            cfg.micro_batch_size,
            cfg.bf16,
        )

    return evaluate_pairs(score, eval_cfg, data_dir, out_dir, tracker, "DPO implicit reward model")
