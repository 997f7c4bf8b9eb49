"""Judge calls traced in MLflow (mlflow.anthropic.autolog, mlflow.openai.autolog), against a local
Messages-API or Chat Completions server, with the API key in no trace."""

import json

import pytest
from mlflow.tracking import MlflowClient

from rlhf_core.evaluation.judging import AnthropicJudge, Comparison, OpenAIJudge, judge_comparisons
from tasks.mlflow_tracking import traced_judge_calls
from tests.chat_completions_api import ChatCompletionsAPI, completion_reply
from tests.messages_api import MessagesAPI, text_reply

KEY = "sk-ant-test-tracing-0123456789-secret"
OPENAI_KEY = "sk-proj-test-tracing-0123456789-secret"


@pytest.mark.heavy
def test_judge_calls_are_traced_in_the_stage_run_without_the_key(cached_db, tmp_path, sft_rows):
    client = MlflowClient(tracking_uri=cached_db)
    experiment = client.create_experiment("judge", artifact_location=(tmp_path / "mlartifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id  # traces under tmp_path, not ./mlruns
    comparisons = [
        Comparison(id=f"c{i}", post=r["post"], title=r["title"], response=r["summary"], reference=r["summary"])
        for i, r in enumerate(sft_rows[:3])
    ]
    with MessagesAPI(api_key=KEY) as api:
        for _ in comparisons:
            api.push(text_reply("Comparison: equal.\nPreferred: A"))
        judge = AnthropicJudge("claude-judge-test", api_key=KEY, base_url=api.url, max_retries=0, timeout=10)
        with traced_judge_calls(client, run_id):
            judged = judge_comparisons(judge, comparisons, cache=None, seed=1, progress=False)
        assert len(api.requests) == 3 and all(j.error is None for j in judged)
        # outside the block nothing is traced any more
        judge_comparisons(judge, comparisons[:1], cache=None, seed=2, progress=False)
    traces = client.search_traces(locations=[client.get_run(run_id).info.experiment_id])
    assert len(traces) == 3
    text = json.dumps([t.to_dict() for t in traces])
    assert "Which of the following summaries" in text and "claude-judge-test" in text
    assert KEY not in text and KEY[:20] not in text


def test_openai_judge_calls_are_traced_without_the_key(cached_db, tmp_path, sft_rows):
    """The same for the OpenAI judge (mlflow.openai.autolog) on a local Chat Completions server."""
    client = MlflowClient(tracking_uri=cached_db)
    experiment = client.create_experiment("judge", artifact_location=(tmp_path / "mlartifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    comparisons = [
        Comparison(id=f"c{i}", post=r["post"], title=r["title"], response=r["summary"], reference=r["summary"])
        for i, r in enumerate(sft_rows[:2])
    ]
    with ChatCompletionsAPI(
        api_key=OPENAI_KEY, handler=lambda req: completion_reply("Comparison: equal.\nPreferred: B")
    ) as api:
        judge = OpenAIJudge("judge-test-model", api_key=OPENAI_KEY, base_url=api.base_url, max_retries=0, timeout=10)
        with traced_judge_calls(client, run_id, "openai"):
            judged = judge_comparisons(judge, comparisons, cache=None, seed=1, progress=False)
        assert len(api.requests) == 2 and all(j.preferred == "B" for j in judged)
        judge_comparisons(judge, comparisons[:1], cache=None, seed=2, progress=False)  # not traced
    traces = client.search_traces(locations=[client.get_run(run_id).info.experiment_id])
    assert len(traces) == 2
    text = json.dumps([t.to_dict() for t in traces])
    assert "Which of the following summaries" in text and "judge-test-model" in text and "Preferred: B" in text
    assert OPENAI_KEY not in text and OPENAI_KEY[:20] not in text
