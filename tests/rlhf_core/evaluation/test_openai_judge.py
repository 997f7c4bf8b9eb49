"""The OpenAI judge (eval.judge: openai) through the real ``openai`` client against a local
Chat Completions server on 127.0.0.1 (tests/chat_completions_api.py): replies good and
malformed, retries, fatal statuses, timeouts, the key, the cache and both orders."""

import ast
import json
import re

import pytest

from rlhf_core.evaluation.judging import (
    Comparison,
    JudgeConfigError,
    Judgement,
    JudgementCache,
    JudgeRequestError,
    OpenAIJudge,
    judge_comparisons,
    prompt_sha256,
    response_is_a,
    win_counts,
)
from rlhf_core.evaluation.judging.openai_judge import NO_KEY, served_models
from tests.chat_completions_api import ChatCompletionsAPI, completion_body, completion_reply, error_reply
from tests.conftest import REPO, read_jsonl
from tests.messages_api import Reply

KEY = "sk-proj-test-0123456789-secret"
MODEL = "judge-test-model"
ANSWER_A = "Comparison: Summary A covers the breakup and the question; B misses the question.\nPreferred: A"
ANSWER_B = "Comparison: Summary B is more accurate and complete than A.\nPreferred: B"


@pytest.fixture(scope="module")
def comparisons(tldr_dir):
    """Real TL;DR posts and references; the response is the post's first sentence."""
    out = []
    for i, row in enumerate(read_jsonl(tldr_dir / "sft_validation.jsonl", limit=8)):
        first = re.split(r"(?<=[.!?])\s", row["post"].strip(), maxsplit=1)[0][:200]
        out.append(
            Comparison(
                id=row["id"] or f"validation-{i}",
                post=row["post"],
                title=row["title"],
                response=first,
                reference=row["summary"],
                policy="test-policy",
            )
        )
    return out


@pytest.fixture
def api():
    with ChatCompletionsAPI(api_key=KEY) as server:
        yield server
    assert server.handler_errors == []


def make_judge(api, **kwargs):
    kwargs.setdefault("max_retries", 2)
    kwargs.setdefault("timeout", 10)
    kwargs.setdefault("api_key", KEY)
    return OpenAIJudge(MODEL, base_url=api.base_url, **kwargs)


def letter_in(prompt: str, marker: str) -> str:
    """Which summary of the prompt contains ``marker``."""
    a = prompt.split("Summary A:\n", 1)[1].split("\n\nSummary B:\n", 1)[0]
    return "A" if marker in a else "B"


# ---------------------------------------------------------------------- requests and replies


def test_a_good_answer_sends_the_prompt_model_key_and_greedy_sampling(api, comparisons):
    api.push(completion_reply(ANSWER_A))
    judge = make_judge(api, max_tokens=123)
    [j] = judge_comparisons(judge, comparisons[:1], cache=None, seed=1, progress=False)
    [req] = api.requests
    assert req.method == "POST" and req.path == "/v1/chat/completions"
    assert req.headers["authorization"] == f"Bearer {KEY}"
    first = response_is_a(1, comparisons[0].id)
    assert req.json == {
        "model": MODEL,
        "messages": [{"role": "user", "content": comparisons[0].prompt(first)}],
        "max_tokens": 123,  # a server other than the OpenAI API: max_tokens, greedy
        "temperature": 0,
    }
    assert req.prompt.startswith("Which of the following summaries") and comparisons[0].reference in req.prompt
    assert j.id == comparisons[0].id and j.judge == MODEL and judge.name == MODEL and j.policy == "test-policy"
    assert j.preferred == "A" and j.response_is_a == first and j.response_wins == first
    assert j.answer == ANSWER_A and j.attempts == 1 and j.error is None and not j.cached
    assert j.prompt_sha256 == prompt_sha256(req.prompt)
    assert judge.usage == {"requests": 1, "input_tokens": 211, "output_tokens": 29}
    assert Judgement.from_dict(json.loads(json.dumps(j.to_dict()))) == j


