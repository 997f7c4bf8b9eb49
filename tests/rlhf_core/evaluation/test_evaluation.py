"""The evaluation stage: its pieces against direct computations, and the whole stage with the
Anthropic judge served by a local Messages API server (tests/messages_api.py) and with the OpenAI
judge served by a local Chat Completions server (tests/chat_completions_api.py)."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from rlhf_core.common.tracking import NullTracker
from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import EvalConfig
from rlhf_core.data.prepared import load_data_tokenizer, load_prepared
from rlhf_core.evaluation.judging import JudgementCache
from rlhf_core.evaluation.token_shift import response_token_ranks
from rlhf_core.evaluation.verdicts import judge_human_metrics
from rlhf_core.metrics.statistics import agreement, paired_difference
from rlhf_core.models.saved import load_causal_lm, save_pretrained_atomic
from rlhf_core.report.learning_checks import learning_checks, reward_model_checks
from rlhf_core.report.run_report import (
    PAPER_POLICY_PAIRS,
    REPORT_FILES,
    REWARD_LOGITS_HEADING,
    TOP_PAIRS,
    VALUE_VS_REWARD_HEADING,
    estimator_note,
    judge_at_chance,
    judge_note,
    per_token_sections,
    policy_pair_notes,
    policy_pair_rows,
    reward_model_rows,
    value_reward_rows,
)
from rlhf_core.run.pipeline import STAGES
from rlhf_core.train.generation import summarize, trim_left_padding, truncate_after_eos
from rlhf_core.train.reward import ResponseScores, ScalarModel, get_reward, reward_model_from_causal_lm, score_responses
from rlhf_core.views.page import write_report
from rlhf_core.views.plots import plot_reward_logits, plot_value_vs_reward
from tests.chat_completions_api import ChatCompletionsAPI, completion_reply
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
            "eval.judge_human_comparisons=4",
            "eval.diversity_prompts=0",
            "eval.token_shift_samples=1",
        ],
    )
    assert cfg.eval.orders == "one"  # the API judge's default: the paper's one order per comparison
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

    def evaluate(out):  # the pipeline's stage: the evaluation, then the report
        names = ("data", "base", "sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval")
        return STAGES["evaluation"].run(cfg, [root / name for name in names], out, NullTracker())

    with MessagesAPI(handler=judge, api_key="sk-test-secret") as api:
        monkeypatch.setenv("RLHF_JUDGE_CACHE", str(tmp_path / "cache.jsonl"))
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-secret")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.url)
        metrics = evaluate(tmp_path / "out")
        # 16 comparisons (4 policies x 4 prompts), one retried after the 429, and 4 human-labelled ones
        assert len(calls) == 21
        # the human-labelled comparisons: the server answers "B" whenever A is no reference
        human = [json.loads(line) for line in (tmp_path / "out" / "judgements.jsonl").read_text().splitlines()]
        human = [j for j in human if j["policy"] == "human-chosen"]
        assert len(human) == 4 and all(j["preferred"] == "B" and j["swapped"] is None for j in human)
        assert metrics["eval/judge/human_n"] == 4 and metrics["eval/judge/a_share"] == 0.0
        assert metrics["eval/judge/human_agreement"] == sum(not j["response_is_a"] for j in human) / 4
        assert "eval/judge/order_consistency" not in metrics  # one order: not measured
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
        # (a) the RLHF objective: score - kl_coef * the summary's KL from SFT, minus SFT's score
        objective = [r["ppo_score"] - cfg.ppo.kl_coef * r["ppo_kl_vs_sft"] - r["sft_score"] for r in rows]
        assert metrics["eval/checks/ppo_objective_gain"] == pytest.approx(sum(objective) / 4)
        for policy in ("ppo", "dpo"):  # both trained away from SFT: a KL on every summary
            assert metrics[f"eval/{policy}/kl_vs_sft"] == pytest.approx(sum(r[f"{policy}_kl_vs_sft"] for r in rows) / 4)
            assert all(r[f"{policy}_kl_vs_sft"] != 0 for r in rows)
        assert metrics["eval/checks/dpo_kl_vs_sft"] == metrics["eval/dpo/kl_vs_sft"]
        report = (tmp_path / "out" / "report.html").read_text()
        assert "RLHF objective (RM score - 0.05 x KL from SFT) minus SFT" in report
        assert "implicit reward model accuracy" in report  # DPO's, against the same baselines
        assert report.index("Does it learn?") < report.index("Headline")
        assert "RM score of PPO minus SFT summaries" in report and "accuracy, TL;DR validation comparisons" in report
        assert "claude-test-judge" in report and "sk-test-secret" not in report
        assert "0.0% [0.0, 49.0] (n=4)" in report  # Wilson interval of 0/4
        assert "The judge is at chance on human labels" in report  # 4 comparisons: an interval around 0.5
        assert "chose the summary shown as A 0.0% of the time" in report
        # the reward model beside DPO's implicit one, on the same pairs (Detail 19)
        md = (tmp_path / "out" / "report.md").read_text()
        assert "| TL;DR validation comparisons | 400 | 61.0% | 57.2% [52.4%, 62.0%] |" in md
        # Table 2 from the data stage's stats.json, beside the paper's: the offline train split is one pair
        assert "| train | 32 | 1 | 32 / 32 / 32 | 92858 | 47 | 53 / 470 / 18065 | ref, sup2 (18065) |" in md
        assert "| train | sup4_12b_t0.7, sup4_ppo_rm4_t.7 | 32 | 100.0% |" in md
        assert "These rows were read from local files" in md
        assert "DPO, post 1" in (tmp_path / "out" / "token_shift.html").read_text()
        # a second run is answered from the judgement cache: no request at all
        evaluate(tmp_path / "out2")
        assert len(calls) == 21
    for path in (tmp_path / "out").iterdir():
        if path.is_file() and path.suffix in (".json", ".jsonl", ".md", ".html"):
            assert "sk-test-secret" not in path.read_text(), path


@pytest.mark.slow
def test_stage_with_an_openai_compatible_judge_in_both_orders(stages, tmp_path, monkeypatch):
    """eval.judge openai on a local Chat Completions server (no key), both orders: the server
    prefers the human reference over each policy's summary and the human's chosen summary over
    the rejected one, whichever is A; every comparison is asked in both orders and the report
    names the judge and its agreement with the human labels."""
    cfg, root = stages
    with ChatCompletionsAPI() as api:
        cfg = load_config(
            "smoke",
            [
                "eval.judge=openai",
                "eval.judge_model=judge-test-model",
                f"eval.judge_base_url={api.base_url}",
                "eval.judge_orders=both",
                "eval.max_samples=2",
                "eval.judge_human_comparisons=4",
                "eval.diversity_prompts=0",
                "eval.token_shift_samples=1",
            ],
        )
        sft, pref, _ = load_prepared(root / "data")
        references = {r.strip() for r in sft["validation"]["reference_response"][:2]}
        human = pref["validation"].select(range(4))
        # the human-labelled rows (here four comparisons of one post): each pair of summaries to its chosen one
        chosen = {frozenset((c.strip(), r.strip())): c.strip() for c, r in zip(human["chosen"], human["rejected"])}
        pairs = []

        def judge(request):
            post, a, b = (
                text.strip()
                for text in re.search(
                    r"<post>\n(.*?)\n</post>.*?<summary>\n(.*?)\n</summary>.*?<summary>\n(.*?)\n</summary>",
                    request.prompt,
                    re.S,
                ).groups()
            )
            pairs.append((post, a, b))
            pair = frozenset((a, b))
            better = a == chosen[pair] if pair in chosen else a in references
            return completion_reply(f"Comparison: one reads better.\nPreferred: {'A' if better else 'B'}")

        api.handler = judge
        monkeypatch.setenv("RLHF_JUDGE_CACHE", str(tmp_path / "cache.jsonl"))
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        names = ("data", "base", "sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval")
        metrics = STAGES["evaluation"].run(cfg, [root / name for name in names], tmp_path / "out", NullTracker())
        assert api.handler_errors == [] and {r.headers["authorization"] for r in api.requests} == {"Bearer no-key"}
    # 8 policy comparisons (4 policies x 2 prompts) and 4 human-labelled ones, each in both orders
    assert len(pairs) == 24 and Counter(pairs) == Counter((p, b, a) for p, a, b in pairs)  # each pair swapped too
    judged = [json.loads(line) for line in (tmp_path / "out" / "judgements.jsonl").read_text().splitlines()]
    assert len(judged) == 12 and all(j["judge"] == "judge-test-model" for j in judged)
    assert all(j["swapped"]["response_is_a"] is not j["response_is_a"] for j in judged)
    for policy in ("base", "sft", "ppo", "dpo"):
        assert metrics[f"eval/{policy}/win_rate"] == 0.0 and metrics[f"eval/{policy}/win_rate_n_valid"] == 2
    assert metrics["eval/judge/human_n"] == 4 and metrics["eval/judge/human_agreement"] == 1.0
    assert metrics["eval/judge/order_consistency"] == 1.0
    for name in ("report.md", "report.html"):
        report = (tmp_path / "out" / name).read_text()
        assert "judged by judge-test-model with the prompt of Huang et al. (2024), Appendix I" in report
        assert "each comparison judged in both A/B orders" in report
        assert (
            "The judge is better than chance on human labels: it agreed with the human label on 100.0% [51.0%, 100.0%]"
            in report
        )
        assert "4 human-labelled comparisons of the validation preference split" in report
        assert "picked the same summary in both orders 100.0% of the time" in report


@pytest.mark.heavy
def test_a_judge_with_no_readable_verdict_stops_the_stage_and_its_answers_stay_cached(stages, tmp_path, monkeypatch):
    """A server whose every answer names neither summary (a 135M model's): the evaluation stage
    ends with an error naming the judge and showing an answer, its answers cached so that a
    re-run asks nothing again; with ``eval.max_unreadable`` 1 the report says so in one line at
    the top of the judge's notes, and prints no nan and no "at chance"."""
    from rlhf_core.evaluation.judging import JudgeUnreadableError

    cfg, root = stages
    names = ("data", "base", "sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval")
    inputs = [root / name for name in names]
    monkeypatch.setenv("RLHF_JUDGE_CACHE", str(tmp_path / "cache.jsonl"))
    with ChatCompletionsAPI(handler=lambda req: completion_reply("I think both are about a cat.")) as api:
        overrides = [
            "eval.judge=openai",
            "eval.judge_model=tiny-judge",
            f"eval.judge_base_url={api.base_url}",
            "eval.max_samples=2",
            "eval.judge_human_comparisons=2",
            "eval.diversity_prompts=0",
            "eval.token_shift_samples=1",
        ]
        cfg = load_config("smoke", overrides)
        for attempt in range(2):
            with pytest.raises(JudgeUnreadableError) as info:
                STAGES["evaluation"].run(cfg, inputs, tmp_path / f"out{attempt}", NullTracker())
            message = str(info.value)
            assert message.startswith("judge tiny-judge: 8 of 8 answers on the policies' summaries name neither")
            assert "eval.max_unreadable=0.5" in message and "'I think both are about a cat.'" in message
            assert len(api.requests) == 16  # each asked twice on the first run, none on the second
        assert 0 < len(JudgementCache(tmp_path / "cache.jsonl")) <= 8  # one per distinct prompt
        lenient = load_config("smoke", [*overrides, "eval.max_unreadable=1"])
        STAGES["evaluation"].run(lenient, inputs, tmp_path / "out", NullTracker())
    report = (tmp_path / "out" / "report.md").read_text()
    line = "The judge tiny-judge gave no readable verdict: 8 answers, none naming a summary (for example 'I think both"
    assert line in report and report.index(line) < report.index("Win rates: share of valid judgements")
    assert "nan" not in report.lower() and "at chance" not in report
    assert "could not be measured: it gave no readable verdict on them" in report


def test_the_report_says_in_words_when_the_judge_is_at_chance_on_human_labels():
    at_chance = {
        "n": 1576,
        "agreement": 0.503,
        "agreement_ci": [0.478, 0.528],
        "a_share": 0.5,
        "order_consistency": 0.02,
    }
    better = at_chance | {"agreement": 0.62, "agreement_ci": [0.596, 0.644], "order_consistency": 0.7}
    offline, api = EvalConfig(), EvalConfig(judge="anthropic", judge_model="m")
    assert (offline.orders, api.orders) == ("both", "one")
    assert judge_at_chance(at_chance) and not judge_at_chance(better) and judge_at_chance({})
    text = judge_note("offline:x", offline, 64, at_chance | {"split": "validation"})
    assert "The judge is at chance on human labels: it agreed with the human label on 50.3% [47.8%, 52.8%]" in text
    assert "1576 human-labelled comparisons of the validation preference split" in text
    assert "chose the summary shown as A 50.0% of the time" in text and "both orders 2.0% of the time" in text
    assert "both A/B orders" in text and "do not tell the policies' summaries apart" in text
    text = judge_note("claude", api, 64, better | {"split": "validation", "order_consistency": None})
    assert "better than chance on human labels: it agreed with the human label on 62.0%" in text
    assert "A/B order randomised per comparison" in text and "both orders" not in text
    assert "not measured" in judge_note("claude", api, 64, {})
    below = at_chance | {"agreement": 0.443, "agreement_ci": [0.419, 0.468], "split": "validation"}
    assert not judge_at_chance(below)
    text = judge_note("offline:x", offline, 64, below)
    assert "The judge is below chance on human labels: it agreed with the human label on 44.3% [41.9%, 46.8%]" in text
    assert "better than chance" not in text
    metrics = judge_human_metrics(better | {"split": "validation"})
    assert metrics["eval/judge/human_agreement_ci_low"] == 0.596 and metrics["eval/judge/order_consistency"] == 0.7
    assert judge_human_metrics({}) == {}


def test_paired_difference():
    d = paired_difference([1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 1.0])  # differences 1, 2, 3, 3
    assert d["mean"] == pytest.approx(2.25) and d["n"] == 4
    assert d["std"] == pytest.approx(0.957427, abs=1e-6)
    # Student's t with 3 degrees of freedom: 3.182446 (the normal's 1.959964 is 38% narrower)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx(
        (2.25 - 3.182446 * 0.957427 / 2, 2.25 + 3.182446 * 0.957427 / 2), abs=1e-5
    )
    wide = paired_difference([float(i % 3) for i in range(8)], [0.0] * 8)  # n = 8: t 2.364624
    assert wide["ci_high"] - wide["mean"] == pytest.approx(2.364624 * wide["std"] / 8**0.5, rel=1e-6)
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
    # no comparisons held out of train: the validation accuracy is the target, named out of distribution
    assert by_check[("reward model", OOD_CHECK)]["met"] is True
    assert by_check[("reward model", OOD_CHECK)]["target"] == "interval above 50%"
    assert by_check[("reward model", "accuracy, CNN/DM comparisons, another task (news articles)")]["met"] is None
    # (d) the score gain is reported, not a target
    better = by_check[("PPO", "RM score of PPO minus SFT summaries, same prompts")]
    assert better["met"] is None and metrics["eval/checks/ppo_minus_sft_score"] == pytest.approx(0.3)
    assert by_check[("PPO", "greedy summaries that end with EOS")]["met"] is False  # (b)
    assert metrics["eval/checks/ppo_kl_per_token"] == 0.05
    # (a) the RLHF objective: score - kl_coef * KL from SFT, minus SFT's score, t interval above 0
    objective = "RLHF objective (RM score - 0.2 x KL from SFT) minus SFT's, same prompts"
    small_kl = {"ppo": [0.5] * 64}  # 0.3 - 0.2 * 0.5 = +0.2 a prompt, on average
    rows, metrics = learning_checks({}, [], {}, {}, ppo, sft, kl=small_kl, kl_coef=0.2)
    row = {r["check"]: r for r in rows}[objective]
    assert row["met"] is True and row["target"] == "interval above 0" and row["n"] == 64
    assert metrics["eval/checks/ppo_objective_gain"] == pytest.approx(0.2)
    expected = paired_difference([s - 0.1 for s in ppo_scores.tolist()], [0.0] * 64)
    assert (metrics["eval/checks/ppo_objective_gain_ci_low"], metrics["eval/checks/ppo_objective_gain_ci_high"]) == (
        pytest.approx((expected["ci_low"], expected["ci_high"]))
    )
    # the same scores bought with a large KL: the objective fell, though the score rose
    rows, metrics = learning_checks({}, [], {}, {}, ppo, sft, kl={"ppo": [2.0] * 64}, kl_coef=0.2)
    assert {r["check"]: r["met"] for r in rows}[objective] is False
    assert metrics["eval/checks/ppo_objective_gain"] == pytest.approx(-0.1)
    # a reward model at chance: its interval includes 0.5
    rows, _ = learning_checks({}, [], rm_metrics | {"eval/accuracy_ci_low": 0.46}, {}, ppo, sft)
    assert [r["met"] for r in rows if r["check"] == OOD_CHECK] == [False]
    # repetition loops: PPO's share must not exceed SFT's on the same prompts
    loop = "I am not sure if I should eat it. I am not sure if I should eat it."
    texts = {"ppo": [loop, loop, "fine summary here", "ok"], "sft": [loop, "a b c", "d e f", "g"]}
    rows, metrics = learning_checks({}, [], {}, {}, ppo, sft, texts=texts)
    [row] = [r for r in rows if r["check"] == "greedy summaries caught in a repetition loop"]
    assert row["met"] is False and row["result"] == "50.0% (SFT 25.0%)" and row["n"] == 4
    assert row["target"] == "≤ SFT's + 5% points"
    assert (metrics["eval/checks/ppo_repetition_rate"], metrics["eval/checks/sft_repetition_rate"]) == (0.5, 0.25)
    rows, _ = learning_checks({}, [], {}, {}, ppo, sft, texts={"ppo": texts["sft"], "sft": texts["ppo"]})
    assert [r["met"] for r in rows if r["check"] == "greedy summaries caught in a repetition loop"] == [True]
    # the tolerance: 5 points more than SFT's passes, more than that fails (20 prompts: 1 is 5 points)
    sft_texts = [loop] * 2 + [f"summary {i}" for i in range(18)]
    for extra, met in ((1, True), (2, False)):
        own = [loop] * (2 + extra) + [f"summary {i}" for i in range(18 - extra)]
        rows, _ = learning_checks({}, [], {}, {}, ppo, sft, texts={"ppo": own, "sft": sft_texts})
        assert [r["met"] for r in rows if r["check"] == "greedy summaries caught in a repetition loop"] == [met]


