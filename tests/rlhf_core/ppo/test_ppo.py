"""PPO's math against hand-worked values (Details 23-25)."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhf_core.ppo.algorithm import (
    INVALID_LOGPROB,
    Minibatch,
    Trajectory,
    aggregate_loss,
    entropy_from_logits,
    gae,
    grpo_advantages,
    k3_kl,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    ppo_loss,
    response_mask,
    rloo_advantages,
    sampling_logits,
    sequence_returns,
    value_loss,
)
from rlhf_core.ppo.rollout import prompt_indices
from rlhf_core.train.reward import response_scores

T, F_ = True, False


def test_masked_mean_and_var_ignore_invalid_positions():
    values = torch.tensor([[2.0, 4.0, 6.0, 100.0]])
    mask = torch.tensor([[T, T, T, F_]])
    assert masked_mean(values, mask).item() == 4.0
    assert masked_var(values, mask).item() == pytest.approx(4.0)  # unbiased: (4 + 0 + 4) / 2
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(8 / 3)
    assert masked_mean(values, mask, axis=1).tolist() == [4.0]
    with pytest.raises(ValueError):
        masked_mean(values, torch.zeros_like(mask))


def test_masked_whiten_with_and_without_mean_shift():
    values = torch.tensor([[2.0, 4.0, 6.0, 100.0]])
    mask = torch.tensor([[T, T, T, F_]])
    torch.testing.assert_close(masked_whiten(values, mask)[0, :3], torch.tensor([-1.0, 0.0, 1.0]))
    # Detail 24: whitening rewards keeps their mean
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False)[0, :3], torch.tensor([3.0, 4.0, 5.0]))


def test_gae_hand_worked_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=0.95)
    # delta_2 = 1 - 0.7; delta_1 = 0.7 - 0.6; delta_0 = 0.6 - 0.5; A_t = delta_t + 0.95 A_{t+1}
    torch.testing.assert_close(adv, torch.tensor([[0.1 + 0.95 * (0.1 + 0.95 * 0.3), 0.1 + 0.95 * 0.3, 0.3]]))
    torch.testing.assert_close(ret, adv + values)


def test_gae_stops_at_the_end_of_the_valid_positions():
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 9.0]])
    mask = torch.tensor([[T, T, F_]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    a1 = 1.0 - 0.6
    a0 = (0.9 * 0.6 - 0.5) + 0.9 * 0.5 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.6, 0.0]]))


def test_values_above_the_scores_give_the_eos_the_most_negative_advantage_unless_lam_is_1():
    """Why cpu-demo runs GAE with lam 1: a value model that starts as a reward model whose
    outputs off the EOS are positive (Details 13, 22) sits above every return, so each response
    ends with a large negative TD error at its EOS. With lam < 1 the last tokens take most of
    it, and after whitening the EOS has the most negative advantage of its response even for
    the best-scored one (an "end later" push whatever the score); with lam 1 every token's
    advantage is its return minus its value, and the EOS advantages keep the scores' order."""
    scores = torch.tensor([-0.6, -0.3, 0.2])  # at the EOS, the last of 32 tokens
    rewards = torch.zeros(3, 32)
    rewards[:, -1] = scores
    values = torch.full((3, 32), 2.5)  # the reward model's outputs off the EOS
    mask = torch.ones(3, 32, dtype=torch.bool)
    whitened = {lam: masked_whiten(gae(rewards, values, mask, gamma=1.0, lam=lam)[0], mask) for lam in (0.95, 1.0)}
    a = whitened[0.95]
    assert (a[:, -1] < a[:, 0] - 2.0).all()  # every response: its EOS far below its first token,
    assert (a[:, -1] == a.min(dim=1).values).all() and a[2, -1] < -1.0  # the best-scored one's too
    a = whitened[1.0]
    torch.testing.assert_close(a[:, -1], a[:, 0])  # no position effect
    assert a[2, -1] > 0 > a[0, -1]  # the EOS is pushed by its score
    for a in whitened.values():
        assert a[:, -1].argsort().tolist() == [0, 1, 2]  # the EOS advantages keep the scores' order
    # lam 1: the advantage at every token of a response is its score minus the (constant) value
    advantages, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, (scores - 2.5)[:, None].expand(3, 32))


