"""An API judge's key (Anthropic's; OpenAI's for the OpenAI API) reaches the evaluation stage from
the environment or a Prefect Secret block, on a real (temporary) Prefect server; before any stage
runs, the preflight checks that one of them is there, without reading or showing the key."""

import logging
import os

import pytest

from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError
from rlhf_core.evaluation.judging import JudgeConfigError
from rlhf_core.run.pipeline import stages_until
from rlhf_core.run.preflight import PreflightError, check_judge_key
from tasks.stages import preflight, provide_judge_key, secret_block_exists

KEY = "sk-ant-preflight-test-0123456789abcdefghij"  # a made-up key: it must appear nowhere


@pytest.fixture
def anthropic_cfg(tmp_path, monkeypatch):
    """The smoke preset with the Anthropic judge, its stores in ``tmp_path``, no key in the environment."""
    monkeypatch.setenv("RLHF_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.setenv("RLHF_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    return load_config(
        "smoke", ["eval.judge=anthropic", "eval.judge_model=claude-test", "eval.api_key_secret=judge-key"]
    )


def test_the_key_in_the_environment_passes_and_is_never_shown(anthropic_cfg, monkeypatch, capsys, caplog):
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    with caplog.at_level(logging.DEBUG):
        preflight(anthropic_cfg)
    captured = capsys.readouterr()
    assert KEY not in captured.out + captured.err + caplog.text


def test_without_the_variable_or_the_block_the_error_names_both(anthropic_cfg):
    with pytest.raises(PreflightError) as info:
        check_judge_key(anthropic_cfg, secret_exists=lambda name: False)
    message = str(info.value)
    assert isinstance(info.value, ConfigError) and "\n" not in message  # `rlhf` prints it in one line
    assert message.startswith(
        "eval.judge is anthropic but neither is ANTHROPIC_API_KEY set nor does a Prefect Secret block named "
        "'judge-key' exist (eval.api_key_secret)"
    )
    check_judge_key(anthropic_cfg, secret_exists=lambda name: name == "judge-key")
    preflight(anthropic_cfg, stages_until("ppo"))  # no evaluation: no key needed, Prefect not asked


def test_the_openai_judge_needs_a_key_for_the_openai_api_only(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = load_config("smoke", ["eval.judge=openai", "eval.judge_model=gpt-test"])
    asked = []
    with pytest.raises(PreflightError) as info:
        check_judge_key(cfg, secret_exists=lambda name: asked.append(name) or False)
    assert asked == ["openai-api-key"] and str(info.value).startswith(
        "eval.judge is openai on https://api.openai.com/v1 but neither is OPENAI_API_KEY set nor does a Prefect "
        "Secret block named 'openai-api-key' exist (eval.api_key_secret)"
    )
    check_judge_key(cfg, secret_exists=lambda name: name == "openai-api-key")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    check_judge_key(cfg, secret_exists=lambda name: False)
    monkeypatch.delenv("OPENAI_API_KEY")
    local = load_config(
        "smoke", ["eval.judge=openai", "eval.judge_model=m", "eval.judge_base_url=http://127.0.0.1:8000/v1"]
    )
    check_judge_key(local, secret_exists=lambda name: asked.append(name) or False)
    provide_judge_key(local.eval)  # no key needed: no block is looked up, no variable set
    assert asked == ["openai-api-key"] and os.environ.get("OPENAI_API_KEY") is None  # the local server: not asked


@pytest.mark.slow
def test_key_from_environment_or_secret_block(anthropic_cfg, monkeypatch, tmp_path, capsys, caplog):
    from prefect.blocks.system import Secret
    from prefect.testing.utilities import prefect_test_harness

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    saved = os.environ.pop("ANTHROPIC_API_KEY", None)
    try:
        check(Secret, prefect_test_harness, anthropic_cfg, capsys, caplog)
    finally:
        os.environ.pop("ANTHROPIC_API_KEY", None)
        if saved is not None:
            os.environ["ANTHROPIC_API_KEY"] = saved


def check(Secret, prefect_test_harness, cfg, capsys, caplog):
    with prefect_test_harness(server_startup_timeout=180):
        Secret(value=KEY).save("another-key")  # a block of another name does not count
        with pytest.raises(JudgeConfigError, match="'judge-key'") as info:
            provide_judge_key(cfg.eval)
        assert "ANTHROPIC_API_KEY" in str(info.value) and os.environ.get("ANTHROPIC_API_KEY") is None
        with pytest.raises(PreflightError) as info:
            preflight(cfg)
        assert "ANTHROPIC_API_KEY" in str(info.value) and "'judge-key' exist (eval.api_key_secret)" in str(info.value)
        assert KEY not in str(info.value)
        assert not secret_block_exists("judge-key") and secret_block_exists("another-key")

        Secret(value=KEY).save("judge-key")
        with caplog.at_level(logging.DEBUG):
            preflight(cfg)  # the block is there: only its presence is checked
        assert os.environ.get("ANTHROPIC_API_KEY") is None
        captured = capsys.readouterr()
        assert KEY not in captured.out + captured.err + caplog.text

        assert provide_judge_key(cfg.eval) == KEY  # handed to the stage, never put in the environment
        assert os.environ.get("ANTHROPIC_API_KEY") is None
        os.environ["ANTHROPIC_API_KEY"] = "sk-from-env"  # the environment wins over the block
        assert provide_judge_key(cfg.eval) == "sk-from-env"


def test_a_key_used_on_the_openai_api_is_never_sent_to_the_next_cells_server(prefect_api, monkeypatch):
    """Two cells of a sweep in one process: the first judged on the OpenAI API (reached through
    a loopback server acting as its proxy) with its key from a Prefect Secret block, as the
    stage task gives it; the next on another server. That server, recording each request's
    ``authorization`` header, is sent no key; with ``eval.api_key_variable`` naming a variable,
    it is sent that variable's key, and never OpenAI's, even exported as ``OPENAI_API_KEY``."""
    import uuid

    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from rlhf_core.config.credentials import judge_key_given
    from rlhf_core.evaluation.judging.openai_judge import NO_KEY
    from rlhf_core.evaluation.verdicts import make_judge
    from tests.chat_completions_api import ChatCompletionsAPI, completion_reply

    openai_key = "sk-proj-cell-one-0123456789abcdefghij"
    block = f"openai-key-{uuid.uuid4().hex[:8]}"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    answer = "Comparison: A is better.\nPreferred: A"
    with (
        temporary_settings(updates={PREFECT_API_URL: prefect_api}),
        ChatCompletionsAPI(api_key=openai_key, handler=lambda req: completion_reply(answer)) as openai_proxy,
        ChatCompletionsAPI(handler=lambda req: completion_reply(answer)) as other,
    ):
        Secret(value=openai_key).save(block)
        judged = ["eval.judge=openai", "eval.judge_model=m"]
        first = load_config(
            "smoke", [*judged, "eval.judge_base_url=http://api.openai.com/v1", f"eval.api_key_secret={block}"]
        )
        monkeypatch.setenv("HTTP_PROXY", openai_proxy.url)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        with judge_key_given(provide_judge_key(first.eval)):  # as tasks.stages.rlhf_stage does
            assert make_judge(first.eval, None, "base").answer("cell one") == answer
        [sent] = openai_proxy.requests
        assert sent.headers["host"] == "api.openai.com" and sent.headers["authorization"] == f"Bearer {openai_key}"
        assert os.environ.get("OPENAI_API_KEY") is None

        second = load_config("smoke", [*judged, f"eval.judge_base_url={other.base_url}"])
        with judge_key_given(provide_judge_key(second.eval)):
            assert make_judge(second.eval, None, "base").answer("cell two") == answer
        monkeypatch.setenv("OPENAI_API_KEY", openai_key)  # exported by the user: still OpenAI's only
        with judge_key_given(provide_judge_key(second.eval)):
            assert make_judge(second.eval, None, "base").answer("cell three") == answer
        monkeypatch.setenv("OTHER_SERVER_KEY", "other-server-key")
        named = load_config(
            "smoke", [*judged, f"eval.judge_base_url={other.base_url}", "eval.api_key_variable=OTHER_SERVER_KEY"]
        )
        assert named.eval.judge_needs_key and named.eval.judge_key_secret is None
        with judge_key_given(provide_judge_key(named.eval)):
            assert make_judge(named.eval, None, "base").answer("cell four") == answer
        sent = [r.headers["authorization"] for r in other.requests]
        assert sent == [f"Bearer {NO_KEY}", f"Bearer {NO_KEY}", "Bearer other-server-key"]
        assert all(openai_key not in str(r.headers) for r in other.requests)


def test_another_servers_key_named_only_as_a_block_is_refused_in_one_line_where_no_block_can_be_read(monkeypatch):
    cfg = load_config(
        "smoke",
        [
            "eval.judge=openai",
            "eval.judge_model=m",
            "eval.judge_base_url=http://127.0.0.1:1/v1",
            "eval.api_key_secret=b",
        ],
    )
    with pytest.raises(PreflightError) as info:
        check_judge_key(cfg)  # rlhf stages: no Prefect server to read the block
    assert str(info.value).startswith("eval.judge is openai on http://127.0.0.1:1/v1 and its key is in the Prefect")
    assert "None" not in str(info.value) and "eval.api_key_variable" in str(info.value)
    check_judge_key(cfg, secret_exists=lambda name: name == "b")