OOD_CHECK = "accuracy, TL;DR validation comparisons, out of distribution (other policies, Detail 6)"
IN_DIST_CHECK = "accuracy, TL;DR comparisons held out of train, in distribution"


def test_the_reward_models_learning_check_is_its_in_distribution_accuracy_beside_the_out_of_distribution_one():
    ppo = sft = ResponseScores(raw_scores=torch.zeros(0), scores=torch.zeros(0), has_eos=torch.zeros(0, dtype=bool))
    rm_metrics = {
        "eval/accuracy": 0.58,
        "eval/count": 200.0,
        "eval/accuracy_ci_low": 0.511,
        "eval/accuracy_ci_high": 0.646,
        "eval/validation_in_dist/accuracy": 0.69,
        "eval/validation_in_dist/count": 200.0,
        "eval/validation_in_dist/accuracy_ci_low": 0.623,
        "eval/validation_in_dist/accuracy_ci_high": 0.750,
    }
    rows, _ = learning_checks({}, [], rm_metrics, {}, ppo, sft)
    assert [(r["check"], r["target"], r["met"]) for r in rows] == [
        (IN_DIST_CHECK, "interval above 50%", True),
        (OOD_CHECK, "reported", None),  # kept beside it, named, with its interval
    ]
    assert [(r["result"], r["95% interval"], r["n"]) for r in rows] == [
        ("69.0%", "[62.3%, 75.0%]", 200),
        ("58.0%", "[51.1%, 64.6%]", 200),
    ]
    # in distribution at chance: the check fails, whatever the out-of-distribution accuracy
    chance = rm_metrics | {"eval/validation_in_dist/accuracy": 0.52, "eval/validation_in_dist/accuracy_ci_low": 0.45}
    rows, _ = learning_checks({}, [], chance, {}, ppo, sft)
    assert [r["met"] for r in rows] == [False, None]