def test_rewards_put_kl_on_tokens_and_score_at_eos():
    logprobs = torch.tensor([[-1.0, -2.0, -1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0, 1.0], [-2.0, -2.0, -2.0, -2.0]])
    scores = torch.tensor([3.0, 7.0])
    seq = torch.tensor([2, 3])  # EOS at 2 in row 0; row 1 has no room after its last token
    rewards, non_score, mask = per_token_rewards(logprobs, ref, scores, seq, kl_coef=0.1, score_position="eos")
    kl = torch.tensor([[0.5, -1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    expected_ns = -0.1 * kl * torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(non_score, expected_ns)
    torch.testing.assert_close(rewards, expected_ns + torch.tensor([[0, 0, 3.0, 0], [0, 0, 0, 7.0]]))
    assert mask.tolist() == [[T, T, T, F_], [T, T, T, T]]

    rewards, _, mask = per_token_rewards(logprobs, ref, scores, seq, kl_coef=0.1, score_position="after_eos")
    torch.testing.assert_close(rewards, expected_ns + torch.tensor([[0, 0, 0, 3.0], [0, 0, 0, 7.0]]))
    assert mask.tolist() == [[T, T, T, T], [T, T, T, T]]
    with pytest.raises(ValueError):
        per_token_rewards(logprobs, ref, scores, seq, kl_coef=0.1, score_position="last")


def test_eos_trick():
    """Detail 23: a response is scored as ended only when the token its score is read at
    (before the first PAD, Detail 12) is EOS."""
    responses = torch.tensor(
        [
            [5, 9, 0],  # EOS, then PAD: keeps its score
            [5, 6, 7],  # no EOS
            [0, 5, 9],  # PAD sampled first: read in the query, not at an EOS
            [5, 0, 9],  # PAD before the EOS: read at 5
            [9, 0, 0],  # EOS first: keeps its score
        ]
    )
    scores = torch.tensor([2.0, 3.0, 4.0, 5.0, 6.0])
    got = response_scores(scores, responses, eos_token_id=9, pad_token_id=0, non_eos_penalty=-1.0)
    assert got.scores.tolist() == [2.0, -1.0, -1.0, -1.0, 6.0] and got.raw_scores.equal(scores)
    assert got.has_eos.tolist() == [True, False, False, False, True]
    untouched = response_scores(scores, responses, eos_token_id=9, pad_token_id=0, non_eos_penalty=None)
    assert untouched.scores.equal(scores)


def test_response_mask():
    assert response_mask(torch.tensor([0, 2]), 4).tolist() == [[T, F_, F_, F_], [T, T, T, F_]]
    assert response_mask(torch.tensor([0, 2]), 4, extra=1).tolist() == [[T, T, F_, F_], [T, T, T, T]]


def test_policy_loss_clipping_on_a_constructed_batch():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 9.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[T, T, T, F_]])
    out = policy_loss(new, old, adv, mask, cliprange=0.2)
    # losses -A*r: [-1.5, -0.5, 1.1]; clipped: [-1.2, -0.8, 1.1]; max: [-1.2, -0.5, 1.1]
    assert out["loss"].item() == pytest.approx((-1.2 - 0.5 + 1.1) / 3)
    assert out["clipfrac"].item() == pytest.approx(1 / 3)
    assert out["approxkl"].item() == pytest.approx(
        0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2 + math.log(1.1) ** 2) / 3
    )


def test_value_loss_clipping_on_a_constructed_batch():
    out = value_loss(
        torch.tensor([[0.5, 0.1, 7.0]]),
        torch.zeros(1, 3),
        torch.ones(1, 3),
        torch.tensor([[T, T, F_]]),
        cliprange_value=0.2,
    )
    # unclipped errors [0.25, 0.81]; clipped prediction [0.2, 0.1] -> errors [0.64, 0.81]
    assert out["loss"].item() == pytest.approx(0.5 * (0.64 + 0.81) / 2)
    assert out["clipfrac"].item() == pytest.approx(0.5)