def test_another_server_is_sent_only_the_key_given_for_it_never_openais(comparisons, monkeypatch):
    """A server other than the OpenAI API gets no key, even with ``OPENAI_API_KEY`` set; a key
    given for it (``api_key``) is sent."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ChatCompletionsAPI(handler=lambda req: completion_reply(ANSWER_B)) as local:
        judge = OpenAIJudge(MODEL, base_url=local.base_url, max_retries=0)
        assert judge.answer("hello") == ANSWER_B
        assert local.requests[-1].headers["authorization"] == f"Bearer {NO_KEY}"
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        assert OpenAIJudge(MODEL, base_url=local.base_url, max_retries=0).answer("hello") == ANSWER_B
        assert served_models(local.base_url) == [MODEL]
        assert [r.headers["authorization"] for r in local.requests[-2:]] == [f"Bearer {NO_KEY}"] * 2
        assert OpenAIJudge(MODEL, api_key="local-key", base_url=local.base_url).answer("hello") == ANSWER_B
        assert local.requests[-1].headers["authorization"] == "Bearer local-key"


def test_an_answer_cut_at_the_token_limit_is_an_error_reported_and_never_cached(api, comparisons, tmp_path):
    """A reasoning model that spends ``eval.judge_max_tokens`` thinking returns ``""`` with
    ``finish_reason`` ``length``: the comparison is an error, nothing is cached, and the next
    run asks again."""
    cache = JudgementCache(tmp_path / "cache.jsonl")
    api.push(completion_reply("", finish_reason="length"))
    [j] = judge_comparisons(make_judge(api, max_tokens=16), comparisons[:1], cache=cache, seed=1, progress=False)
    assert len(api.requests) == 1 and len(cache) == 0
    assert j.error is not None and "cut at its 16 tokens (finish_reason length)" in j.error
    assert "eval.judge_max_tokens" in j.error and j.preferred is None and win_counts([j])["errors"] == 1
    api.push(completion_reply(ANSWER_A))
    [again] = judge_comparisons(make_judge(api), comparisons[:1], cache=cache, seed=1, progress=False)
    assert len(api.requests) == 2 and again.error is None and again.preferred == "A" and len(cache) == 1


@pytest.mark.parametrize(
    ("base_url", "request_shape", "openai_shape"),
    [
        ("http://api.openai.com/v1", None, True),
        ("http://eu.api.openai.com/v1", None, True),
        ("http://127.0.0.1:1/v1", None, False),
        ("http://my-resource.openai.azure.com/v1", "openai", True),
        ("http://api.openai.com/v1", "compatible", False),
    ],
)
def test_the_request_shape_follows_the_openai_apis_hosts_unless_a_setting_chooses(
    base_url, request_shape, openai_shape, monkeypatch
):
    """OpenAI's shape (``max_completion_tokens``, no temperature) on ``api.openai.com`` and its
    regional hosts; ``eval.judge_request`` chooses it for another server (Azure OpenAI) or
    turns it off; ``OPENAI_API_KEY`` goes to the OpenAI API's hosts only."""
    from rlhf_core.config.presets import load_config

    overrides = ["eval.judge=openai", "eval.judge_model=m", f"eval.judge_base_url={base_url}"]
    cfg = load_config("smoke", overrides + ([f"eval.judge_request={request_shape}"] if request_shape else [])).eval
    assert cfg.openai_request is openai_shape
    assert (cfg.judge_key_variable == "OPENAI_API_KEY") is ("api.openai.com" in base_url)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with ChatCompletionsAPI(api_key=KEY if "api.openai.com" in base_url else None) as proxy:
        proxy.push(completion_reply(ANSWER_A))
        for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        judge = OpenAIJudge("m", base_url=base_url, max_retries=0, max_tokens=64, openai_request=cfg.openai_request)
        assert judge.answer("hello") == ANSWER_A
        [req] = proxy.requests
    limits = {"max_completion_tokens": 64} if openai_shape else {"max_tokens": 64, "temperature": 0}
    assert req.json == {"model": "m", "messages": [{"role": "user", "content": "hello"}]} | limits
    sent = req.headers["authorization"]
    assert sent == (f"Bearer {KEY}" if "api.openai.com" in base_url else f"Bearer {NO_KEY}")