def test_the_reward_models_check_must_beat_its_best_baseline_on_the_same_pairs():
    """Issue: a reward model at the "longer wins" or "preferred policy wins" accuracy learned a
    style or an author, not a preference: its interval must lie above the best baseline."""
    ppo = sft = ResponseScores(raw_scores=torch.zeros(0), scores=torch.zeros(0), has_eos=torch.zeros(0, dtype=bool))
    held = "eval/validation_in_dist"
    rm = {f"{held}/accuracy": 0.69, f"{held}/count": 200.0}
    rm |= {f"{held}/accuracy_ci_low": 0.623, f"{held}/accuracy_ci_high": 0.750}
    rm |= {f"{held}/baseline/longer_wins/accuracy": 0.66, f"{held}/baseline/policy_prior/accuracy": 0.72}
    [row], _ = learning_checks({}, [], rm, {}, ppo, sft)
    assert row["target"] == "interval above 50% and 'the preferred policy wins' (72.0%)" and row["met"] is False
    assert row["result"] == (
        "69.0% (longer wins: 66.0%, the preferred policy wins: 72.0%); no better than 'the preferred policy wins' here"
    )
    weak = rm | {f"{held}/baseline/policy_prior/accuracy": 0.55, f"{held}/baseline/longer_wins/accuracy": 0.6}
    [row], _ = learning_checks({}, [], weak, {}, ppo, sft)
    assert row["target"] == "interval above 50% and 'longer wins' (60.0%)" and row["met"] is True
    # baselines below chance: 50% stays the bar
    below = rm | {f"{held}/baseline/policy_prior/accuracy": 0.3, f"{held}/baseline/longer_wins/accuracy": 0.45}
    [row], _ = learning_checks({}, [], below, {}, ppo, sft)
    assert row["target"] == "interval above 50%" and row["met"] is True
    # DPO's implicit reward model on the same pairs, against the same baselines
    rows, _ = learning_checks({}, [], weak, {}, ppo, sft, dpo_metrics=rm)
    dpo = [r for r in rows if r["stage"] == "DPO"]
    assert [(r["check"], r["met"]) for r in dpo] == [(f"implicit reward model {IN_DIST_CHECK}", False)]


