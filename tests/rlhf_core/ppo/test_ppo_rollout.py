from dataclasses import replace

import pytest
import torch

from rlhf_core.config.presets import load_config
from rlhf_core.ppo.algorithm import INVALID_LOGPROB, estimate_advantages, kl_penalised_rewards, make_trajectory
from rlhf_core.ppo.rollout import (
    prompt_indices,
    rollout_rows,
    rollout_statistics,
    summary_logprobs,
    throughput_statistics,
)
from rlhf_core.train.distributed import World, shard
from rlhf_core.train.reward import ResponseScores

PAD, EOS = 0, 2


def two_responses():
    """Four sampled tokens each: the first response ends at its EOS (index 1), the second has none;
    the policy's log-probability of every token is -1.0, the reference's -1.5."""
    responses = torch.tensor([[5, EOS, 7, 8], [5, 6, 7, 8]])
    scored = ResponseScores(
        raw_scores=torch.tensor([1.0, 3.0]), scores=torch.tensor([1.0, -1.0]), has_eos=torch.tensor([True, False])
    )
    return make_trajectory(
        query_responses=torch.cat([torch.full((2, 3), 9), responses], dim=1),
        responses=responses,
        logprobs=torch.full((2, 4), -1.0),
        ref_logprobs=torch.full((2, 4), -1.5),
        values=torch.zeros(2, 4),
        scored=scored,
        context_length=3,
        eos_token_id=EOS,
        pad_token_id=PAD,
        time_generate=2.0,
        time_score=0.5,
    )


def test_a_trajectory_ends_each_response_at_its_first_eos():
    traj = two_responses()
    assert traj.last_token_indices.tolist() == [1, 3]
    assert traj.token_mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert traj.logprobs[0, 2:].tolist() == [INVALID_LOGPROB, INVALID_LOGPROB]


