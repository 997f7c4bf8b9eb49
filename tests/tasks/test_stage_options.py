"""How the flow runs each stage task: retries only where another attempt can help, and the
per-stage settings of ``orchestration`` reaching Prefect's task options."""

import pytest
from prefect.states import Failed

from rlhf_core.common.errors import TrainingError
from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError
from rlhf_core.data.prepare import DataError
from rlhf_core.evaluation.judging import JudgeConfigError
from tasks.stages import rlhf_stage, stage_tags, stage_task, worth_retrying
from tasks.storage import ArtifactError


@pytest.mark.parametrize(
    "error, retried",
    [
        (RuntimeError("CUDA error: an illegal memory access"), True),
        (TimeoutError("stage sft exceeded 3600 s"), True),
        (ConnectionError("MLflow server went away"), True),
        (TrainingError("non-finite loss at step 3"), True),
        (DataError("sft_train.jsonl:3: bad sft row"), False),
        (ConfigError("invalid configuration"), False),
        (ArtifactError("stage sft: /x has 0.10 GiB free"), False),
        (JudgeConfigError("no ANTHROPIC_API_KEY"), False),
    ],
)
def test_only_failures_another_attempt_can_fix_are_retried(error, retried):
    assert worth_retrying(rlhf_stage, None, Failed(data=error)) is retried


def test_orchestration_settings_become_the_stage_tasks_options():
    cfg = load_config(
        "smoke",
        ["orchestration.retries=3", "orchestration.retry_delay_seconds=7", "orchestration.timeout_seconds.sft=90"],
    )
    sft, data = stage_task("sft", cfg, None), stage_task("data", cfg, None)
    assert (sft.retries, sft.retry_delay_seconds, sft.timeout_seconds) == (3, 7, 90)
    assert data.timeout_seconds is None and data.retries == 3
    assert sft.retry_condition_fn is worth_retrying
    assert sft.cache_key_fn is rlhf_stage.cache_key_fn


def test_orchestration_settings_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"orchestration\.timeout_seconds\.sfft: 'sfft' is not a stage"):
        load_config("smoke", ["orchestration.timeout_seconds.sfft=90"])
    with pytest.raises(ConfigError, match=r"orchestration\.timeout_seconds\.sft: a positive number"):
        load_config("smoke", ["orchestration.timeout_seconds.sft=0"])


def test_orchestration_settings_are_in_no_stage_key():
    from rlhf_core.run.pipeline import STAGES, stage_key

    a = load_config("smoke")
    b = load_config("smoke", ["orchestration.retries=5", "orchestration.timeout_seconds.ppo=60"])
    for stage in STAGES:
        assert stage_key(stage, a, []) == stage_key(stage, b, [])


def test_stages_that_run_a_model_are_tagged_gpu_and_the_api_judge_judge_api():
    """The tags that Prefect's tag concurrency limits bound (sweeps: cells at once)."""
    offline, api = load_config("smoke"), load_config("smoke", ["eval.judge=anthropic", "eval.judge_model=m"])
    assert stage_task("sft", offline, None).tags == {"gpu"}
    assert {s for s in ("data", "base_model", "sft", "ppo", "evaluation") if stage_tags(s, offline)} == {
        "sft",
        "ppo",
        "evaluation",
    }
    assert stage_tags("evaluation", offline) == {"gpu"}
    assert stage_tags("evaluation", api) == {"gpu", "judge-api"} and stage_tags("ppo", api) == {"gpu"}
    local = load_config(
        "smoke", ["eval.judge=openai", "eval.judge_model=m", "eval.judge_base_url=http://127.0.0.1:8000/v1"]
    )
    assert stage_tags("evaluation", local) == {"gpu", "judge-api"}