def test_ppo_against_a_reward_model_that_failed_its_check_is_reported_not_gated():
    """A reward model no better than 'longer wins' (the CPU preset's, on every seed measured):
    PPO's objective gain against it is shown, not held to a target, and the report says why;
    a reward model that passes its check gates PPO again."""
    from rlhf_core.report.learning_checks import NOT_GATED
    from rlhf_core.report.run_report import gating_notes

    n = 16
    sft = ResponseScores(raw_scores=torch.zeros(n), scores=torch.zeros(n), has_eos=torch.ones(n, dtype=torch.bool))
    scores = torch.linspace(0.2, 0.6, n)
    ppo = ResponseScores(raw_scores=scores, scores=scores, has_eos=torch.ones(n, dtype=torch.bool))
    held = "eval/validation_in_dist"
    rm = {f"{held}/accuracy": 0.55, f"{held}/count": 64.0, f"{held}/accuracy_ci_low": 0.43}
    rm |= {f"{held}/accuracy_ci_high": 0.67, f"{held}/baseline/longer_wins/accuracy": 0.61}
    objective = "RLHF objective (RM score - 0.1 x KL from SFT) minus SFT's, same prompts"
    rows, metrics = learning_checks({}, [], rm, {}, ppo, sft, kl={"ppo": [1.0] * n}, kl_coef=0.1)
    by_check = {r["check"]: r for r in rows}
    assert (
        by_check[IN_DIST_CHECK]["met"] is False and "no better than 'longer wins'" in by_check[IN_DIST_CHECK]["result"]
    )
    assert (by_check[objective]["target"], by_check[objective]["met"]) == (NOT_GATED, None)
    assert metrics["eval/checks/ppo_objective_gain"] == pytest.approx(0.3)  # still measured and shown
    [note] = gating_notes(rows)
    assert note.startswith("PPO against this reward model is reported, not gated") and "'longer wins'" in note
    passing = rm | {f"{held}/accuracy_ci_low": 0.62, f"{held}/accuracy": 0.7}
    rows, _ = learning_checks({}, [], passing, {}, ppo, sft, kl={"ppo": [1.0] * n}, kl_coef=0.1)
    row = {r["check"]: r for r in rows}[objective]
    assert (row["target"], row["met"]) == ("interval above 0", True) and gating_notes(rows) == []


