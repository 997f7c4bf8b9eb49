import json
import math

import pytest
import torch

from rlhf_core.config.presets import load_config
from rlhf_core.data.prepared import load_data_tokenizer, load_prepared
from rlhf_core.evaluation.reward_eval import (
    accuracy_by_group,
    baseline_accuracies,
    calibration_table,
    evaluate_reward_model,
    longer_wins,
    non_eos_negative_share,
    policy_prior_wins,
    policy_win_rates,
)
from rlhf_core.train.reward import TOKEN_TABLE_RESPONSES, ScalarModel, get_reward, token_table


def test_longer_wins_counts_words_and_a_tie_as_a_coin():
    assert longer_wins(["a b c", "a", "a b"], ["a b", "a b c", "c d"]) == [1.0, 0.0, 0.5]


def test_the_policy_prior_is_learned_on_train_and_a_coin_where_unknown_or_equal():
    # ppo won 3 of its 4 comparisons, sup 1 of 4 (sup against sup says nothing), human none seen
    rates = policy_win_rates(["ppo", "ppo", "ppo", "sup", "sup"], ["sup", "sup", "sup", "ppo", "sup"])
    assert rates == {"ppo": 0.75, "sup": 0.25}
    prior = policy_prior_wins(rates, ["ppo", "sup", "ppo", "human", None], ["sup", "ppo", "ppo", "ppo", "sup"])
    assert prior == [1.0, 0.0, 0.5, 0.5, 0.5]
    assert policy_prior_wins(rates, ["human", None], ["ref", "ppo"]) is None  # no pair of two known policies


def test_baseline_accuracies_with_wilson_intervals_of_half_counted_ties():
    from rlhf_core.metrics.statistics import wilson_interval

    split = {
        "chosen": ["a b c", "a", "a b", "a b c d"],
        "rejected": ["a", "a b", "a c", "a"],  # longer wins: 1, 0, 0.5, 1
        "chosen_policy": ["ppo", "sup", "ppo", "sup"],
        "rejected_policy": ["sup", "ppo", "sup", "ppo"],  # prior (ppo better): 1, 0, 1, 0
    }
    train = {"chosen_policy": ["ppo", "ppo", "sup"], "rejected_policy": ["sup", "sup", "ppo"]}
    out = baseline_accuracies(split, train, "eval/x")
    assert out["eval/x/baseline/longer_wins/accuracy"] == pytest.approx(2.5 / 4)
    low, high = wilson_interval(2.5, 4)
    assert out["eval/x/baseline/longer_wins/accuracy_ci_low"] == pytest.approx(low)
    assert out["eval/x/baseline/longer_wins/accuracy_ci_high"] == pytest.approx(high)
    assert out["eval/x/baseline/policy_prior/accuracy"] == pytest.approx(0.5)
    assert "eval/x/baseline/policy_prior/accuracy" not in baseline_accuracies(split, None, "eval/x")


def test_accuracy_by_group():
    chosen = torch.tensor([1.0, 2.0, 0.0, 5.0, -1.0])
    rejected = torch.tensor([0.0, 3.0, 1.0, 4.0, -2.0])  # correct: T F F T T
    out = accuracy_by_group(
        chosen, rejected, {"batch": ["b1", "b1", "b2", "b2", "b2"], "confidence": [9, 9, 1, 1, 9]}, "eval"
    )
    assert out["eval/accuracy"] == pytest.approx(0.6)
    assert out["eval/accuracy/batch/b1"] == pytest.approx(0.5)
    assert out["eval/accuracy/batch/b2"] == pytest.approx(2 / 3)
    assert out["eval/accuracy/confidence/9"] == pytest.approx(2 / 3)
    assert out["eval/accuracy/confidence/1"] == pytest.approx(0.5)
    assert out["eval/count/batch/b2"] == 3
    # 3 of 5: the 95% Wilson interval
    assert (out["eval/accuracy_ci_low"], out["eval/accuracy_ci_high"]) == pytest.approx((0.2307, 0.8824), abs=1e-4)
    # rows without a label (TRL-format data without metadata) have no table for it
    unlabelled = accuracy_by_group(chosen, rejected, {"batch": [None] * 5, "split": ["v", None, "v", "v", "v"]}, "eval")
    assert not [key for key in unlabelled if "/batch/" in key]
    assert unlabelled["eval/count/split/None"] == 1 and unlabelled["eval/accuracy"] == out["eval/accuracy"]


