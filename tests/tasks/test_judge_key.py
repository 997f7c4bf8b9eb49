"""The Anthropic key reaches the evaluation stage from the environment or a Prefect Secret block,
on a real (temporary) Prefect server."""

import os

import pytest

from rlhf_core.judging import JudgeConfigError
from tasks.stages import provide_judge_key


@pytest.mark.slow
def test_key_from_environment_or_secret_block(monkeypatch, tmp_path):
    from prefect.blocks.system import Secret
    from prefect.testing.utilities import prefect_test_harness

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    saved = os.environ.pop("ANTHROPIC_API_KEY", None)
    try:
        check(Secret, prefect_test_harness)
    finally:
        os.environ.pop("ANTHROPIC_API_KEY", None)
        if saved is not None:
            os.environ["ANTHROPIC_API_KEY"] = saved


def check(Secret, prefect_test_harness):
    with prefect_test_harness(server_startup_timeout=180):
        with pytest.raises(JudgeConfigError, match="'judge-key'") as info:
            provide_judge_key("judge-key")
        assert "ANTHROPIC_API_KEY" in str(info.value) and os.environ.get("ANTHROPIC_API_KEY") is None
        Secret(value="sk-from-block").save("judge-key")
        provide_judge_key("judge-key")
        assert os.environ["ANTHROPIC_API_KEY"] == "sk-from-block"
        os.environ["ANTHROPIC_API_KEY"] = "sk-from-env"  # the environment wins over the block
        provide_judge_key("judge-key")
        assert os.environ["ANTHROPIC_API_KEY"] == "sk-from-env"