def test_dpo_is_checked_as_ppo_is_against_sft_with_its_objective_reported():
    n = 20
    sft = ResponseScores(raw_scores=torch.zeros(n), scores=torch.zeros(n), has_eos=torch.ones(n, dtype=torch.bool))
    dpo = ResponseScores(
        raw_scores=torch.full((n,), 0.4), scores=torch.linspace(0.3, 0.5, n), has_eos=torch.ones(n, dtype=torch.bool)
    )
    loop = "I am not sure if I should eat it. I am not sure if I should eat it."
    texts = {
        "ppo": ["a"] * n,
        "sft": [f"s {i}" for i in range(n)],
        "dpo": [loop] * 3 + [f"d {i}" for i in range(n - 3)],
    }
    rows, metrics = learning_checks(
        {}, [], {}, {}, sft, sft, texts=texts, dpo=dpo, kl={"ppo": [0.0] * n, "dpo": [1.0] * n}, kl_coef=0.2
    )
    dpo_rows = {r["check"]: r for r in rows if r["stage"] == "DPO"}
    objective = dpo_rows["RLHF objective (RM score - 0.2 x KL from SFT) minus SFT's, same prompts"]
    assert objective["met"] is None and objective["result"] == "+0.200 (KL 1.00 nats a summary)"  # reported
    assert metrics["eval/checks/dpo_objective_gain"] == pytest.approx(0.2)
    assert metrics["eval/checks/dpo_kl_vs_sft"] == 1.0
    assert dpo_rows["greedy summaries that end with EOS"]["met"] is True
    loops = dpo_rows["greedy summaries caught in a repetition loop"]
    assert loops["met"] is False and loops["result"] == "15.0% (SFT 0.0%)"
    assert metrics["eval/checks/dpo_repetition_rate"] == 0.15