def test_calibration_table():
    chosen = torch.tensor([0.1, 0.2, -0.1, 3.0, 2.9])
    rejected = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    rows = calibration_table(chosen, rejected, bins=3)
    assert [r["count"] for r in rows] == [3, 2]
    assert rows[0]["accuracy"] == pytest.approx(2 / 3) and rows[1]["accuracy"] == 1.0
    assert rows[1]["ideal"] == pytest.approx(1 / (1 + math.exp(-rows[1]["center"])))


def test_token_table_rows_end_at_the_score_index(llama_tokenizer):
    tok = llama_tokenizer
    pad, eos = tok.pad_token_id, tok.eos_token_id
    ids = tok(" a short summary", add_special_tokens=False)["input_ids"][:3]
    responses = torch.tensor([[*ids, eos, pad], [*ids, ids[0], ids[1]], [eos, pad, pad, pad, pad]])
    logits = torch.arange(15, dtype=torch.float32).view(3, 5) - 7.0
    values = -logits
    rows = token_table(
        tok,
        responses,
        torch.tensor([10.0, 11.0, 12.0]),
        torch.tensor([3, 4, 0]),
        eos,
        pad,
        {"reward_logits": logits, "values": values},
    )
    assert [r["eos_index"] for r in rows] == [3, 4, 0]
    assert [r["ends_with_eos"] for r in rows] == [True, False, True]
    assert rows[0]["token_ids"] == [*ids, eos] and rows[0]["tokens"][-1] == tok.decode([eos])
    assert "".join(rows[0]["tokens"][:3]) == " a short summary"
    assert rows[1]["reward_logits"] == [-2.0, -1.0, 0.0, 1.0, 2.0] and rows[1]["values"] == [2.0, 1.0, 0.0, -1.0, -2.0]
    assert rows[2]["reward_logits"] == [3.0] and [r["score"] for r in rows] == [10.0, 11.0, 12.0]
    # negative logits among those not at the score index: row 0 [-7, -6, -5], row 1 [-2, -1, 0, 1]
    assert non_eos_negative_share(rows) == pytest.approx(5 / 7)


def test_reward_logits_of_the_evaluation_are_the_models_outputs_at_each_token(smoke_stages, tmp_path):
    """Detail 13 (Figure 3): reward_logits.json holds the reward model's output at every token of
    the first validation pairs' responses, and the one at the EOS index is the pair's score."""
    cfg = load_config("smoke").reward.model_copy(update={"bf16": False})
    data = smoke_stages / "data"
    metrics = evaluate_reward_model(cfg, data, smoke_stages / "rm", tmp_path / "eval")
    out = json.loads((tmp_path / "eval" / "reward_logits.json").read_text())
    assert (tmp_path / "eval" / "reward_logits.png").read_bytes()[:4] == b"\x89PNG"
    assert "reward_logits" not in metrics  # a diagnostic file, not metrics
    rows = out["responses"]
    assert out["split"] == "validation" and len(rows) == TOKEN_TABLE_RESPONSES
    assert [(r["pair"], r["response"]) for r in rows] == [
        (0, "chosen"),
        (0, "rejected"),
        (1, "chosen"),
        (1, "rejected"),
    ]
    pairs = load_prepared(data)[1]["validation"].select(range(2))
    pad, eos = load_data_tokenizer(data).pad_token_id, load_data_tokenizer(data).eos_token_id
    model = ScalarModel.from_pretrained(smoke_stages / "rm").eval()
    for r in rows:
        pair = pairs[r["pair"]]
        query = [t for t in pair["query_token"] if t != pad]
        response = [t for t in pair[f"{r['response']}_token"] if t != pad]
        assert r["token_ids"] == response and r["tokens"] and r["ends_with_eos"]
        assert r["eos_index"] == len(response) - 1 and response[r["eos_index"]] == eos
        with torch.no_grad():  # the ScalarModel's head at every response token, the row alone
            alone = model(input_ids=torch.tensor([query + response]))[0, len(query) :]
        torch.testing.assert_close(torch.tensor(r["reward_logits"]), alone, rtol=1e-4, atol=1e-5)
        assert r["score"] == r["reward_logits"][r["eos_index"]]
        # the score the evaluation reads from the right-padded pair (Details 12, 14)
        with torch.no_grad():
            _, score, _ = get_reward(model, torch.tensor([pair[f"query_{r['response']}_token"]]), pad)
        assert r["score"] == pytest.approx(score.item(), abs=1e-5)
    negatives = [v < 0 for r in rows for t, v in enumerate(r["reward_logits"]) if t != r["eos_index"]]
    assert out["non_eos_negative_share"] == pytest.approx(sum(negatives) / len(negatives))


