"""The evaluation stage: its pieces against direct computations, and the whole stage with the
Anthropic judge served by a local Messages API server (tests/messages_api.py)."""

import json
import re

import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.data import load_data_tokenizer, load_prepared
from rlhf_core.diagnostics import paired_difference
from rlhf_core.evaluation import learning_checks, response_token_ranks, run_evaluation
from rlhf_core.generation import summarize, trim_left_padding, truncate_after_eos
from rlhf_core.models import load_causal_lm, save_pretrained_atomic
from rlhf_core.reward import ResponseScores, ScalarModel, get_reward, reward_model_from_causal_lm, score_responses
from tests.messages_api import MessagesAPI, error_reply, text_reply
from tests.stages import link_stages


@pytest.fixture(scope="module")
def stages(smoke_stages, tmp_path_factory):
    """Smoke data, a base model (perturbed, standing in for SFT, PPO and DPO) and a reward model made from it."""
    cfg = load_config("smoke")
    root = link_stages(smoke_stages, tmp_path_factory.mktemp("evaluation"), data="data", base="base")
    tokenizer = load_data_tokenizer(root / "data")
    for name in ("sft", "ppo", "dpo"):
        model = load_causal_lm(root / "base")
        torch.manual_seed({"sft": 1, "ppo": 2, "dpo": 3}[name])
        with torch.no_grad():  # a different policy each: perturbed weights
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        save_pretrained_atomic(model, root / name / "model", tokenizer)
    reward_model_from_causal_lm(root / "base", seed=1).save_pretrained(root / "reward_norm" / "model")
    (root / "reward").mkdir()
    (root / "reward_eval").mkdir()
    (root / "reward_eval" / "metrics.json").write_text(json.dumps({"eval/accuracy": 0.61}))
    (root / "dpo_eval").mkdir()
    dpo_accuracy = {"eval/accuracy": 0.5725, "eval/accuracy_ci_low": 0.5236, "eval/accuracy_ci_high": 0.62}
    (root / "dpo_eval" / "metrics.json").write_text(json.dumps(dpo_accuracy | {"eval/count": 400.0}))
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
    scored = score_responses(rm, queries, out.responses, pad, tokenizer.eos_token_id, -1.0, batch_size=2)
    for i in range(3):
        q = trim_left_padding(queries[i : i + 1], pad)
        _, expected, _ = get_reward(rm, torch.cat([q, out.responses[i : i + 1]], 1), pad, q.size(1))
        assert scored.raw_scores[i].item() == pytest.approx(expected.item(), abs=1e-5)
    assert scored.has_eos.equal(out.has_eos)
    assert scored.scores.equal(torch.where(out.has_eos, scored.raw_scores, -1.0))

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
    cfg = load_config(
        "smoke",
        [
            "eval.judge=anthropic",
            "eval.judge_model=claude-test-judge",
            "eval.max_samples=4",
            "eval.max_comparisons=16",
            "eval.diversity_prompts=0",
            "eval.token_shift_samples=1",
        ],
    )
    references = [r.strip() for r in load_prepared(root / "data")[0]["validation"]["reference_response"][:4]]
    calls = []

    def judge(request):
        calls.append(request)
        prompt = request.prompt
        a = re.search(r"Summary A:\n<summary>\n(.*?)\n</summary>\n\nSummary B:", prompt, re.S).group(1)
        reference_is_a = a.strip() in references
        if len(calls) == 1:
            return error_reply(429, "rate_limit_error")
        return text_reply(f"Comparison: A reads better.\nPreferred: {'A' if reference_is_a else 'B'}")

    def evaluate(out):
        reward_dirs = {k: root / k for k in ("reward", "reward_norm", "reward_eval")}
        args = (root / "data", root / "base", root / "sft", reward_dirs, root / "ppo", out)
        dpo_dirs = {"dpo": root / "dpo", "dpo_eval": root / "dpo_eval"}
        return run_evaluation(cfg, *args, judgement_cache=tmp_path / "cache.jsonl", dpo_dirs=dpo_dirs)

    with MessagesAPI(handler=judge, api_key="sk-test-secret") as api:
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-secret")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.url)
        metrics = evaluate(tmp_path / "out")
        assert len(calls) == 17  # 16 comparisons (4 policies x 4 prompts), one retried after the 429
        for policy in ("base", "sft", "ppo", "dpo"):
            assert metrics[f"eval/{policy}/win_rate"] == 0.0 and metrics[f"eval/{policy}/win_rate_n_valid"] == 4
        rows = [json.loads(line) for line in (tmp_path / "out" / "summaries.jsonl").read_text().splitlines()]
        # score: with the EOS trick (ppo.non_eos_penalty); raw_score: without
        for policy in ("base", "sft", "ppo", "dpo"):
            scores = [r[f"{policy}_raw_score"] if r[f"{policy}_has_eos"] else cfg.ppo.non_eos_penalty for r in rows]
            assert metrics[f"eval/{policy}/score"] == pytest.approx(sum(scores) / 4)
            assert metrics[f"eval/{policy}/raw_score"] == pytest.approx(sum(r[f"{policy}_raw_score"] for r in rows) / 4)
            assert metrics[f"eval/{policy}/eos_rate"] == sum(r[f"{policy}_has_eos"] for r in rows) / 4
        # the first table: PPO against SFT on the same prompts, paired
        diffs = [r["ppo_score"] - r["sft_score"] for r in rows]
        assert metrics["eval/checks/ppo_minus_sft_score"] == pytest.approx(sum(diffs) / 4)
        assert (
            metrics["eval/checks/ppo_minus_sft_score_ci_low"]
            <= sum(diffs) / 4
            <= metrics["eval/checks/ppo_minus_sft_score_ci_high"]
        )
        report = (tmp_path / "out" / "report.html").read_text()
        assert report.index("Does it learn?") < report.index("Headline")
        assert "RM score of PPO minus SFT summaries" in report and "accuracy, TL;DR validation comparisons" in report
        assert "claude-test-judge" in report and "sk-test-secret" not in report
        assert "0.0% [0.0, 49.0] (n=4)" in report  # Wilson interval of 0/4
        # the reward model beside DPO's implicit one, on the same pairs (Detail 19)
        md = (tmp_path / "out" / "report.md").read_text()
        assert "| TL;DR validation comparisons | 400 | 61.0% | 57.2% [52.4%, 62.0%] |" in md
        assert "DPO, post 1" in (tmp_path / "out" / "token_shift.html").read_text()
        # a second run is answered from the judgement cache: no request at all
        evaluate(tmp_path / "out2")
        assert len(calls) == 17
    for path in (tmp_path / "out").iterdir():
        if path.is_file() and path.suffix in (".json", ".jsonl", ".md", ".html"):
            assert "sk-test-secret" not in path.read_text(), path


