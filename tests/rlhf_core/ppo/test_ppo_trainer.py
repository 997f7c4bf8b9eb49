"""The PPO stage on the smoke preset: four models, rollouts, updates, faults and resume."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.common.tracking import JsonlTracker, read_metrics
from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import PPOConfig
from rlhf_core.data.prepared import load_data_tokenizer, load_prepared
from rlhf_core.metrics.statistics import wilson_interval
from rlhf_core.metrics.text import repetition_loop
from rlhf_core.ppo.algorithm import (
    INVALID_LOGPROB,
    estimate_advantages,
    kl_penalised_rewards,
    logprobs_from_logits,
    make_trajectory,
    masked_mean_var,
    whiten,
)
from rlhf_core.ppo.eval import ppo_rewards_and_values
from rlhf_core.ppo.rollout import summary_logprobs
from rlhf_core.ppo.trainer import PPOTrainer, run_ppo
from rlhf_core.train.forward import response_logits, response_values
from rlhf_core.train.generation import trim_left_padding, truncate_after_eos
from rlhf_core.train.reward import TOKEN_TABLE_RESPONSES, ScalarModel, response_scores, score_responses
from rlhf_core.train.training import TrainingError
from tests.stages import finished_run, kill_then_resume, link_stages

REPORTED = [
    "objective/scores",
    "objective/rlhf_reward",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "policy/approxkl",
    "policy/clipfrac",
    "policy/entropy",
    "loss/policy",
    "loss/value",
    "val/clipfrac",
    "val/ratio",
    "val/ratio_var",
    "returns/mean",
    "rewards/mean",
    "rewards/std",
    "advantages/max",
    "response/length_mean",
    "response/no_eos_fraction",
    "response/length_score_corr",
    "lr",
    "episodes",
    "time/generate",
    "time/score",
    "time/train",
    "time/generate_tokens_per_s",
    "memory/peak_mb",
]


@pytest.fixture(scope="module")
def smoke(smoke_stages, tmp_path_factory):
    """Data, a base model standing in for SFT, and a reward model made from it."""
    return load_config("smoke"), link_stages(
        smoke_stages, tmp_path_factory.mktemp("ppo"), data="data", sft="base", rm="rm"
    )


def test_value_model_starts_as_the_reward_model(smoke):
    cfg, root = smoke
    trainer = PPOTrainer(cfg.ppo, root / "data", root / "sft", root / "rm")
    rm = trainer.reward_model.state_dict()
    value = trainer.value_model.state_dict()
    assert rm.keys() == value.keys()
    for k in rm:
        assert torch.equal(rm[k], value[k]), k
    assert all(p.requires_grad for p in trainer.value_model.parameters())
    assert not any(p.requires_grad for p in trainer.reward_model.parameters())
    assert not any(p.requires_grad for p in trainer.ref_policy.parameters())


def test_zero_head_value_model_is_the_reward_models_backbone_with_values_0(smoke, tmp_path):
    """``ppo.value_init: zero_head``: the reward model's backbone, its head's weight and bias
    zeroed, so the first advantages are the whitened returns; the reward model keeps its head."""
    cfg, root = smoke
    reward_model = ScalarModel.from_pretrained(str(root / "rm"))
    with torch.no_grad():
        reward_model.head.bias.fill_(0.5)  # as after normalisation (Detail 15): a bias to zero too
    reward_model.save_pretrained(tmp_path / "rm")
    ppo_cfg = cfg.ppo.model_copy(update={"value_init": "zero_head", "bf16": False})
    trainer = PPOTrainer(ppo_cfg, root / "data", root / "sft", tmp_path / "rm")
    assert trainer.reward_model.head.bias.item() == 0.5
    rm = trainer.reward_model.state_dict()
    value = trainer.value_model.state_dict()
    assert rm.keys() == value.keys()
    for k in rm:
        if not k.startswith("head."):
            assert torch.equal(rm[k], value[k]), k
    head = trainer.value_model.head
    assert not head.weight.any() and not head.bias.any()
    assert trainer.reward_model.head.weight.any()
    assert all(p.requires_grad for p in trainer.value_model.parameters())
    traj = trainer.generate_trajectory(trainer.queries[:4])
    assert not traj.values.any()
    traj = estimate_advantages(kl_penalised_rewards(traj, ppo_cfg), ppo_cfg)
    advantages, returns = traj.advantages, traj.returns
    mask = traj.token_mask
    torch.testing.assert_close(advantages, whiten(returns, *masked_mean_var(returns, mask)) * mask)


def test_rollout_is_consistent(smoke):
    cfg, root = smoke
    # float32: the fresh forward pass below runs without autocast
    trainer = PPOTrainer(cfg.ppo.model_copy(update={"bf16": False}), root / "data", root / "sft", root / "rm")
    traj = trainer.generate_trajectory(trainer.queries[:6])
    R = trainer.response_length
    assert traj.responses.shape == (6, R)  # exactly response_length sampled tokens
    mask = traj.token_mask
    # rollout log-probabilities equal a fresh forward pass of the same policy (dropout off, Detail 7)
    with torch.no_grad():
        logits = response_logits(trainer.policy, traj.query_responses, trainer.pad_id, traj.context_length)
    fresh = logprobs_from_logits(logits, traj.responses, cfg.ppo.temperature, trainer.pad_id)
    torch.testing.assert_close(traj.logprobs[mask], fresh[mask], rtol=1e-4, atol=1e-4)
    # the reference is the same network at the start: KL is zero
    torch.testing.assert_close(traj.logprobs[mask], traj.ref_logprobs[mask], rtol=1e-4, atol=1e-4)
    assert (traj.logprobs[~mask] == INVALID_LOGPROB).all()
    assert (traj.responses != trainer.pad_id).all()  # PAD is never sampled
    # no EOS in a random model's samples: the EOS trick gives every response the penalty
    no_eos = ~traj.has_eos
    assert no_eos.any()
    assert (traj.scores[no_eos] == cfg.ppo.non_eos_penalty).all()
    assert (traj.raw_scores != cfg.ppo.non_eos_penalty).all()
    # whitened advantages over valid tokens
    advantages = estimate_advantages(kl_penalised_rewards(traj, trainer.cfg), trainer.cfg).advantages
    adv = advantages[mask]
    assert abs(adv.mean().item()) < 1e-4 and abs(adv.std().item() - 1) < 1e-2
    assert (advantages[~mask] == 0).all()


def test_first_minibatch_trains_the_policy_that_sampled(smoke):
    """Before the first optimiser step the training pass recomputes the rollout's
    log-probabilities: the same network at the same temperature with PAD excluded in both
    (Detail 23), so every probability ratio is 1 and the approximate KL 0."""
    cfg, root = smoke
    # one epoch of one minibatch: every micro-batch's log-probabilities come before the only step
    ppo_cfg = cfg.ppo.model_copy(update={"ppo_epochs": 1, "num_minibatches": 1, "bf16": False})
    assert ppo_cfg.temperature != 1.0  # a pass that forgot the temperature would give other log-probabilities
    trainer = PPOTrainer(ppo_cfg, root / "data", root / "sft", root / "rm")
    traj = trainer.generate_trajectory(trainer.queries[: ppo_cfg.batch_size])
    stats = trainer.optimise(estimate_advantages(kl_penalised_rewards(traj, ppo_cfg), ppo_cfg), update=0)
    # The rollout's log-probabilities come from generation (one position at a time against the
    # KV cache), the training pass's from one forward pass over the whole sequence: float32
    # kernels that round differently, by up to ~2e-6 in a log-probability on the smoke model
    # (mean ratio 1 - 2e-8, variance 1e-13), hence the bounds below with room to spare. A
    # training pass at temperature 1 instead of 0.7 gives a mean ratio of 1.0045 even on this
    # random model, whose logits are nearly flat.
    assert abs(stats.ratio_mean - 1.0) < 1e-5
    assert stats.ratio_var < 1e-9
    assert stats.approxkl < 1e-10
    assert stats.clipfrac == 0.0


def test_responses_are_scored_at_their_last_real_token(smoke):
    """Detail 12: the reward model's output at the token before the first PAD; Detail 23:
    responses that are not scored at an EOS get the penalty."""
    cfg, root = smoke
    tok = load_data_tokenizer(root / "data")
    pad, eos = tok.pad_token_id, tok.eos_token_id
    rm = ScalarModel.from_pretrained(root / "rm").eval()
    queries = torch.tensor(load_prepared(root / "data")[0]["validation"]["query_token"][:4])
    a, b, c, d, e, f = tok(" a short summary of the post here", add_special_tokens=False)["input_ids"][:6]
    responses = torch.tensor(
        [
            [a, b, eos, pad, pad, pad],  # EOS at 2
            [a, b, c, d, e, f],  # no EOS: read at 5
            [eos, pad, pad, pad, pad, pad],  # EOS at 0
            [a, pad, eos, pad, pad, pad],  # PAD before the EOS: read at 0, not an EOS
        ]
    )
    last = [2, 5, 0, 0]
    scored = score_responses(rm, queries, responses, pad, eos, -3.0, batch_size=3)
    with torch.no_grad():
        expected = torch.stack(
            [
                rm(
                    input_ids=torch.cat(
                        [trim_left_padding(queries[i : i + 1], pad), responses[i : i + 1, : last[i] + 1]], 1
                    )
                )[0, -1]
                for i in range(4)
            ]
        )
    torch.testing.assert_close(scored.raw_scores, expected, rtol=1e-5, atol=1e-5)
    assert scored.has_eos.tolist() == [True, False, True, False]
    assert scored.scores[[0, 2]].equal(scored.raw_scores[[0, 2]])
    assert scored.scores[[1, 3]].tolist() == [-3.0, -3.0]


def test_trajectory_rewards_and_advantages_end_each_response_at_its_eos():
    """Responses with an EOS part way (Details 23-25): the mask, the KL penalty and the score
    stop at the EOS, and a response without EOS scores the penalty at its last token."""
    pad, eos, penalty, kl_coef = 0, 9, -4.0, 0.1
    responses = torch.tensor(
        [
            [5, 6, eos, 7, 8, eos],  # EOS at 2, then more sampled tokens
            [5, 6, 7, 8, 4, 3],  # no EOS
            [eos, 5, 6, 7, 8, 4],  # EOS at 0
            [5, 6, 7, 8, 4, eos],  # EOS at the last position
        ]
    )
    eos_at = [2, 5, 0, 5]  # the last real token of each
    raw_scores = torch.tensor([1.5, 2.5, -0.5, 3.0])
    torch.manual_seed(0)
    logprobs, ref_logprobs = -torch.rand(4, 6), -torch.rand(4, 6)
    values = torch.randn(4, 6)
    post = truncate_after_eos(responses, eos, pad)
    assert post[0].tolist() == [5, 6, eos, pad, pad, pad]  # what the reward model reads: PAD after the EOS
    scored = response_scores(raw_scores, post, eos, pad, penalty)
    assert scored.scores.tolist() == [1.5, penalty, -0.5, 3.0]
    cfg = PPOConfig(kl_coef=kl_coef, score_position="eos", whiten_rewards=False, non_eos_penalty=penalty)
    query_responses = torch.cat([torch.full((4, 3), 5), responses], 1)
    traj = make_trajectory(query_responses, responses, logprobs, ref_logprobs, values, scored, 3, eos, pad)
    rewards = kl_penalised_rewards(traj, cfg)
    steps = estimate_advantages(rewards, cfg)
    advantages, returns = steps.advantages, steps.returns
    assert traj.last_token_indices.tolist() == eos_at
    positions = torch.arange(6)
    mask = torch.stack([positions <= i for i in eos_at])
    assert traj.token_mask.equal(mask) and rewards.value_mask.equal(mask)
    kl_penalty = torch.where(mask, -kl_coef * (logprobs - ref_logprobs), 0.0)
    torch.testing.assert_close(rewards.non_score_reward, kl_penalty)
    assert traj.logprobs.equal(torch.where(mask, logprobs, INVALID_LOGPROB))
    assert traj.ref_logprobs.equal(torch.where(mask, ref_logprobs, INVALID_LOGPROB))
    score_at = torch.zeros(4, 6)
    score_at[torch.arange(4), torch.tensor(eos_at)] = scored.scores
    torch.testing.assert_close(rewards.rewards, kl_penalty + score_at)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()
    # the values after the last token take no part: GAE's returns equal those of masked values
    masked = make_trajectory(
        query_responses, responses, logprobs, ref_logprobs, torch.where(mask, values, 0.0), scored, 3, eos, pad
    )
    masked = kl_penalised_rewards(masked, cfg)
    assert estimate_advantages(masked, cfg).returns.equal(returns)

    # score_position after_eos: one position later (the last one when there is no room)
    cfg = cfg.model_copy(update={"score_position": "after_eos"})
    rewards = kl_penalised_rewards(traj, cfg)
    value_mask = torch.stack([positions <= i + 1 for i in eos_at])
    assert rewards.value_mask.equal(value_mask)
    torch.testing.assert_close(rewards.non_score_reward, kl_penalty)
    score_at = torch.zeros(4, 6)
    score_at[torch.arange(4), torch.tensor([3, 5, 1, 5])] = scored.scores
    torch.testing.assert_close(rewards.rewards, kl_penalty + score_at)


def test_value_vs_reward_reads_both_models_at_every_token_of_the_evaluation(smoke):
    """Detail 22: the value model's and the reward model's own outputs at the same tokens of the
    last evaluation's summaries, equal while the value model is still the reward model; the
    reward logit at the EOS index is the evaluation's score, and the value there is what PPO
    reads as the value of the next token's state."""
    cfg, root = smoke
    ppo_cfg = cfg.ppo.model_copy(update={"bf16": False, "eval_max_samples": 6})
    trainer = PPOTrainer(ppo_cfg, root / "data", root / "sft", root / "rm")
    pad = trainer.pad_id
    assert trainer.value_vs_reward() is None  # nothing evaluated yet
    _, samples = trainer.evaluate()
    rows = trainer.value_vs_reward()
    assert len(rows) == TOKEN_TABLE_RESPONSES == 4
    assert all(r["values"] == r["reward_logits"] for r in rows)  # the value model starts as the reward model
    for r, sample in zip(rows, samples):  # the evaluation's scores
        assert r["score"] == pytest.approx(sample["raw_score_policy"], abs=1e-5)
    with torch.no_grad():  # a value model that has moved away from the reward model, a policy from SFT
        g = torch.Generator().manual_seed(0)
        for p in [*trainer.value_model.parameters(), *trainer.policy.parameters()]:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    # summaries that end at an EOS at 2, 6 and 1, and one without EOS (the random policy writes none)
    queries, responses = (t[:4].clone() for t in trainer.eval_responses)
    R, temp = responses.size(1), ppo_cfg.temperature
    for i, end in enumerate([3, 7, 2]):
        responses[i, end - 1], responses[i, end:] = trainer.eos_id, pad
    trainer.eval_responses = (queries, responses)
    rows = trainer.value_vs_reward()
    assert [r["eos_index"] for r in rows] == [2, 6, 1, R - 1]
    assert [r["ends_with_eos"] for r in rows] == [True, True, True, False]
    scored = trainer.score(queries, responses)  # the path rollouts and evaluations score through
    q = trim_left_padding(queries, pad)
    with torch.no_grad():
        ppo_values = response_values(trainer.value_model, torch.cat([q, responses], 1), pad, q.size(1))
    for i, r in enumerate(rows):
        end = r["eos_index"] + 1
        assert r["row"] == i and r["token_ids"] == responses[i, :end].tolist()
        query = queries[i][queries[i] != pad]
        sequence = torch.cat([query, responses[i, :end]]).unsqueeze(0)
        with torch.no_grad():  # each ScalarModel's own outputs at the response tokens, the row alone
            value_alone = trainer.value_model(input_ids=sequence)[0, len(query) :]
            reward_alone = trainer.reward_model(input_ids=sequence)[0, len(query) :]
        torch.testing.assert_close(torch.tensor(r["values"]), value_alone, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["reward_logits"]), reward_alone, rtol=1e-4, atol=1e-5)
        assert r["values"] != r["reward_logits"]
        assert r["score"] == r["reward_logits"][r["eos_index"]] and r["value_at_eos"] == r["values"][r["eos_index"]]
        assert r["score"] == pytest.approx(scored.raw_scores[i].item(), abs=1e-5)
        # PPO's value of response token t is the value read at token t - 1
        torch.testing.assert_close(ppo_values[i, 1:end], torch.tensor(r["values"][:-1]), rtol=1e-4, atol=1e-5)
        # Figure 11: the rewards PPO's step 2 gives these tokens, and its values, the row alone
        with torch.no_grad():
            lp = [
                logprobs_from_logits(
                    m(input_ids=sequence).logits[:, len(query) - 1 : -1], responses[i : i + 1, :end], temp, pad
                )[0]
                for m in (trainer.policy, trainer.ref_policy)
            ]
        kl_penalty = -ppo_cfg.kl_coef * (lp[0] - lp[1])
        assert kl_penalty.abs().min() > 0  # the policy has moved: a penalty on every token
        torch.testing.assert_close(torch.tensor(r["kl_penalty"]), kl_penalty, rtol=1e-3, atol=1e-6)
        assert r["score_index"] == r["eos_index"] and r["ppo_score"] == pytest.approx(scored.scores[i].item(), abs=1e-5)
        score_at = torch.zeros(end).index_fill(0, torch.tensor([end - 1]), r["ppo_score"])
        torch.testing.assert_close(torch.tensor(r["rewards"]), torch.tensor(r["kl_penalty"]) + score_at)
        torch.testing.assert_close(torch.tensor(r["ppo_values"]), ppo_values[i, :end], rtol=1e-4, atol=1e-5)
    assert rows[3]["ppo_score"] == ppo_cfg.non_eos_penalty != rows[3]["score"]  # no EOS: the EOS trick