def test_rollout_statistics_of_a_batch_worked_by_hand():
    traj = two_responses()
    mask = traj.token_mask
    non_score_reward = -0.1 * (traj.logprobs - traj.ref_logprobs) * mask  # -0.05 per response token
    score_at_eos = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0]])  # the scores at the last tokens
    advantages = torch.tensor([[1.0, -2.0, 9.0, 9.0], [0.0, 1.0, 3.0, -3.0]]) * mask
    returns = torch.tensor([[1.0, 3.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    traj = replace(
        traj,
        rewards=non_score_reward + score_at_eos,
        non_score_reward=non_score_reward,
        value_mask=mask,
        advantages=advantages,
        returns=returns,
    )
    stats = rollout_statistics(traj)
    expected = {
        "objective/scores": 0.0,  # with the EOS trick: 1 and -1
        "objective/kl": 1.5,  # nats per response: 2 x 0.5 and 4 x 0.5
        "objective/kl_per_token": 0.5,  # 3 nats over 6 tokens
        "objective/entropy": 3.0,  # -logprobs summed over each response's tokens: 2 and 4
        "objective/non_score_reward": -0.15,  # -0.05 x 2 tokens and -0.05 x 4
        "objective/rlhf_reward": -0.15,  # (1 - 0.1) and (-1 - 0.2)
        "rewards/mean": -0.05,  # -0.05, 0.95 and -0.05, -0.05, -0.05, -1.05
        "rewards/std": 0.4**0.5,  # unbiased: (1 + 1) / 5
        "returns/mean": 2.0,  # 1, 3, 2, 2, 2, 2
        "returns/var": 0.4,  # unbiased: 2 / 5
        "advantages/mean": 0.0,  # 1, -2, 0, 1, 3, -3: the 9s after the EOS left out
        "advantages/var": 4.8,  # unbiased: 24 / 5
        "advantages/min": -3.0,
        "advantages/max": 3.0,
        "response/length_mean": 3.0,  # 2 and 4 tokens
        "response/length_score_corr": -1.0,  # the longer response scored lower
        "response/no_eos_fraction": 0.5,
        "response/eos_rate": 0.5,
    }
    assert stats.keys() == expected.keys()
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, abs=1e-6), key


def test_throughput_counts_sampled_and_trained_tokens_per_second():
    traj = two_responses()
    stats = throughput_statistics(traj, t_train=3.0, ppo_epochs=2, device=torch.device("cpu"))
    assert stats["time/generate"] == 2.0 and stats["time/score"] == 0.5 and stats["time/train"] == 3.0
    assert stats["time/generate_tokens_per_s"] == pytest.approx(8 / 2.0)  # every sampled token
    assert stats["time/train_tokens_per_s"] == pytest.approx(2 * 6 / 3.0)  # response tokens, each epoch
    assert stats["memory/peak_mb"] > 0


def ppo_cfg(*overrides: str):
    return load_config("smoke", list(overrides)).ppo


def test_rollout_rows_sample_each_prompt_k_times_in_consecutive_rows_on_one_rank():
    """batch_size counts episodes: 12 = 3 prompts x 4 samples on one rank, 6 prompts x 2 over
    two ranks, each rank holding whole groups of its contiguous share of the prompts."""
    cfg = ppo_cfg("ppo.batch_size=12", "ppo.samples_per_prompt=4", "ppo.advantage_estimator=rloo")
    prompts = prompt_indices(50, 3, update=2, seed=cfg.seed)
    assert rollout_rows(50, cfg, 2) == [p for p in prompts for _ in range(4)]
    cfg = ppo_cfg("ppo.batch_size=12", "ppo.samples_per_prompt=2", "ppo.advantage_estimator=rloo")
    prompts = prompt_indices(50, 6, update=2, seed=cfg.seed)
    ranks = [rollout_rows(50, cfg, 2, World(rank, 2)) for rank in (0, 1)]
    assert ranks[0] == [p for p in prompts[:3] for _ in range(2)]
    assert ranks[1] == [p for p in prompts[3:] for _ in range(2)]
    with pytest.raises(ValueError, match="6 prompts per update do not split over 4 ranks"):
        rollout_rows(50, cfg, 2, World(0, 4))


def test_one_sample_per_prompt_draws_the_rows_it_drew_before_groups():
    cfg = ppo_cfg("ppo.batch_size=8")
    for update in range(3):
        for rank in (0, 1):
            w = World(rank, 2)
            assert rollout_rows(20, cfg, update, w) == shard(prompt_indices(20, 8, update, cfg.seed), w)


def grouped_trajectory(queries: list[int], scores: list[float], lengths: list[int]):
    """One response per row, of ``lengths[i]`` tokens (EOS last) out of 4, after a 2-token query
    ``[q, q]``; policy log-probability -1.0 per token, the reference's -1.5 (KL 0.5 per token)."""
    rows, R = len(queries), 4
    responses = torch.full((rows, R), 7)
    for i, n in enumerate(lengths):
        responses[i, n - 1] = EOS
    query = torch.tensor(queries).unsqueeze(1).repeat(1, 2)
    scores_t = torch.tensor(scores)
    return make_trajectory(
        query_responses=torch.cat([query, responses], dim=1),
        responses=responses,
        logprobs=torch.full((rows, R), -1.0),
        ref_logprobs=torch.full((rows, R), -1.5),
        values=None,
        scored=ResponseScores(raw_scores=scores_t, scores=scores_t, has_eos=torch.ones(rows, dtype=torch.bool)),
        context_length=2,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )


def test_rloo_gives_every_token_of_a_response_its_kl_penalised_return_minus_the_others_mean():
    cfg = ppo_cfg("ppo.batch_size=4", "ppo.samples_per_prompt=2", "ppo.advantage_estimator=rloo", "ppo.kl_coef=0.1")
    traj = grouped_trajectory([11, 11, 12, 12], scores=[1.0, 0.0, 0.5, 0.5], lengths=[1, 3, 2, 2])
    rewards = kl_penalised_rewards(traj, cfg)
    steps = estimate_advantages(rewards, cfg)
    advantages, returns = steps.advantages, steps.returns
    # returns: 1 - 0.05 x 1 token, 0 - 0.05 x 3, and 0.5 - 0.1 twice: 0.95, -0.15; 0.4, 0.4
    assert returns is None
    expected = torch.tensor([[1.1, 0.0, 0.0, 0.0], [-1.1, -1.1, -1.1, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected)


def test_grpo_compares_the_scores_alone_whatever_the_kls():
    """Four samples that the reward model scores equally, with KLs from the reference that
    differ: GRPO's advantages are 0 (the KL is a term of its loss, DeepSeekMath eq. 3), where a
    KL summed into the return and divided by the group's std gave [0, -1.09, +1.09, 0]; a group
    whose scores differ gets (r - mean) / (std + 1e-4) of the scores alone."""
    cfg = ppo_cfg("ppo.batch_size=8", "ppo.samples_per_prompt=4", "ppo.advantage_estimator=grpo", "ppo.kl_coef=0.05")
    traj = grouped_trajectory([11] * 4 + [12] * 4, scores=[0.5] * 4 + [1.0, 0.0, 0.0, 0.0], lengths=[2] * 8)
    kls = torch.tensor([2.00, 2.02, 1.98, 2.00, 0.0, 1.0, 2.0, 3.0])  # summed over each response's 2 tokens
    traj.ref_logprobs[:, :2] = traj.logprobs[:, :2] - kls[:, None] / 2
    rewards = kl_penalised_rewards(traj, cfg)
    assert rewards.non_score_reward.sum(1)[:4].tolist() == pytest.approx((-0.05 * kls[:4]).tolist())
    steps = estimate_advantages(rewards, cfg)
    advantages, returns = steps.advantages, steps.returns
    assert returns is None and advantages[:4].abs().sum() == 0
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std().item()
    expected = [(0.75 / (std + 1e-4))] + [(-0.25 / (std + 1e-4))] * 3
    torch.testing.assert_close(advantages[4:, 0], torch.tensor(expected))
    assert torch.equal(advantages[4:, 0], advantages[4:, 1])
    none = cfg.model_copy(update={"scale_rewards": "none"})
    torch.testing.assert_close(
        estimate_advantages(rewards, none).advantages[4:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25])
    )


def test_a_group_that_holds_two_prompts_is_refused():
    cfg = ppo_cfg("ppo.batch_size=4", "ppo.samples_per_prompt=2", "ppo.advantage_estimator=rloo")
    traj = grouped_trajectory([11, 12, 11, 12], scores=[1.0, 0.0, 0.5, 0.5], lengths=[1, 3, 2, 2])
    with pytest.raises(ValueError, match="must hold one prompt's samples"):
        estimate_advantages(kl_penalised_rewards(traj, cfg), cfg)


def test_gae_advantages_and_returns_by_hand():
    """``gae`` (the paper's estimator), worked by hand on two responses with values: the
    lambda-return recursion over each response's tokens, A_t = delta_t + gamma lam A_t+1 with
    delta_t = r_t + gamma V_t+1 - V_t (V after the response 0), returns A + V, then the
    advantages whitened over the batch's response tokens with the unbiased variance (Detail 25)."""
    cfg = ppo_cfg("ppo.gamma=0.9", "ppo.lam=0.8")
    base = two_responses()
    values = torch.tensor([[0.5, -0.25, 0.0, 0.0], [0.125, 0.375, -0.5, 0.25]])
    traj = make_trajectory(
        query_responses=base.query_responses,
        responses=base.responses,
        logprobs=base.logprobs,
        ref_logprobs=base.ref_logprobs,
        values=values,
        scored=ResponseScores(
            raw_scores=torch.tensor([1.0, 3.0]), scores=torch.tensor([1.0, -1.0]), has_eos=base.has_eos
        ),
        context_length=3,
        eos_token_id=EOS,
        pad_token_id=PAD,
        time_generate=2.0,
        time_score=0.5,
    )
    rewards = kl_penalised_rewards(traj, cfg)
    steps = estimate_advantages(rewards, cfg)
    advantages, returns = steps.advantages, steps.returns
    raw = torch.zeros(2, 4)
    for row, length in enumerate((2, 4)):  # the first response ends at its EOS, the second runs on
        later = 0.0
        for t in reversed(range(length)):
            next_value = values[row, t + 1].item() if t + 1 < length else 0.0
            delta = rewards.rewards[row, t].item() + 0.9 * next_value - values[row, t].item()
            later = delta + 0.9 * 0.8 * later
            raw[row, t] = later
    torch.testing.assert_close(returns * traj.token_mask, (raw + values) * traj.token_mask)
    tokens = raw[traj.token_mask]
    mean, var = tokens.mean(), ((tokens - tokens.mean()) ** 2).sum() / (tokens.numel() - 1)
    torch.testing.assert_close(advantages, (raw - mean) / torch.sqrt(var + 1e-8) * traj.token_mask)
    assert advantages[0, 2:].abs().sum() == 0 and advantages[traj.token_mask].std() > 0.5


def test_rollout_statistics_leave_out_returns_without_a_value_model():
    traj = two_responses()
    zeros = torch.zeros(2, 4)
    traj = replace(traj, rewards=zeros, non_score_reward=zeros, value_mask=traj.token_mask)
    stats = rollout_statistics(replace(traj, advantages=torch.ones(2, 4) * traj.token_mask, returns=None))
    assert "returns/mean" not in stats and "returns/var" not in stats and stats["advantages/mean"] == 1.0


def test_summary_logprobs_sums_the_tempered_logprobs_through_eos_ignoring_padding(tiny_llama):
    """By hand, one unpadded row at a time: log_softmax(logits / T) without PAD (never sampled,
    Detail 23) of each response token up to and including its EOS; the left padding of the queries and the PAD after EOS change nothing,
    and a summary without EOS counts every token."""
    queries = torch.tensor([[PAD, PAD, 11, 12, 13], [21, 22, 23, 24, 25]])
    responses = torch.tensor([[30, 31, EOS, PAD], [32, 33, 34, 35]])
    temperature = 0.7
    got = summary_logprobs(tiny_llama, queries, responses, PAD, temperature)
    for row, (query, response, keep) in enumerate(zip(queries, responses, (3, 4))):
        query = query[query != PAD]
        ids = torch.cat([query, response[:keep]])[None]
        with torch.no_grad():
            logits = tiny_llama(input_ids=ids).logits[0, len(query) - 1 : -1].float() / temperature
        logits[:, PAD] = -float("inf")
        expected = torch.log_softmax(logits, -1).gather(1, response[:keep, None]).sum()
        assert got[row].item() == pytest.approx(expected.item(), abs=1e-4)
    assert got.shape == (2,) and got.dtype == torch.float32