def test_logprobs_use_the_sampling_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    tokens = torch.randint(0, 7, (2, 3))
    got = logprobs_from_logits(logits, tokens, temperature=0.7, pad_token_id=None)
    expected = F.log_softmax(logits / 0.7, -1).gather(2, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(got, expected)
    uniform = entropy_from_logits(torch.zeros(4, 8))
    torch.testing.assert_close(uniform, torch.full((4,), math.log(8)))


def test_sampling_distribution_excludes_pad():
    """PAD is never sampled, so the trained distribution is the softmax over the other tokens."""
    torch.manual_seed(0)
    pad = 3
    logits = torch.randn(2, 4, 7, requires_grad=True)
    tokens = torch.tensor([[0, 1, 2, 4], [5, 6, 0, 1]])
    got = logprobs_from_logits(logits, tokens, temperature=0.7, pad_token_id=pad)
    keep = [t for t in range(7) if t != pad]
    without_pad = F.log_softmax(logits[..., keep] / 0.7, -1)
    index = torch.tensor([keep.index(t) for t in tokens.flatten().tolist()]).view_as(tokens)
    torch.testing.assert_close(got, without_pad.gather(2, index[..., None]).squeeze(-1))
    tempered = sampling_logits(logits, 0.7, pad)
    assert (F.softmax(tempered, -1)[..., pad] == 0).all()
    entropy = entropy_from_logits(tempered)
    torch.testing.assert_close(entropy, -(without_pad.exp() * without_pad).sum(-1))
    got.sum().backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[..., pad] == 0).all()


def test_prompts_are_drawn_without_replacement_and_reshuffled():
    """Detail 21: each pass over the split sees every prompt once, in a new order."""
    n, b = 5, 2
    stream = [i for u in range(5) for i in prompt_indices(n, b, u, seed=3)]
    first, second = stream[:5], stream[5:10]
    assert sorted(first) == list(range(5)) and sorted(second) == list(range(5))
    assert first != second
    assert prompt_indices(n, b, 2, seed=3) == [first[4], second[0]]


def test_rloo_hand_worked_example():
    """Two prompts, k = 3: each return minus the mean of the other two of its prompt."""
    returns = torch.tensor([1.0, 2.0, 6.0, -1.0, -1.0, 2.0])
    # prompt 0: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5
    # prompt 1: -1 - (-1+2)/2 = -1.5, the same, 2 - (-1-1)/2 = 3
    expected = [-3.0, -1.5, 4.5, -1.5, -1.5, 3.0]
    assert rloo_advantages(returns, 3).tolist() == pytest.approx(expected)
    assert rloo_advantages(returns, 3).view(2, 3).sum(1).tolist() == pytest.approx([0.0, 0.0])
    # k = 2: the other sample is the baseline
    assert rloo_advantages(torch.tensor([0.5, 0.25]), 2).tolist() == [0.25, -0.25]


def test_grpo_hand_worked_example():
    """(R - mean) / (std + 1e-4) within each prompt's k samples, std with Bessel's correction."""
    returns = torch.tensor([1.0, 2.0, 6.0, 0.0, 4.0, 8.0], dtype=torch.float64)
    # prompt 0: mean 3, std sqrt((4 + 1 + 9) / 2) = sqrt(7); prompt 1: mean 4, std 4
    s7 = math.sqrt(7.0)
    expected = [-2 / (s7 + 1e-4), -1 / (s7 + 1e-4), 3 / (s7 + 1e-4), -4 / 4.0001, 0.0, 4 / 4.0001]
    assert grpo_advantages(returns, 3).tolist() == pytest.approx(expected, rel=1e-12)


def test_grpo_scales_by_the_group_the_batch_or_not_at_all():
    """``scale_rewards``: the group's std (above), one std for the whole batch (TRL's ``batch``),
    or none (Dr. GRPO): the centred scores themselves."""
    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, 4.0, 8.0], dtype=torch.float64)
    centred = [-2.0, -1.0, 3.0, -4.0, 0.0, 4.0]
    assert grpo_advantages(scores, 3, "none").tolist() == centred
    std = scores.std()
    assert grpo_advantages(scores, 3, "batch", std).tolist() == pytest.approx(
        [c / (std.item() + 1e-4) for c in centred], rel=1e-12
    )
    with pytest.raises(ValueError, match="needs batch_std"):
        grpo_advantages(scores, 3, "batch")
    with pytest.raises(ValueError, match="not 'mean'"):
        grpo_advantages(scores, 3, "mean")