@pytest.fixture(scope="module")
def in_dist_data(smoke_stages, tmp_path_factory):
    """The smoke data with 6 of its 32 train comparisons held out as ``validation_in_dist``."""
    from rlhf_core.data.prepare import prepare_data

    held = "data.preference_splits.train.holdout={split: validation_in_dist, rows: 6, seed: 1}"
    cfg = load_config("smoke", [held, "reward.eval_splits=[validation, validation_in_dist, validation_cnndm]"])
    out = tmp_path_factory.mktemp("in-dist") / "data"
    prepare_data(cfg, out)
    return cfg, out


@pytest.mark.heavy
def test_the_reward_model_and_dpo_are_evaluated_in_and_out_of_distribution_with_intervals(
    in_dist_data, smoke_stages, tmp_path
):
    from rlhf_core.evaluation.dpo_eval import evaluate_dpo_reward
    from rlhf_core.evaluation.reward_eval import evaluate_pairs
    from rlhf_core.metrics.statistics import wilson_interval

    cfg, data = in_dist_data
    _, pref, _ = load_prepared(data)

    def by_length(rows):  # a reward that prefers the longer query+summary
        return (rows["query_chosen_token"] != 0).sum(1).float(), (rows["query_rejected_token"] != 0).sum(1).float()

    metrics = evaluate_pairs(by_length, cfg.reward, data, tmp_path / "pairs")
    held = pref["validation_in_dist"].with_format("torch", columns=["query_chosen_token", "query_rejected_token"])[:]
    chosen, rejected = by_length(held)
    correct = int((chosen > rejected).sum())
    assert metrics["eval/validation_in_dist/count"] == 6
    assert metrics["eval/validation_in_dist/accuracy"] == pytest.approx(correct / 6)
    assert (
        metrics["eval/validation_in_dist/accuracy_ci_low"],
        metrics["eval/validation_in_dist/accuracy_ci_high"],
    ) == pytest.approx(wilson_interval(correct, 6))
    assert metrics["eval/count"] == 8 and metrics["eval/validation_cnndm/count"] == 8  # out of distribution
    assert json.loads((tmp_path / "pairs" / "metrics.json").read_text()) == pytest.approx(metrics)
    # the baselines on the same pairs: longer wins (words), and the policy prior learned on train
    in_dist = pref["validation_in_dist"]
    longer = longer_wins(in_dist["chosen"], in_dist["rejected"])
    assert metrics["eval/validation_in_dist/baseline/longer_wins/accuracy"] == pytest.approx(sum(longer) / 6)
    rates = policy_win_rates(pref["train"]["chosen_policy"], pref["train"]["rejected_policy"])
    prior = policy_prior_wins(rates, in_dist["chosen_policy"], in_dist["rejected_policy"])
    assert prior is not None  # the held-out comparisons are of the training split's policies
    assert metrics["eval/validation_in_dist/baseline/policy_prior/accuracy"] == pytest.approx(sum(prior) / 6)
    # learned on train alone: with train's labels reversed, every policy's share is 1 - its share,
    # so the prior's accuracy on the same held-out pairs becomes 1 - its accuracy
    import shutil

    from datasets import DatasetDict

    reversed_data = tmp_path / "reversed"
    shutil.copytree(data, reversed_data)
    train = pref["train"].rename_column("chosen_policy", "was_chosen")
    train = train.rename_column("rejected_policy", "chosen_policy").rename_column("was_chosen", "rejected_policy")
    shutil.rmtree(reversed_data / "preference")
    DatasetDict({**pref, "train": train}).save_to_disk(str(reversed_data / "preference"))
    again = evaluate_pairs(by_length, cfg.reward, reversed_data, tmp_path / "reversed_pairs")
    key = "eval/validation_in_dist/baseline/policy_prior/accuracy"
    assert again[key] == pytest.approx(1 - metrics[key]) and metrics[key] != 0.5

    # the reward model's and DPO's implicit one's evaluation stages: the same keys, intervals included
    rm = evaluate_reward_model(cfg.reward, data, smoke_stages / "rm", tmp_path / "rm")
    dpo = evaluate_dpo_reward(cfg.dpo, cfg.reward, data, smoke_stages / "base", smoke_stages / "base", tmp_path / "dpo")
    for m in (rm, dpo):
        for prefix in ("eval/validation_in_dist", "eval", "eval/validation_cnndm"):
            low, acc, high = (m[f"{prefix}/{k}"] for k in ("accuracy_ci_low", "accuracy", "accuracy_ci_high"))
            assert 0 <= low <= acc <= high <= 1, (prefix, m)
        assert m["eval/validation_in_dist/count"] == 6
    assert dpo["eval/validation_in_dist/accuracy"] == 0.0  # the policy is its reference: every reward is 0
