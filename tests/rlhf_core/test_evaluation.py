"""The evaluation stage: its pieces against direct computations, and the whole stage with the
Anthropic judge served by a local Messages API server (tests/messages_api.py)."""

import json
import re

import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.data import load_data_tokenizer, load_prepared, prepare_data
from rlhf_core.evaluation import response_token_ranks, run_evaluation, score_responses, summarize
from rlhf_core.generation import trim_left_padding, truncate_after_eos
from rlhf_core.models import import_base_model, load_causal_lm, save_pretrained_atomic
from rlhf_core.reward import ScalarModel, get_reward, reward_model_from_causal_lm
from tests.messages_api import MessagesAPI, error_reply, text_reply


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """Smoke data, a base model (standing in for SFT and PPO too) and a reward model made from it."""
    cfg = load_config("smoke")
    root = tmp_path_factory.mktemp("evaluation")
    prepare_data(cfg, root / "data")
    import_base_model(cfg.model, root / "base")
    tokenizer = load_data_tokenizer(root / "data")
    for name in ("sft", "ppo"):
        model = load_causal_lm(root / "base")
        torch.manual_seed({"sft": 1, "ppo": 2}[name])
        with torch.no_grad():  # a different policy each: perturbed weights
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        save_pretrained_atomic(model, root / name / "model", tokenizer)
    reward_model_from_causal_lm(root / "base", seed=1).save_pretrained(root / "reward_norm" / "model")
    (root / "reward").mkdir()
    (root / "reward_eval").mkdir()
    (root / "reward_eval" / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.61}))
    return cfg, root


def test_scores_and_ranks_match_direct_forward_passes(stages):
    cfg, root = stages
    sft, _, stats = load_prepared(root / "data")
    tokenizer = load_data_tokenizer(root / "data")
    pad = tokenizer.pad_token_id
    queries = torch.tensor(sft["validation"]["query_token"][:3])
    policy = load_causal_lm(root / "sft" / "model")
    out = summarize(policy, tokenizer, queries, 12, 0.7, batch_size=2, seed=3)
    assert out.responses.shape == (3, 12) and len(out.texts) == 3
    assert summarize(policy, tokenizer, queries, 12, 0.7, batch_size=2, seed=3).texts == out.texts  # seeded
    assert truncate_after_eos(out.responses, tokenizer.eos_token_id, pad).equal(out.responses)  # PAD after EOS

    rm = ScalarModel.from_pretrained(str(root / "reward_norm" / "model"))
    scores = score_responses(rm, queries, out.responses, pad, batch_size=2)
    for i in range(3):
        q = trim_left_padding(queries[i : i + 1], pad)
        _, expected, _ = get_reward(rm, torch.cat([q, out.responses[i : i + 1]], 1), pad, q.size(1))
        assert scores[i].item() == pytest.approx(expected.item(), abs=1e-5)

    base = load_causal_lm(root / "base")
    ranks = response_token_ranks(base, queries, out.responses, pad)
    for i in range(3):
        q = trim_left_padding(queries[i : i + 1], pad)
        keep = int((out.responses[i] != pad).sum())
        logits = base(input_ids=torch.cat([q, out.responses[i : i + 1, :keep]], 1)).logits[0]
        for t in range(keep):
            row = logits[q.size(1) - 1 + t]
            assert ranks[i][t] == int((row > row[out.responses[i, t]]).sum()) + 1


@pytest.mark.slow
def test_stage_with_the_anthropic_judge_on_a_local_messages_api(stages, tmp_path, monkeypatch):
    """The server prefers whichever summary is the human reference, except for one policy's
    posts, and rate-limits the first request: the stage's win rates must follow exactly."""
    cfg, root = stages
    cfg = load_config("smoke", ["eval.judge=anthropic", "eval.judge_model=claude-test-judge", "eval.max_samples=4",
                                "eval.max_comparisons=12", "eval.diversity_prompts=0", "eval.token_shift_samples=1"])
    references = [r.strip() for r in load_prepared(root / "data")[0]["validation"]["reference_response"][:4]]
    calls = []

    def judge(request):
        calls.append(request)
        prompt = request.prompt
        a = re.search(r"Summary A:\n(.*?)\n\nSummary B:", prompt, re.S).group(1)
        reference_is_a = a.strip() in references
        if len(calls) == 1:
            return error_reply(429, "rate_limit_error")
        return text_reply(f"Comparison: A reads better.\nPreferred: {'A' if reference_is_a else 'B'}")

    with MessagesAPI(handler=judge, api_key="sk-test-secret") as api:
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-secret")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.url)
        metrics = run_evaluation(cfg, root / "data", root / "base", root / "sft",
                                 {k: root / k for k in ("reward", "reward_norm", "reward_eval")}, root / "ppo",
                                 tmp_path / "out", judgement_cache=tmp_path / "cache.jsonl")
        assert len(calls) == 13  # 12 comparisons, one of them retried after the 429
        for policy in ("base", "sft", "ppo"):
            assert metrics[f"eval/{policy}/win_rate"] == 0.0 and metrics[f"eval/{policy}/win_rate_n_valid"] == 4
        report = (tmp_path / "out" / "report.html").read_text()
        assert "claude-test-judge" in report and "sk-test-secret" not in report
        assert "0.0% [0.0, 49.0] (n=4)" in report  # Wilson interval of 0/4
        # a second run is answered from the judgement cache: no request at all
        run_evaluation(cfg, root / "data", root / "base", root / "sft",
                       {k: root / k for k in ("reward", "reward_norm", "reward_eval")}, root / "ppo",
                       tmp_path / "out2", judgement_cache=tmp_path / "cache.jsonl")
        assert len(calls) == 13
    for path in (tmp_path / "out").iterdir():
        if path.is_file() and path.suffix in (".json", ".jsonl", ".md", ".html"):
            assert "sk-test-secret" not in path.read_text(), path