def test_k3_kl_by_hand_its_value_and_its_gradient():
    """k3 = exp(ref - logp) - (ref - logp) - 1 per token (DeepSeekMath eq. 4): 0 where the policy
    and the reference agree, positive elsewhere, 0 outside the mask; d k3 / d logp = 1 - exp(ref - logp)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, INVALID_LOGPROB, INVALID_LOGPROB]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-3.0, INVALID_LOGPROB, -40.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    kl = k3_kl(logp, ref, mask)
    d = [[-0.5, 1.0, 0.0], [-2.0, 0.0, 0.0]]
    expected = [[math.exp(x) - x - 1 for x in row] for row in d]
    torch.testing.assert_close(kl, torch.tensor(expected))
    assert kl[0, 2] == 0 and kl[1, 1:].abs().sum() == 0
    kl.sum().backward()
    grads = [[(1 - math.exp(x)) if m else 0.0 for x, m in zip(row, mrow)] for row, mrow in zip(d, mask.tolist())]
    torch.testing.assert_close(logp.grad, torch.tensor(grads))


@pytest.mark.parametrize("estimator", [rloo_advantages, grpo_advantages], ids=["rloo", "grpo"])
def test_a_group_of_equal_returns_has_advantages_exactly_0(estimator):
    """No signal within a prompt's samples: no update from them, and no NaN (grpo's std is 0)."""
    returns = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.7, 0.1])  # 0.1 has no exact float
    advantages = estimator(returns, 3)
    assert advantages[:3].tolist() == [0.0] * 3  # (0.1 + 0.1 + 0.1 - 0.1) / 2 is not 0.1 in float32
    assert torch.isfinite(advantages).all() and advantages[3:].abs().sum() > 0


@pytest.mark.parametrize("estimator", [rloo_advantages, grpo_advantages], ids=["rloo", "grpo"])
def test_group_estimators_refuse_groups_of_one_or_a_batch_they_do_not_divide(estimator):
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        estimator(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="5 returns in groups of 2"):
        estimator(torch.zeros(5), 2)


def test_sequence_return_is_the_score_minus_kl_coef_times_the_summed_kl():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, INVALID_LOGPROB, INVALID_LOGPROB]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5], [-3.0, INVALID_LOGPROB, INVALID_LOGPROB]])
    rewards, _, _ = per_token_rewards(logprobs, ref_logprobs, torch.tensor([2.0, -1.0]), torch.tensor([2, 0]), 0.1)
    # KL sums 0.5 - 1 + 0 = -0.5 and 2: returns 2 + 0.05 and -1 - 0.2
    assert sequence_returns(rewards).tolist() == pytest.approx([2.05, -1.2])


@pytest.mark.parametrize("loss_type", ["paper", "dapo", "grpo", "dr_grpo"])
def test_a_minibatchs_loss_and_its_gradient_whatever_the_micro_batches(loss_type):
    """Two responses of 2 and 8 tokens with advantages +1 and -1, one minibatch, as one
    micro-batch or two of one row: each token's weight in the gradient. ``paper`` (the token
    mean of each micro-batch) gives each token 0.1 in one micro-batch, and 0.25 and 0.0625 in
    micro-batches of one; ``dapo``, ``grpo`` and ``dr_grpo`` give the same weights either way."""
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :2], mask[1, :] = True, True
    weights = {}
    for split in ([[0, 1]], [[0], [1]]):
        per_token = torch.zeros(2, 8, requires_grad=True)
        for rows in split:
            aggregate_loss([(1.0, per_token[rows])], mask[rows], loss_type, Minibatch(len(rows) / 2, 2, 10)).backward()
        weights[len(split)] = per_token.grad
    one, two = weights[1], weights[2]
    expected = {
        "paper": (0.1, 0.1),
        "dapo": (0.1, 0.1),
        "grpo": (0.25, 0.0625),
        "dr_grpo": (1 / 16, 1 / 16),
    }[loss_type]
    torch.testing.assert_close(one[0, :2], torch.full((2,), expected[0]))
    torch.testing.assert_close(one[1], torch.full((8,), expected[1]))
    assert one[0, 2:].abs().sum() == 0
    if loss_type == "paper":
        torch.testing.assert_close(two[0, :2], torch.full((2,), 0.25))
        torch.testing.assert_close(two[1], torch.full((8,), 0.0625))
    else:
        torch.testing.assert_close(two, one)
    with pytest.raises(ValueError, match="not 'seq'"):
        aggregate_loss([(1.0, torch.zeros(1, 2))], torch.ones(1, 2, dtype=torch.bool), "seq", Minibatch(1.0, 1, 2))


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
@pytest.mark.parametrize("loss_type", ["paper", "dapo", "grpo", "dr_grpo"])
def test_ppo_loss_by_hand(estimator, loss_type):
    """One row of two response tokens (of three), the policy unchanged since sampling (ratio 1),
    advantages 2 and 1, the reference 0.3 nats below the policy, the micro-batch half of a
    minibatch of 2 rows and 4 tokens: the policy's terms are -2 and -1, GRPO's k3 KL
    exp(-0.3) + 0.3 - 1 on each; the value model's predictions 1 and 2 against returns 0 and old
    values 1 give squared errors 1 and 4 (clipped: 1 and 1.44), a loss of 0.5 * 2.5."""
    from rlhf_core.config.settings import PPOConfig

    cfg = PPOConfig(advantage_estimator=estimator, loss_type=loss_type, kl_coef=0.1, vf_coef=0.1, cliprange_value=0.2)
    mask = torch.tensor([[True, True, False]])
    logprobs = torch.tensor([[-1.0, -2.0, INVALID_LOGPROB]])
    batch = Trajectory(
        query_responses=torch.zeros(1, 5, dtype=torch.long),
        responses=torch.zeros(1, 3, dtype=torch.long),
        logprobs=logprobs,
        ref_logprobs=logprobs - 0.3,
        values=torch.tensor([[1.0, 1.0, 0.0]]),
        raw_scores=torch.zeros(1),
        scores=torch.zeros(1),
        has_eos=torch.tensor([True]),
        last_token_indices=torch.tensor([1]),
        token_mask=mask,
        context_length=2,
        advantages=torch.tensor([[2.0, 1.0, 0.0]]),
        returns=torch.zeros(1, 3),
        value_mask=mask,
    )
    minibatch = Minibatch(share=0.5, rows=2, tokens=4)
    kl = math.exp(-0.3) + 0.3 - 1 if estimator == "grpo" else 0.0
    per_token = [-2.0 + 0.1 * kl, -1.0 + 0.1 * kl]
    policy = {
        "paper": sum(per_token) / 2 * 0.5,
        "dapo": sum(per_token) / 4,
        "grpo": sum(per_token) / 2 / 2,
        "dr_grpo": sum(per_token) / (2 * 3),
    }[loss_type]
    loss, stats = ppo_loss(batch, logprobs.clone(), None, cfg, minibatch)
    assert loss.item() == pytest.approx(policy, abs=1e-6)
    assert stats["policy_loss"].item() == pytest.approx(-1.5) and stats["clipfrac"].item() == 0.0
    assert stats["ratio"][mask].tolist() == [1.0, 1.0] and stats["approxkl"].item() == 0.0
    assert ("kl_loss" in stats) == (estimator == "grpo") and stats.get("kl_loss", torch.tensor(0.0)).item() == (
        pytest.approx(kl, rel=1e-5)
    )
    new_values = torch.tensor([[1.0, 2.0, 0.0]])
    loss, stats = ppo_loss(batch, None, new_values, cfg, minibatch)
    assert loss.item() == pytest.approx(0.1 * 0.5 * 2.5 * 0.5) and set(stats) == {"value_loss", "value_clipfrac"}
    assert stats["value_loss"].item() == pytest.approx(1.25) and stats["value_clipfrac"].item() == 0.0
    both, _ = ppo_loss(batch, logprobs.clone(), new_values, cfg, minibatch)
    assert both.item() == pytest.approx(policy + 0.0625, abs=1e-6)


def test_a_trajectory_slices_every_row_tensor_and_keeps_the_rest():
    """``traj[idx]``, a micro-batch: each per-row tensor at the rows ``idx``, in their order;
    ``None`` (no value model, step 3 not run) and the context length kept."""
    rows, R = 4, 3
    traj = Trajectory(
        query_responses=torch.arange(rows * 5).reshape(rows, 5),
        responses=torch.arange(rows * R).reshape(rows, R),
        logprobs=-torch.rand(rows, R),
        ref_logprobs=-torch.rand(rows, R),
        values=None,
        raw_scores=torch.arange(rows, dtype=torch.float),
        scores=-torch.arange(rows, dtype=torch.float),
        has_eos=torch.tensor([True, False, True, False]),
        last_token_indices=torch.tensor([0, 2, 1, 2]),
        token_mask=torch.rand(rows, R) > 0.5,
        context_length=2,
        time_generate=1.5,
        rewards=torch.rand(rows, R),
    )
    idx = torch.tensor([3, 1])
    part = traj[idx]
    for name in ("query_responses", "responses", "logprobs", "ref_logprobs", "raw_scores", "scores", "has_eos"):
        assert getattr(part, name).equal(getattr(traj, name)[idx]), name
    assert part.last_token_indices.equal(traj.last_token_indices[idx]) and part.token_mask.equal(traj.token_mask[idx])
    assert part.rewards.equal(traj.rewards[idx])
    assert part.values is None and part.advantages is None and part.returns is None
    assert part.context_length == 2 and part.time_generate == 1.5