@pytest.mark.parametrize("position", ["eos", "after_eos"])
def test_figure_11_rows_put_the_score_where_the_rollouts_put_it(position):
    """The rewards of the value plot's second panel: ``per_token_rewards`` as in the rollouts, the
    score (with the EOS trick) at the EOS or one after it (at the last position when there is no
    room), over the positions that carry rewards and values."""
    pad, eos = 0, 2
    summaries = torch.tensor([[5, eos, pad, pad], [5, 6, 7, 8]])  # an EOS at 1; none
    cfg = PPOConfig(kl_coef=0.1, non_eos_penalty=-1.0, score_position=position)
    values = torch.arange(8.0).reshape(2, 4)
    rows = ppo_rewards_and_values(
        cfg, summaries, torch.full((2, 4), -1.0), torch.full((2, 4), -1.5), torch.tensor([2.0, -1.0]), values, pad
    )
    k = -0.05  # -kl_coef * (log pi - log pi_ref) on every token
    expected = {  # the EOS at 1: the score there, or one after it
        "eos": ([k, k], [k, k + 2.0], [0.0, 1.0], 1),
        "after_eos": ([k, k, 0.0], [k, k, 2.0], [0.0, 1.0, 2.0], 2),
    }[position]
    for key, value in zip(("kl_penalty", "rewards", "ppo_values", "score_index"), expected):
        assert rows[0][key] == pytest.approx(value), key
    assert rows[0]["ppo_score"] == 2.0
    assert rows[1]["rewards"] == pytest.approx([k, k, k, k - 1.0])  # no EOS: the penalty, at the last token
    assert rows[1]["score_index"] == 3 and rows[1]["ppo_score"] == -1.0 and rows[1]["ppo_values"] == [4, 5, 6, 7]