def test_paired_difference():
    d = paired_difference([1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 1.0])  # differences 1, 2, 3, 3
    assert d["mean"] == pytest.approx(2.25) and d["n"] == 4
    assert d["std"] == pytest.approx(0.957427, abs=1e-6)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx(
        (2.25 - 1.959964 * 0.957427 / 2, 2.25 + 1.959964 * 0.957427 / 2), abs=1e-5
    )
    with pytest.raises(ValueError):
        paired_difference([1.0], [1.0, 2.0])


def test_learning_checks_state_each_target_with_its_interval():
    """The report's first table: each stage's check, its interval, and whether the target is met."""
    n = 100
    sft_metrics = {"eval/samples": float(n), "eval/eos_rate": 0.97, "eval/eos_rate_base": 0.0}
    sft_samples = [{"rougeL_sft": 0.25 + 0.01 * (i % 3), "rougeL_base": 0.15} for i in range(n)]
    rm_metrics = {
        "eval/accuracy": 0.58,
        "eval/count": 603.0,
        "eval/accuracy_ci_low": 0.54,
        "eval/accuracy_ci_high": 0.62,
        "eval/validation_cnndm/accuracy": 0.55,
        "eval/validation_cnndm/count": 64.0,
    }
    sft = ResponseScores(raw_scores=torch.zeros(64), scores=torch.zeros(64), has_eos=torch.ones(64, dtype=torch.bool))
    ppo_scores = torch.linspace(0.1, 0.5, 64)
    has_eos = torch.ones(64, dtype=torch.bool)
    has_eos[:8] = False  # 56 of 64 = 87.5%: below the 90% target
    ppo = ResponseScores(raw_scores=ppo_scores, scores=ppo_scores, has_eos=has_eos)
    rows, metrics = learning_checks(
        sft_metrics, sft_samples, rm_metrics, {"objective/kl": 2.0, "objective/kl_per_token": 0.05}, ppo, sft
    )
    by_check = {(r["stage"], r["check"]): r for r in rows}
    eos = by_check[("SFT", "greedy summaries that end with EOS")]
    assert eos["met"] is True and eos["n"] == n and eos["95% interval"] == "[91.5%, 99.0%]"  # Wilson, 97 of 100
    gain = by_check[("SFT", "ROUGE-L gain over the base model")]
    assert gain["met"] is True and metrics["eval/checks/sft_rougeL_gain"] == pytest.approx(0.11, abs=0.001)
    assert by_check[("reward model", "accuracy, TL;DR validation comparisons")]["met"] is True
    assert by_check[("reward model", "accuracy, CNN/DM comparisons")]["met"] is None  # reported, no target
    better = by_check[("PPO", "RM score of PPO minus SFT summaries, same prompts")]
    assert better["met"] is True and metrics["eval/checks/ppo_minus_sft_score"] == pytest.approx(0.3)
    assert by_check[("PPO", "greedy summaries that end with EOS")]["met"] is False
    assert metrics["eval/checks/ppo_kl_per_token"] == 0.05
    # a reward model at chance: its interval includes 0.5
    rows, _ = learning_checks({}, [], rm_metrics | {"eval/accuracy_ci_low": 0.46}, {}, ppo, sft)
    assert [r["met"] for r in rows if r["check"] == "accuracy, TL;DR validation comparisons"] == [False]