def test_the_reward_model_table_names_each_split_in_or_out_of_distribution():
    rm = {"eval/accuracy": 0.535, "eval/count": 200.0, "eval/accuracy_ci_low": 0.466, "eval/accuracy_ci_high": 0.603}
    rm |= {f"eval/validation_in_dist/{k}": v for k, v in (("accuracy", 0.7), ("count", 200.0))}
    rm |= {"eval/validation_in_dist/accuracy_ci_low": 0.633, "eval/validation_in_dist/accuracy_ci_high": 0.759}
    longer = "eval/validation_in_dist/baseline/longer_wins/accuracy"
    rm |= {longer: 0.66, f"{longer}_ci_low": 0.6, f"{longer}_ci_high": 0.72, "eval/baseline/longer_wins/accuracy": 0.5}
    dpo = {"eval/validation_in_dist/accuracy": 0.655, "eval/validation_in_dist/count": 200.0}
    dpo |= {"eval/validation_in_dist/accuracy_ci_low": 0.587, "eval/validation_in_dist/accuracy_ci_high": 0.718}
    assert reward_model_rows(rm, dpo) == [
        {
            "split": "TL;DR comparisons held out of train",
            "pairs": "200",
            "RM": "70.0% [63.3%, 75.9%]",
            "DPO": "65.5% [58.7%, 71.8%]",
            "distribution": "in distribution",
            "longer wins": "66.0% [60.0%, 72.0%]",
            "the preferred policy wins": "-",
        },
        {
            "split": "TL;DR validation comparisons",
            "pairs": "200",
            "RM": "53.5% [46.6%, 60.3%]",
            "DPO": "-",
            "distribution": "out of distribution (other policies, Detail 6)",
            "longer wins": "50.0%",
            "the preferred policy wins": "-",
        },
    ]
    # TRL-format data: the data's own splits, with no TL;DR policies or task to speak of
    trl = reward_model_rows(rm, dpo, "trl")
    assert [(r["split"], r["distribution"]) for r in trl] == [
        ("comparisons held out of train", "in distribution"),
        ("the data's validation comparisons", "the validation split"),
    ]
    assert [r["RM"] for r in trl] == ["70.0% [63.3%, 75.9%]", "53.5% [46.6%, 60.3%]"]
    checks, _ = reward_model_checks(rm, "trl")
    assert [r["check"] for r in checks] == [
        "accuracy, comparisons held out of train, in distribution",
        "accuracy, the data's validation comparisons, the validation split",
    ]


def test_the_per_token_plots_of_the_stages_go_into_the_report_with_their_tables(tmp_path):
    """Details 13 and 22: the reward evaluation's per-token plot is copied beside the report and
    PPO's drawn there from its JSON, listed with their captions and a table of their figures under
    each."""
    rm_row = {
        "pair": 0,
        "response": "chosen",
        "token_ids": [5, 6, 2],
        "tokens": [" a", " $b", "<eos>"],
        "reward_logits": [-1.0, 0.5, 0.25],
        "eos_index": 2,
        "ends_with_eos": True,
        "score": 0.25,
    }
    ppo_row = {**rm_row, "row": 0, "values": [0.1, 0.2, 0.3], "value_at_eos": 0.3}
    del ppo_row["pair"], ppo_row["response"]
    reward_eval, ppo, out = tmp_path / "reward_eval", tmp_path / "ppo", tmp_path / "out"
    for d in (reward_eval, ppo, out):
        d.mkdir()
    (reward_eval / "reward_logits.json").write_text(json.dumps({"responses": [rm_row]}))
    plot_reward_logits([rm_row], reward_eval / "reward_logits.png", ["pair 0, chosen"])
    (ppo / "value_vs_reward.json").write_text(json.dumps({"responses": [ppo_row]}))
    plot_value_vs_reward([ppo_row], tmp_path / "expected.png", ["evaluation prompt 0"])
    assert per_token_sections(tmp_path / "nothing", tmp_path / "nothing", out) == ({}, {})

    plots, tables = per_token_sections(reward_eval, ppo, out)
    assert plots == {
        REWARD_LOGITS_HEADING: out / "reward_logits.png",
        VALUE_VS_REWARD_HEADING: out / "value_vs_reward.png",
    }
    assert (out / "value_vs_reward.png").read_bytes() == (tmp_path / "expected.png").read_bytes()
    assert not (ppo / "value_vs_reward.png").exists()
    assert {"reward_logits.png", "value_vs_reward.png"} <= set(REPORT_FILES)  # logged with the report
    write_report(out, title="run", headline=[{"policy": "PPO"}], plots=plots, figure_tables=tables)
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    assert f"![{REWARD_LOGITS_HEADING}](reward_logits.png)" in md and "](value_vs_reward.png)" in md
    # the score at the EOS, the mean of the other logits (-1, 0.5) and how many are negative
    rm_table = "| pair 0, chosen | 3 | yes | 0.250 | -0.250 | 1/2 |"
    value_table = "| 0 | 3 | yes | 0.250 | 0.300 | 0.150 | -0.250 |"
    assert md.index("](reward_logits.png)") < md.index(rm_table) < md.index("](value_vs_reward.png)")
    assert md.index("](value_vs_reward.png)") < md.index(value_table)
    assert "Detail 13, Figure 3" in html and "Detail 22" in html and html.count("<img") == 2