@pytest.mark.heavy
def test_ppo_stage_reports_and_saves(smoke, tmp_path):
    cfg, root = smoke
    penalty = -2.5  # the EOS trick's score, far from any the reward model gives
    ppo_cfg = cfg.ppo.model_copy(
        update={"total_episodes": 16, "eval_every": 1, "eval_max_samples": 4, "non_eos_penalty": penalty}
    )
    metrics = run_ppo(
        ppo_cfg, root / "data", root / "sft", root / "rm", tmp_path / "ppo", tracker=JsonlTracker(tmp_path / "m.jsonl")
    )
    records = read_metrics(tmp_path / "m.jsonl")
    assert [s for s, _ in records] == [1, 2]
    for _, m in records:
        for key in REPORTED:
            assert key in m and math.isfinite(m[key]), key
        assert "eval/score_policy" in m and "eval/score_reference" in m
        assert math.isfinite(m["eval/raw_score_policy"]) and 0 <= m["eval/eos_rate_policy"] <= 1
    assert records[-1][1]["episodes"] == 16
    assert records[0][1]["lr"] == pytest.approx(ppo_cfg.learning_rate)
    assert records[1][1]["lr"] == pytest.approx(ppo_cfg.learning_rate / 2)  # linear decay to 0 over 2 updates
    assert metrics["ppo/updates"] == 2
    policy = load_file(str(tmp_path / "ppo" / "model" / "model.safetensors"))
    sft = load_file(str(root / "sft" / "model.safetensors"))
    assert any(not torch.equal(policy[k], sft[k]) for k in sft)
    assert ScalarModel.from_pretrained(tmp_path / "ppo" / "value_model").head.weight.shape[0] == 1
    samples = [json.loads(line) for line in (tmp_path / "ppo" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {"post", "reference", "policy", "score_policy", "raw_score_policy"} <= set(samples[0])
    assert metrics["eval/score_policy"] == pytest.approx(sum(s["score_policy"] for s in samples) / 4)
    # the EOS trick (Detail 23) through the stage: the random policy writes no EOS, so every
    # rollout's and every evaluation summary's score is the penalty, not the reward model's
    for _, m in records:
        assert m["response/no_eos_fraction"] == 1.0 and m["objective/scores"] == penalty
        assert m["eval/eos_rate_policy"] == 0.0 and m["eval/score_policy"] == penalty != m["eval/raw_score_policy"]
    assert all(s["score_policy"] == penalty != s["raw_score_policy"] for s in samples)
    # the learning check against SFT, measured by the stage on the last evaluation's prompts only
    assert "eval/score_gain_vs_sft" not in records[0][1] and "eval/score_gain_vs_sft" in records[1][1]
    diffs = [s["score_policy"] - s["score_sft"] for s in samples]
    assert metrics["eval/score_gain_vs_sft"] == pytest.approx(sum(diffs) / 4)
    assert metrics["eval/score_gain_vs_sft_ci_low"] <= metrics["eval/score_gain_vs_sft"]
    assert metrics["eval/score_gain_vs_sft_ci_high"] >= metrics["eval/score_gain_vs_sft"]
    assert metrics["eval/score_sft"] == pytest.approx(sum(s["score_sft"] for s in samples) / 4)
    assert metrics["eval/repetition_rate_sft"] == sum(repetition_loop(s["sft"]) is not None for s in samples) / 4
    assert metrics["eval/repetition_rate_policy"] == sum(repetition_loop(s["policy"]) is not None for s in samples) / 4
    low, high = metrics["eval/eos_rate_policy_ci_low"], metrics["eval/eos_rate_policy_ci_high"]
    assert (low, high) == pytest.approx(wilson_interval(round(metrics["eval/eos_rate_policy"] * 4), 4))
    # Detail 22: the trained value model beside the reward model on the last evaluation's summaries
    assert not (tmp_path / "ppo" / "value_vs_reward.png").exists()  # the report draws it
    table = json.loads((tmp_path / "ppo" / "value_vs_reward.json").read_text())["responses"]
    assert [r["row"] for r in table] == list(range(TOKEN_TABLE_RESPONSES))
    for r, sample in zip(table, samples):
        assert len(r["tokens"]) == len(r["values"]) == len(r["reward_logits"]) == r["eos_index"] + 1
        assert r["score"] == r["reward_logits"][r["eos_index"]]
        assert r["score"] == pytest.approx(sample["raw_score_policy"], abs=1e-4)
        # Figure 11: PPO's rewards and values of the same summary, the score where step 2 adds it
        assert len(r["rewards"]) == len(r["kl_penalty"]) == len(r["ppo_values"]) == r["eos_index"] + 1
        assert r["ppo_score"] == penalty == sample["score_policy"]  # with the EOS trick
        k = r["score_index"]
        assert k == r["eos_index"] and r["rewards"][k] == pytest.approx(r["kl_penalty"][k] + r["ppo_score"])
        assert r["rewards"][:k] == r["kl_penalty"][:k] and any(v != 0 for v in r["kl_penalty"])
        assert r["ppo_values"][1:] == pytest.approx(r["values"][:-1], abs=1e-4)  # the state before each token
    settings = json.loads((tmp_path / "ppo" / "value_vs_reward.json").read_text())["settings"]
    assert settings == {"kl_coef": 0.05, "score_position": "eos", "non_eos_penalty": penalty, "whiten_rewards": False}


@pytest.mark.heavy
def test_reward_whitening_reaches_the_stages_rewards_and_returns(smoke, tmp_path):
    """Detail 24 at the stage level: one update of the PPO stage without and with
    ``ppo.whiten_rewards`` samples the same rollout; with it, the per-token rewards the update
    uses have standard deviation 1 and the mean of those without (``shift_mean=False``), and
    the returns that the value loss regresses on change with them."""
    cfg, root = smoke
    first = {}
    for whitened in (False, True):
        ppo_cfg = cfg.ppo.model_copy(update={"total_episodes": 8, "eval_max_samples": 2, "whiten_rewards": whitened})
        log = tmp_path / f"whiten-{whitened}.jsonl"
        run_ppo(ppo_cfg, root / "data", root / "sft", root / "rm", tmp_path / f"ppo-{whitened}", JsonlTracker(log))
        [first[whitened]] = [m for step, m in read_metrics(log) if step == 1]
    off, on = first[False], first[True]
    for key in ("objective/scores", "objective/kl", "objective/rlhf_reward", "response/length_mean"):
        assert on[key] == off[key], key  # the same samples
    # without whitening the rewards are the KL penalties plus the scores: their mean per token is the
    # RLHF reward per response over the tokens per response (the score at the EOS, in value_mask)
    assert off["rewards/mean"] == pytest.approx(off["objective/rlhf_reward"] / off["response/length_mean"], rel=1e-5)
    assert abs(off["rewards/std"] - 1) > 0.1
    assert on["rewards/std"] == pytest.approx(1.0, abs=1e-4)
    assert on["rewards/mean"] == pytest.approx(off["rewards/mean"], rel=1e-5, abs=1e-7)
    assert on["returns/mean"] != pytest.approx(off["returns/mean"], rel=1e-2)  # step 3 reads the whitened rewards


def test_the_check_against_sft_summarises_with_the_sft_policy_on_the_same_prompts_and_seeds(smoke):
    """Before any update the policy is the SFT model: the two policies' summaries, scores and
    repetition rates are equal and the gain is exactly 0; the SFT summaries are those of the
    frozen reference model, sampled as the policy's are."""
    cfg, root = smoke
    ppo_cfg = cfg.ppo.model_copy(update={"eval_max_samples": 4, "bf16": False})
    trainer = PPOTrainer(ppo_cfg, root / "data", root / "sft", root / "rm")
    metrics, samples = trainer.evaluate(against_sft=True)
    assert [s["sft"] for s in samples] == [s["policy"] for s in samples]
    assert metrics["eval/score_gain_vs_sft"] == 0.0 and metrics["eval/score_sft"] == metrics["eval/score_policy"]
    assert metrics["eval/repetition_rate_sft"] == metrics["eval/repetition_rate_policy"]
    # the same model: every summary's KL from SFT is 0, and so is the objective's gain
    assert [s["kl_vs_sft"] for s in samples] == [0.0] * 4
    assert metrics["eval/kl_vs_sft"] == metrics["eval/objective_gain_vs_sft"] == 0.0
    with torch.no_grad():  # a different policy: the SFT side must not follow it
        for p in trainer.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved, moved_samples = trainer.evaluate(against_sft=True)
    assert [s["sft"] for s in moved_samples] == [s["sft"] for s in samples]
    assert [s["policy"] for s in moved_samples] != [s["policy"] for s in samples]
    assert moved["eval/score_sft"] == metrics["eval/score_sft"]
    assert moved["eval/score_gain_vs_sft"] == pytest.approx(moved["eval/score_policy"] - moved["eval/score_sft"])
    # the KL of each policy summary, log pi - log pi_sft at the training temperature, and the
    # RLHF objective's gain: score - kl_coef * KL, minus SFT's score
    queries = torch.tensor(trainer.sft["validation"]["query_token"][:4])
    responses = trainer.eval_responses[1]
    pad, temperature = trainer.pad_id, ppo_cfg.temperature
    kl = summary_logprobs(trainer.policy, queries, responses, pad, temperature)
    kl -= summary_logprobs(trainer.ref_policy, queries, responses, pad, temperature)
    assert [s["kl_vs_sft"] for s in moved_samples] == pytest.approx(kl.tolist(), abs=1e-4)
    assert kl.abs().min() > 0
    objective = [s["score_policy"] - ppo_cfg.kl_coef * s["kl_vs_sft"] - s["score_sft"] for s in moved_samples]
    assert moved["eval/objective_gain_vs_sft"] == pytest.approx(sum(objective) / 4)
    assert moved["eval/objective_gain_vs_sft"] != pytest.approx(moved["eval/score_gain_vs_sft"])
    plain, _ = trainer.evaluate()
    assert "eval/score_gain_vs_sft" not in plain


def test_non_finite_scores_stop_with_the_update_named(smoke, tmp_path):
    cfg, root = smoke
    broken = ScalarModel.from_pretrained(root / "rm")
    with torch.no_grad():
        broken.head.bias.fill_(float("nan"))
    broken.save_pretrained(tmp_path / "broken_rm")
    with pytest.raises(TrainingError, match="non-finite .* at update 1"):
        run_ppo(
            cfg.ppo.model_copy(update={"non_eos_penalty": float("nan")}),
            root / "data",
            root / "sft",
            tmp_path / "broken_rm",
            tmp_path / "ppo",
        )
    assert (tmp_path / "ppo" / "checkpoints" / "step-000000" / "state.pt").is_file()
    assert not (tmp_path / "ppo" / "model").exists()


@pytest.mark.heavy
def test_a_non_finite_loss_stops_before_the_minibatchs_step_with_the_update_named(smoke, tmp_path, monkeypatch):
    """The losses are checked once per minibatch, before its optimiser step: a value loss that
    turns NaN in the second micro-batch of update 2 stops the run naming it, and the state
    saved is the last good one (finite, one update trained), not one stepped with NaN."""
    from rlhf_core.ppo import algorithm

    cfg, root = smoke
    p = cfg.ppo.model_copy(update={"total_episodes": 3 * cfg.ppo.batch_size, "checkpoint_every": 100})
    per_update = p.ppo_epochs * p.num_minibatches * (p.batch_size // p.num_minibatches // p.micro_batch_size)
    calls, original = [], algorithm.value_loss

    def value_loss(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == per_update + 2:
            out = dict(out, loss=out["loss"] * float("nan"))
        return out

    monkeypatch.setattr(algorithm, "value_loss", value_loss)  # read by ppo_loss
    with pytest.raises(TrainingError, match=r"non-finite loss \(value\) at update 2"):
        run_ppo(p, root / "data", root / "sft", root / "rm", tmp_path / "ppo")
    assert len(calls) == per_update + 2  # the first minibatch's micro-batches of update 2, no more
    state = torch.load(tmp_path / "ppo" / "checkpoints" / "step-000001" / "state.pt", weights_only=False)
    assert state["step"] == 1
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    sft = load_file(str(root / "sft" / "model.safetensors"))
    policy = {k.removeprefix("policy."): v for k, v in state["model"].items() if k.startswith("policy.")}
    assert any(not torch.equal(policy[k], sft[k]) for k in sft if k in policy)  # update 1 was applied


@pytest.mark.heavy
def test_ppo_checkpoints_by_the_clock_and_keeps_the_newest_only(smoke, tmp_path, monkeypatch):
    """``ppo.checkpoint_every_minutes`` with the step count unset: a fake clock that moves 40 s
    at each reading makes half a minute pass every update, so 3 updates save after updates 1 and
    2 (never after the last), and only the newest checkpoint is left."""
    from rlhf_core.train import training

    now = [0.0]

    def reading() -> float:
        now[0] += 40
        return now[0]

    monkeypatch.setattr(training, "wall_clock", reading)
    cfg, root = smoke
    p = cfg.ppo.model_copy(
        update={
            "batch_size": 4,
            "total_episodes": 12,
            "checkpoint_every": None,
            "checkpoint_every_minutes": 0.5,
            "eval_every": 100,
            "eval_max_samples": 2,
        }
    )
    run_ppo(p, root / "data", root / "sft", root / "rm", tmp_path / "ppo")
    assert sorted(p.name for p in (tmp_path / "ppo" / "checkpoints").iterdir()) == ["step-000002"]
    state = torch.load(tmp_path / "ppo" / "checkpoints" / "step-000002" / "state.pt", weights_only=False)
    assert state["step"] == 2 and len(state["extra"]["rank_rng"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["full", "lora", "rloo", "pass"])
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, variant, shared_runs):
    """Kill `rlhf ppo` with SIGKILL after its first checkpoint, that of update 1 of 3 (of update 2
    with ``pass``); the resumed run's final policy is identical.
    With ``pass``, updates of 16 prompts over the smoke preset's 32: the checkpoint of update 2
    ends the first pass over the prompts, and the resumed update 3 starts the second, reshuffled
    (Detail 21), as the uninterrupted run's does.
    With low-rank adapters too: their checkpoint holds the adapters and the value head, not the
    frozen weights (test_lora.py), and the resumed run's adapters equal the other's bit for bit.
    With RLOO (2 samples of each of 2 prompts per update) there is no value model to save or
    restore. All runs start from copies of one run of the stages before PPO (shared by the variants)."""
    adapters, critic = variant == "lora", variant != "rloo"
    upstream = ["sft.max_steps=1", "sft.eval_max_samples=1", "reward.max_steps=1", "reward.eval_max_samples=2"]
    variant_overrides = {
        "full": [],
        "lora": ["ppo.lora.r=8", "ppo.learning_rate=1e-2"],
        "rloo": ["ppo.advantage_estimator=rloo", "ppo.samples_per_prompt=2"],
        "pass": ["ppo.total_episodes=48", "ppo.batch_size=16", "ppo.micro_batch_size=8", "ppo.checkpoint_every=2"],
    }
    overrides = [
        "ppo.total_episodes=12",
        "ppo.batch_size=4",
        "ppo.micro_batch_size=2",
        "ppo.checkpoint_every=1",
        "ppo.eval_every=100",
        "ppo.eval_max_samples=2",
        *upstream,
        *variant_overrides[variant],  # last: they win
    ]
    before = finished_run(shared_runs, "reward_eval", upstream)
    step = 2 if variant == "pass" else 1
    logs = kill_then_resume("ppo", "ppo", overrides, tmp_path, step=step, start_from=before)
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    for name in ("data", "base_model", "sft", "reward", "reward_norm", "reward_eval"):
        assert all(f"stage {name}: finished earlier" in log for log in logs.values()), name
    a = load_file(str(killed / "ppo" / "model" / "model.safetensors"))
    b = load_file(str(clean / "ppo" / "model" / "model.safetensors"))
    for k in b:
        assert torch.equal(a[k], b[k]), k
    assert (killed / "ppo" / "value_model").is_dir() == (clean / "ppo" / "value_model").is_dir() == critic
    if critic:
        va = load_file(str(killed / "ppo" / "value_model" / "model.safetensors"))
        vb = load_file(str(clean / "ppo" / "value_model" / "model.safetensors"))
        for k in vb:
            assert torch.equal(va[k], vb[k]), k
    if adapters:
        for name in ("adapter", "value_adapter"):
            a = load_file(str(killed / "ppo" / name / "adapter_model.safetensors"))
            b = load_file(str(clean / "ppo" / name / "adapter_model.safetensors"))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