def test_the_openai_api_needs_a_key_and_gets_max_completion_tokens_without_temperature(monkeypatch):
    """The OpenAI API (host api.openai.com), reached through the local server as a plain-HTTP proxy."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(
        JudgeConfigError, match=r"needs an API key for https://api\.openai\.com/v1: set .*OPENAI_API_KEY"
    ):
        OpenAIJudge("gpt-test")
    with ChatCompletionsAPI(api_key=KEY) as proxy:
        proxy.push(completion_reply(ANSWER_A))
        for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        judge = OpenAIJudge("gpt-test", base_url="http://api.openai.com/v1", max_retries=0, max_tokens=64)
        assert judge.answer("hello") == ANSWER_A
        [req] = proxy.requests
        assert req.headers["host"] == "api.openai.com" and req.headers["authorization"] == f"Bearer {KEY}"
        assert req.json == {
            "model": "gpt-test",
            "messages": [{"role": "user", "content": "hello"}],
            "max_completion_tokens": 64,
        }


@pytest.mark.parametrize(
    "reply",
    [
        Reply(200, "<html>upstream gateway</html>"),  # claims JSON, is not
        Reply(200, "plain text", content_type="text/plain"),
        Reply(200, {k: v for k, v in completion_body(ANSWER_A).items() if k != "choices"}),
        Reply(200, completion_body(ANSWER_A) | {"choices": []}),
    ],
    ids=["bad-json", "text-plain", "no-choices", "empty-choices"],
)
def test_a_malformed_reply_is_a_recorded_error_not_a_crash(api, comparisons, tmp_path, reply):
    cache = JudgementCache(tmp_path / "cache.jsonl")
    api.push(reply)
    [j] = judge_comparisons(make_judge(api), comparisons[:1], cache=cache, seed=1, progress=False)
    assert len(api.requests) == 1  # not retried: the reply came
    assert j.error is not None and ("unreadable reply" in j.error or "not a chat completion" in j.error)
    assert j.preferred is None and j.response_wins is None
    assert len(cache) == 0  # asked again next time


def test_null_content_is_an_answer_naming_neither_summary(api, comparisons, tmp_path):
    """Null content (a refusal) is asked again once, then invalid."""
    cache = JudgementCache(tmp_path / "cache.jsonl")
    api.push(completion_reply(None), completion_reply(None, refusal="I can't help with that."))
    [j] = judge_comparisons(make_judge(api), comparisons[:1], cache=cache, seed=1, progress=False)
    assert len(api.requests) == 2 and j.error is None and j.attempts == 2
    assert j.preferred is None and j.answer == "I can't help with that." and win_counts([j])["invalid"] == 1
    assert len(cache) == 1


def test_an_answer_naming_neither_summary_is_asked_again_once_then_invalid_and_cached(api, comparisons, tmp_path):
    cache = JudgementCache(tmp_path / "cache.jsonl")
    judge = make_judge(api)
    rambling = "Comparison: Both summaries have merits and I cannot decide."
    api.push(completion_reply(rambling), completion_reply(rambling + "\nPreferred: neither"))
    [j] = judge_comparisons(judge, comparisons[:1], cache=cache, seed=1, progress=False)
    assert len(api.requests) == 2 and api.requests[0].json == api.requests[1].json
    assert j.preferred is None and j.response_wins is None and j.error is None and j.attempts == 2
    assert j.answer.endswith("Preferred: neither") and win_counts([j])["invalid"] == 1
    [again] = judge_comparisons(judge, comparisons[:1], cache=cache, seed=1, progress=False)
    assert len(api.requests) == 2 and again.cached and again.preferred is None and again.error is None
    api.push(completion_reply("Comparison: hmm."), completion_reply(ANSWER_B))  # a second try that reads
    [k] = judge_comparisons(judge, comparisons[1:2], cache=None, seed=1, progress=False)
    assert len(api.requests) == 4 and k.preferred == "B" and k.attempts == 2


# ---------------------------------------------------------------------- retries and failures


def test_a_rate_limit_is_waited_out_as_retry_after_asks_then_answered(api, comparisons):
    api.push(
        error_reply(
            429, "rate_limit_exceeded", "Rate limit reached", retry_after_ms=None, headers={"retry-after": "0.2"}
        ),
        completion_reply(ANSWER_B),
    )
    [j] = judge_comparisons(make_judge(api, max_retries=1), comparisons[:1], cache=None, seed=1, progress=False)
    assert len(api.requests) == 2 and api.requests[0].json == api.requests[1].json
    assert api.requests[1].received_at - api.requests[0].received_at >= 0.19  # waited as asked
    assert j.preferred == "B" and j.error is None and j.attempts == 1


def test_server_errors_are_retried_then_recorded_not_fatal_not_cached(api, comparisons, tmp_path):
    cache = JudgementCache(tmp_path / "cache.jsonl")
    api.push(*[error_reply(500, "server_error", "The server had an error")] * 3)
    out = judge_comparisons(
        make_judge(api, max_retries=2), comparisons[:2], cache=cache, seed=1, concurrency=1, progress=False
    )
    assert len(api.requests) == 3 + 1  # 1 + max_retries, then the next comparison (unscripted: 500, no retry)
    j = out[0]
    assert j.error is not None and "HTTP 500 server_error" in j.error and "gave up after 2 retries" in j.error
    assert j.preferred is None and j.answer is None and len(cache) == 0
    assert win_counts(out)["errors"] == 2
    api.push(completion_reply(ANSWER_A))
    [j] = judge_comparisons(make_judge(api), comparisons[:1], cache=cache, seed=1, progress=False)
    assert j.preferred == "A" and j.error is None and len(cache) == 1


@pytest.mark.parametrize(
    ("key", "reply", "shown"),
    [
        ("sk-proj-wrong-key-42", None, "HTTP 401 invalid_api_key"),
        (
            KEY,
            error_reply(404, "model_not_found", "The model `judge-test-model` does not exist"),
            "HTTP 404 model_not_found",
        ),
    ],
    ids=["401", "404"],
)
def test_a_wrong_key_or_model_is_fatal_and_stops_the_evaluation(api, comparisons, tmp_path, key, reply, shown):
    if reply is not None:
        api.push(reply)
    cache = JudgementCache(tmp_path / "cache.jsonl")
    with pytest.raises(JudgeRequestError, match=shown) as info:
        judge_comparisons(
            make_judge(api, api_key=key, max_retries=3),
            comparisons[:3],
            cache=cache,
            seed=1,
            concurrency=1,
            progress=False,
        )
    assert info.value.fatal and info.value.status == int(shown.split()[1]) and key not in str(info.value)
    assert len(api.requests) == 1 and len(cache) == 0  # not retried, and nothing more asked


def test_a_timeout_is_retried_then_recorded(comparisons):
    with ChatCompletionsAPI(handler=lambda req: Reply(200, completion_body(ANSWER_A), delay=1.5)) as slow:
        judge = OpenAIJudge(MODEL, base_url=slow.base_url, max_retries=1, timeout=0.2)
        [j] = judge_comparisons(judge, comparisons[:1], cache=None, seed=1, progress=False)
        assert len(slow.requests) == 2
    assert "timed out after 0.2 s" in j.error and j.preferred is None


def test_a_server_that_is_down_is_recorded(comparisons):
    from tests.servers import free_port

    judge = OpenAIJudge(MODEL, api_key=KEY, base_url=f"http://127.0.0.1:{free_port()}/v1", max_retries=0)
    [j] = judge_comparisons(judge, comparisons[:1], cache=None, seed=1, progress=False)
    assert "connection to http://127.0.0.1:" in j.error and "Connection refused" in j.error and j.preferred is None


def test_the_key_is_never_shown(api, monkeypatch):
    judge = OpenAIJudge(MODEL, api_key=KEY, base_url=api.base_url, max_retries=1)
    assert KEY not in repr(judge) and KEY not in str(judge) and api.base_url in repr(judge)
    api.push(*[error_reply(500, "server_error", f"internal error for key {KEY}")] * 2)  # a server echoing it
    with pytest.raises(JudgeRequestError) as info:
        judge.answer("hello")
    assert "500" in str(info.value) and "[redacted]" in str(info.value) and len(api.requests) == 2
    assert KEY not in str(info.value) and KEY not in repr(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # the SDK's error is not chained
    api.push(Reply(200, f"<html>{KEY}</html>"))
    with pytest.raises(JudgeRequestError, match="unreadable reply") as info:
        judge.answer("hello")
    assert KEY not in str(info.value) and info.value.__cause__ is None


# ---------------------------------------------------------------------- the cache and the orders


def test_a_second_run_is_answered_from_the_cache(api, comparisons, tmp_path):
    api.handler = lambda req: completion_reply(ANSWER_A if letter_in(req.prompt, "Hi,") == "A" else ANSWER_B)
    path = tmp_path / "cache.jsonl"
    items = [
        Comparison(id=c.id, post=c.post, response="Hi, " + c.response, reference=c.reference) for c in comparisons[:6]
    ]
    first = judge_comparisons(make_judge(api), items, cache=JudgementCache(path), seed=2, progress=False)
    assert len(api.requests) == 6 and all(j.response_wins for j in first)
    second = judge_comparisons(make_judge(api), items, cache=JudgementCache(path), seed=2, progress=False)
    assert len(api.requests) == 6  # no new request
    assert all(j.cached and j.attempts == 0 and j.judge == MODEL for j in second)
    assert [j.preferred for j in second] == [j.preferred for j in first]


def test_both_orders_send_two_swapped_prompts_per_comparison(api, comparisons):
    api.handler = lambda req: completion_reply(ANSWER_A if letter_in(req.prompt, "Hi,") == "A" else ANSWER_B)
    items = [
        Comparison(id=c.id, post=c.post, response="Hi, " + c.response, reference=c.reference) for c in comparisons[:4]
    ]
    out = judge_comparisons(make_judge(api), items, cache=None, seed=3, orders="both", concurrency=1, progress=False)
    prompts = [r.prompt for r in api.requests]
    assert len(prompts) == 8 and len(set(prompts)) == 8
    for c, j in zip(items, out):
        assert {c.prompt(True), c.prompt(False)} <= set(prompts)  # the response once as A, once as B
        assert j.swapped is not None and j.swapped.response_is_a == (not j.response_is_a)
        assert j.prompt_sha256 == prompt_sha256(c.prompt(j.response_is_a))
        assert j.outcome == 1.0 and j.orders_agree
    assert win_counts(out)["wins"] == 4


# ---------------------------------------------------------------------- the model list, the SDK's place


def test_served_models_lists_the_ids_and_scrubs_the_key(api):
    api.models = [MODEL, "other-model"]
    assert served_models(api.base_url, KEY) == [MODEL, "other-model"]
    assert api.requests[-1].method == "GET" and api.requests[-1].path == "/v1/models"
    with pytest.raises(JudgeRequestError, match="HTTP 401") as info:
        served_models(api.base_url, "sk-proj-wrong-key-42")
    assert info.value.status == 401 and "sk-proj-wrong-key-42" not in str(info.value)
    api.models_reply = error_reply(500, "server_error", f"cannot list models for {KEY}", retry_after_ms=None)
    with pytest.raises(JudgeRequestError, match=r"HTTP 500 server_error: cannot list models for \[redacted\]") as info:
        served_models(api.base_url, KEY)
    assert info.value.status == 500 and KEY not in str(info.value) and len(api.requests) == 3  # no retry


def test_only_the_openai_judge_imports_the_sdk():
    importers = []
    for path in sorted((REPO / "rlhf_core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(n == "openai" or n.startswith("openai.") for n in names):
                importers.append(path.relative_to(REPO).as_posix())
    assert importers == ["rlhf_core/evaluation/judging/openai_judge.py"]
