"""The pipeline's stage names, in run order: what the config checks its per-stage settings
against (``orchestration.timeout_seconds``) without importing the stage table above it
(:data:`rlhf_core.pipeline.STAGES`, one stage per name, in this order).
"""

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