def _pairs(*counts: int) -> dict:
    pairs = [{"policies": f"p{i}, q{i}", "count": n} for i, n in enumerate(counts)]
    ordered = sorted(counts)
    return {
        "unique": len(counts),
        "comparisons": sum(counts),
        "without_policies": 0,
        "per_pair": {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]},
        "pairs": pairs,
    }


def test_the_report_shows_table_2_beside_the_papers_figures_for_the_splits_of_the_same_name():
    stats = {
        "source": "hub",
        "splits": {
            "sft/train": {"rows": 10},
            "preference/train": {"rows": 9, "policy_pairs": _pairs(6, 3)},
            "preference/validation_in_dist": {"rows": 21, "policy_pairs": _pairs(6, 5, 4, 3, 2, 1)},
            "preference/validation": {"rows": 7, "policy_pairs": _pairs(7)},
        },
    }
    table, top = policy_pair_rows(stats)
    assert table[0] == {
        "split": "train",
        "comparisons": 9,
        "unique policy pairs": 2,
        "comparisons per pair (min / median / max)": "3 / 6 / 6",
        "paper: comparisons": 92858,
        "paper: unique policy pairs": 47,
        "paper: comparisons per pair": "53 / 470 / 18065",
        "paper: most compared pair": "ref, sup2 (18065)",
    }
    assert [r["split"] for r in table] == ["train", "validation_in_dist", "validation"]
    assert table[1]["paper: unique policy pairs"] == "-"  # no split of that name in the paper
    assert table[2]["paper: unique policy pairs"] == 241
    assert [(r["split"], r["comparisons"]) for r in top if r["split"] == "validation_in_dist"] == [
        ("validation_in_dist", n) for n in (6, 5, 4, 3, 2)
    ]  # the TOP_PAIRS most compared
    assert TOP_PAIRS == 5 and top[0] == {
        "split": "train",
        "policy pair": "p0, q0",
        "comparisons": 6,
        "share of the split": "66.7%",
    }
    [note] = policy_pair_notes(stats)
    assert "Table 2 and Appendix L" in note and "local files" not in note
    assert "offline re-split" in policy_pair_notes(stats | {"source": "local"})[0]
    no_pairs = {"source": "local", "splits": {"preference/train": {"rows": 9}}}  # TRL-format rows
    assert policy_pair_rows(no_pairs) == ([], []) and policy_pair_notes(no_pairs) == []


REFERENCE = Path(__file__).resolve().parents[3].parent / "shared" / "reference"


