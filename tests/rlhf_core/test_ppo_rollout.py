import pytest
import torch

from rlhf_core.ppo import INVALID_LOGPROB
from rlhf_core.ppo_rollout import Rewards, make_trajectory, rollout_statistics, throughput_statistics
from rlhf_core.reward import ResponseScores

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
    rewards = Rewards(rewards=non_score_reward, non_score_reward=non_score_reward, value_mask=mask)
    advantages = torch.tensor([[1.0, -2.0, 9.0, 9.0], [0.0, 1.0, 3.0, -3.0]]) * mask
    returns = torch.tensor([[1.0, 3.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    stats = rollout_statistics(traj, rewards, advantages, returns)
    expected = {
        "objective/scores": 0.0,  # with the EOS trick: 1 and -1
        "objective/kl": 1.5,  # nats per response: 2 x 0.5 and 4 x 0.5
        "objective/kl_per_token": 0.5,  # 3 nats over 6 tokens
        "objective/entropy": 3.0,  # -logprobs summed over each response's tokens: 2 and 4
        "objective/non_score_reward": -0.15,  # -0.05 x 2 tokens and -0.05 x 4
        "objective/rlhf_reward": -0.15,  # (1 - 0.1) and (-1 - 0.2)
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