def test_the_papers_policy_pair_figures_are_those_of_its_appendix_l():
    """PAPER_POLICY_PAIRS recomputed from the paper's Tables 21-27 (train: 21; validation: 22-26;
    validation_cnndm: 27), where the paper's text is beside the repository."""
    papers = sorted(REFERENCE.glob("huang2024_n_implementation_details*.txt"))
    if not papers:
        pytest.skip(f"the paper's text is not in {REFERENCE}")
    tables: dict[int, list[tuple[str, int]]] = {}
    rows: list[tuple[str, int]] | None = None
    for line in papers[0].read_text().splitlines():  # each table's rows come before its caption
        if line.strip() == "policies\tcount":
            rows = []
        elif (caption := re.match(r"Table (2[1-7]):", line)) and rows is not None:
            tables[int(caption.group(1))], rows = rows, None
        elif rows is not None and "\t" in line:
            pair, count = line.rsplit("\t", 1)
            rows.append((pair, int(count)))
    splits = {"train": [21], "validation": [22, 23, 24, 25, 26], "validation_cnndm": [27]}
    for split, numbers in splits.items():
        pairs = [row for n in numbers for row in tables[n]]
        counts = sorted(n for _, n in pairs)
        top = max(pairs, key=lambda row: row[1])
        expected = {
            "unique": len({p for p, _ in pairs}),
            "comparisons": sum(counts),
            "per_pair": (counts[0], counts[len(counts) // 2], counts[-1]),
            "top": top,
        }
        assert PAPER_POLICY_PAIRS[split] == expected, split
    assert [PAPER_POLICY_PAIRS[s]["unique"] for s in splits] == [47, 241, 7]  # Table 2


def test_the_value_table_adds_ppos_rewards_and_values_where_the_json_has_them(tmp_path):
    """Figure 11's figures under the value plot: the score PPO adds, the KL penalties' sum and
    PPO's value of the first token; the plot gains a second panel per summary, in the same row."""
    row = {
        "row": 0,
        "token_ids": [5, 6, 2],
        "tokens": [" a", " b", "<eos>"],
        "reward_logits": [-1.0, 0.5, 0.25],
        "values": [0.1, 0.2, 0.3],
        "value_at_eos": 0.3,
        "eos_index": 2,
        "ends_with_eos": True,
        "score": 0.25,
    }
    figure_11 = {
        "kl_penalty": [-0.01, 0.02, -0.005],
        "rewards": [-0.01, 0.02, 0.245],
        "ppo_values": [0.05, 0.1, 0.2],
        "score_index": 2,
        "ppo_score": 0.25,
    }
    [plain] = value_reward_rows({"responses": [row]})
    [full] = value_reward_rows({"responses": [row | figure_11]})
    assert full == plain | {
        "score PPO adds": 0.25,
        "KL penalties, sum": pytest.approx(0.005),
        "value of the first token": 0.05,
    }
    from PIL import Image

    one = Image.open(plot_value_vs_reward([row], tmp_path / "one.png", ["prompt 0"])).size
    two = Image.open(plot_value_vs_reward([row | figure_11], tmp_path / "two.png", ["prompt 0"])).size
    assert two[1] == one[1] and two[0] > 1.5 * one[0]  # the Figure 11 panel beside the first, same height


def test_the_report_names_ppos_advantage_estimator():
    gae = estimator_note(load_config("cpu-demo").ppo)
    assert gae.startswith("PPO's advantages: GAE (gamma 1.0, lambda 1.0) with a value model")
    assert "one sample of each of 16 prompts" in gae
    rloo = estimator_note(load_config("cpu-demo", ["ppo.advantage_estimator=rloo"]).ppo)
    assert "critic-free, no value model; 4 samples of each of 4 prompts" in rloo and "RLOO" in rloo
    grpo = estimator_note(load_config("cpu-demo", ["ppo.advantage_estimator=grpo"]).ppo)
    assert "GRPO" in grpo and "standard deviation of the prompt's scores" in grpo and "k3 term" in grpo
    assert "return" not in grpo  # the KL is in GRPO's loss, not its advantages
    dr_grpo = estimator_note(load_config("cpu-demo", ["ppo.advantage_estimator=grpo", "ppo.scale_rewards=none"]).ppo)
    assert "not divided (Dr. GRPO" in dr_grpo


def test_the_stage_measures_rm_judge_agreement_and_length_on_its_own_rows(stages, tmp_path, monkeypatch):
    """Detail 17 at the stage level: the reward model's agreement with the judge is measured on
    the very pairs the judge decided (each policy's summary against the reference), and each
    policy's mean length in tokens is its summaries' (Figures 7 and 8, left)."""
    _, root = stages
    cfg = load_config(
        "smoke",
        [
            "eval.max_samples=4",
            "eval.diversity_prompts=0",
            "eval.token_shift_samples=0",
            "eval.judge_human_comparisons=0",
        ],
    )
    monkeypatch.setenv("RLHF_JUDGE_CACHE", str(tmp_path / "cache.jsonl"))
    names = ("data", "base", "sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval")
    metrics = STAGES["evaluation"].run(cfg, [root / name for name in names], tmp_path / "out", NullTracker())
    rows = [json.loads(line) for line in (tmp_path / "out" / "summaries.jsonl").read_text().splitlines()]
    rm_prefers, wins = [], []
    for policy in ("base", "sft", "ppo", "dpo"):
        prefers = [r[f"{policy}_score"] > r["reference_score"] for r in rows]
        won = [r[f"{policy}_wins"] for r in rows]
        assert metrics[f"eval/{policy}/agreement"] == pytest.approx(agreement(prefers, won)["agreement"])
        assert metrics[f"eval/{policy}/response_tokens"] == pytest.approx(sum(r[f"{policy}_tokens"] for r in rows) / 4)
        rm_prefers += prefers
        wins += won
    expected = agreement(rm_prefers, wins)
    assert expected["n"] == 16 and expected["agreement"] != 0.5  # a reversed comparison would not pass unseen
    assert metrics["eval/agreement"] == pytest.approx(expected["agreement"]) and metrics["eval/agreement_n"] == 16
    assert metrics["eval/agreement_ci_low"] <= expected["agreement"] <= metrics["eval/agreement_ci_high"]
    assert "win_rate_by_length.png" in REPORT_FILES and (tmp_path / "out" / "win_rate_by_length.png").is_file()
    md = (tmp_path / "out" / "report.md").read_text()
    assert "### Win rate by mean summary length" in md and "| tokens |" in md
