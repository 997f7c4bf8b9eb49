"""DPO (Appendix A, eq. 4; Detail 19): the loss, the implicit reward, sequence log-probabilities,
and the trainer on the smoke stages (one process and 2 gloo ranks)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from rlhf_core.common.tracking import JsonlTracker, NullTracker, read_metrics
from rlhf_core.config.presets import load_config
from rlhf_core.evaluation.dpo_eval import evaluate_dpo_reward
from rlhf_core.train import dpo
from rlhf_core.train.distributed import world
from rlhf_core.train.dpo import dpo_loss, implicit_reward, pair_logprobs, sequence_logprobs
from tests.stages import finished_run, kill_then_resume


def test_dpo_loss_on_a_hand_worked_example():
    """beta 0.5; pair 1: the policy raised the chosen response by 1 nat over the reference and
    lowered the rejected by 1, so r_c = 0.5, r_r = -0.5 and the loss is -log sigmoid(1) =
    log(1 + e^-1) = 0.313262; pair 2: policy = reference, log 2; pair 3: the reverse of pair 1,
    log(1 + e) = 1.313262."""
    policy_chosen = torch.tensor([-3.0, -7.0, -5.0], requires_grad=True)
    policy_rejected = torch.tensor([-5.0, -2.0, -3.0])
    ref_chosen, ref_rejected = torch.tensor([-4.0, -7.0, -4.0]), torch.tensor([-4.0, -2.0, -4.0])
    losses, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, 0.5)
    assert losses.tolist() == pytest.approx([0.313262, math.log(2), 1.313262], abs=1e-6)
    assert chosen_rewards.tolist() == pytest.approx([0.5, 0.0, -0.5])
    assert rejected_rewards.tolist() == pytest.approx([-0.5, 0.0, 0.5])
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad
    losses.sum().backward()
    # d loss / d log pi(y_c) = -beta * sigmoid(-(r_c - r_r))
    expected = [-0.5 * torch.sigmoid(torch.tensor(-m)).item() for m in (1.0, 0.0, -1.0)]
    assert policy_chosen.grad.tolist() == pytest.approx(expected, abs=1e-6)


def test_implicit_reward_is_beta_times_the_log_ratio():
    assert implicit_reward(torch.tensor([-2.0, -10.0]), torch.tensor([-3.0, -4.0]), 0.05).tolist() == pytest.approx(
        [0.05, -0.3]
    )


def _row_logprob(model, query: list[int], response: list[int]) -> float:
    """One unpadded row through the model's own forward: the sum of log p over the response."""
    ids = torch.tensor([query + response])
    with torch.no_grad():
        logp = F.log_softmax(model(ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    per_token = logp.gather(1, targets[:, None]).squeeze(1)
    return per_token[len(query) - 1 :].sum().item()


def test_sequence_logprobs_sum_the_response_with_its_eos_not_the_query_or_pad(tiny_llama):
    pad, eos = 0, 39
    rows = [([5, 6, 7, 8], [9, 10, eos]), ([11, 12], [13, 14, 15, 16, eos]), ([17, 18, 19], [eos])]
    length = 8
    batch = torch.tensor([q + r + [pad] * (length - len(q) - len(r)) for q, r in rows])
    query_lengths = torch.tensor([len(q) for q, _ in rows])
    with torch.no_grad():
        got = sequence_logprobs(tiny_llama, batch, query_lengths, pad)
    expected = [_row_logprob(tiny_llama, q, r) for q, r in rows]
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(expected, abs=1e-4)
    without_eos = [_row_logprob(tiny_llama, q, r[:-1]) if len(r) > 1 else 0.0 for q, r in rows]
    assert all(abs(a - b) > 1e-3 for a, b in zip(expected, without_eos))  # the EOS term is there
    with_query = [_row_logprob(tiny_llama, q[:1], q[1:] + r) for q, r in rows]
    assert all(abs(a - b) > 1e-3 for a, b in zip(expected, with_query))  # and no query term
    # pairs: chosen and rejected of one query in one batch
    chosen, rejected = pair_logprobs(tiny_llama, batch[:2], batch[[1, 0]], torch.tensor([4, 2]), pad)
    assert chosen.tolist() == pytest.approx(got[:2].tolist(), abs=1e-5)


def _pairs(pad: int, eos: int, length: int = 12):
    """Right-padded pairs of one query each: different query lengths, responses that share
    their first tokens, identical responses, a one-token response (EOS only)."""
    pairs = [
        ([5, 6, 7, 8, 9], [10, 11, eos], [12, eos]),
        ([13, 14], [15, 16, 17, 18, eos], [15, 16, 19, eos]),  # two shared response tokens
        ([20, 21, 22], [23, eos], [23, eos]),  # identical responses
        ([24, 25, 26, 27], [eos], [28, 29, 30, eos]),
    ]

    def row(q, r):
        return q + r + [pad] * (length - len(q) - len(r))

    chosen = torch.tensor([row(q, c) for q, c, _ in pairs])
    rejected = torch.tensor([row(q, r) for q, _, r in pairs])
    return chosen, rejected, torch.tensor([len(q) for q, _, _ in pairs])


@pytest.mark.parametrize("checkpointing", [False, "selective", True])
def test_pair_logprobs_run_the_query_once_and_equal_both_rows_in_full(tiny_llama, checkpointing):
    """The shared-query pass gives the log-probabilities and gradients of running every row in
    full; the query goes through the backbone once per pair (not with activation checkpointing,
    full or selective: transformers keeps no cache in training then, and the full rows run)."""
    import copy

    from rlhf_core.train.training import enable_activation_checkpointing

    model = copy.deepcopy(tiny_llama).train()
    enable_activation_checkpointing(model, checkpointing)
    pad, eos = 0, 39
    chosen, rejected, query_lengths = _pairs(pad, eos)
    shapes = []
    hook = model.base_model.register_forward_hook(
        lambda module, args, kwargs, out: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    c, r = pair_logprobs(model, chosen, rejected, query_lengths, pad)
    hook.remove()
    full = sequence_logprobs(model, torch.cat([chosen, rejected]), query_lengths.repeat(2), pad)
    torch.testing.assert_close(c, full[:4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r, full[4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c[2], r[2])
    if checkpointing:
        assert shapes[0] == (8, 8)  # full rows, PAD columns past the longest row dropped
    else:
        # the prefix once per pair (up to each query's last token: 4 columns for the longest
        # query), then both rows from there to the token before EOS (pair 2: 5 positions)
        assert shapes[:2] == [(4, 4), (8, 5)]
    params = [model.get_input_embeddings().weight, model.model.layers[0].self_attn.q_proj.weight]
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])
    grads = torch.autograd.grad((weights * (c - r)).sum(), params)
    expected = torch.autograd.grad((weights * (full[:4] - full[4:])).sum(), params)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _dpo_on_smoke(smoke_stages, out, *overrides: str) -> dict:
    """3 DPO steps of 8 pairs from the smoke model (float32: the 2-rank equality is of float32
    sums in another order); rank 0 records the steps in ``out/metrics.jsonl``."""
    settings = ["dpo.batch_size=8", "dpo.max_steps=3", "dpo.bf16=false", "dpo.learning_rate=1e-4", *overrides]
    cfg = load_config("smoke", settings).dpo
    tracker = JsonlTracker(Path(out) / "metrics.jsonl") if world().is_main else NullTracker()
    return dpo.run_dpo(cfg, smoke_stages / "data", smoke_stages / "base", out, tracker)


def test_dpo_trains_the_policy_against_a_frozen_reference(smoke_stages, tmp_path, monkeypatch):
    references, load_reference = [], dpo.load_reference

    def keep(path, device):  # the real reference, kept to be inspected after training
        references.append(load_reference(path, device))
        return references[-1]

    monkeypatch.setattr(dpo, "load_reference", keep)
    metrics = _dpo_on_smoke(smoke_stages, tmp_path / "dpo", "dpo.micro_batch_size=4")
    records = [m for _, m in read_metrics(tmp_path / "dpo" / "metrics.jsonl") if "dpo/loss" in m]
    assert [r["step"] for r in records] == [1, 2, 3]
    # step 1: the policy is the reference, so every implicit reward is 0 and the loss log 2
    assert records[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[0]["dpo/rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert records[1]["dpo/loss"] != pytest.approx(math.log(2), abs=1e-6)  # then it has moved
    for r in records:
        assert r["dpo/rewards/margin"] == pytest.approx(r["dpo/rewards/chosen"] - r["dpo/rewards/rejected"])
        assert 0.0 <= r["dpo/accuracy"] <= 1.0
    assert metrics["dpo/steps"] == 3 and json.loads((tmp_path / "dpo" / "metrics.json").read_text()) == metrics
    # the reference received no gradient and is still the SFT model
    (reference,) = references
    assert all(p.grad is None and not p.requires_grad for p in reference.parameters())
    sft = dpo.load_causal_lm(smoke_stages / "base").state_dict()
    assert all(torch.equal(t, sft[k]) for k, t in reference.state_dict().items())
    trained = dpo.load_causal_lm(tmp_path / "dpo" / "model").state_dict()
    assert any(not torch.equal(t, sft[k]) for k, t in trained.items())


def _dpo_on_rank(rank: int, world_size: int, store: str, smoke_stages, out: str, *overrides: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        _dpo_on_smoke(smoke_stages, out, "dpo.micro_batch_size=2", *overrides)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("adapters", [[], ["dpo.lora.r=8"]], ids=["full", "lora"])
def test_two_ranks_with_half_the_micro_batch_match_one_rank(smoke_stages, tmp_path, adapters):
    """DPO under data parallelism (DDP, 2 gloo ranks, 2 pairs per micro-batch each) trains like
    one process with 4 pairs per micro-batch: same per-step metrics and saved weights; with
    low-rank adapters too (DDP sums the adapters' gradients, the frozen weights have none)."""
    _dpo_on_smoke(smoke_stages, tmp_path / "one", "dpo.micro_batch_size=4", *adapters)
    args = (2, str(tmp_path / "store"), smoke_stages, str(tmp_path / "two"), *adapters)
    mp.spawn(_dpo_on_rank, args=args, nprocs=2, join=True)
    runs = [[m for _, m in read_metrics(tmp_path / run / "metrics.jsonl") if "dpo/loss" in m] for run in ("one", "two")]
    for key in ("dpo/loss", "dpo/rewards/chosen", "dpo/rewards/rejected"):
        assert [r[key] for r in runs[1]] == pytest.approx([r[key] for r in runs[0]], rel=1e-4, abs=1e-6), key
    # at step 1 the policy is the reference: every implicit reward is 0 up to rounding, whose
    # sign (and so the accuracy) depends on how the micro-batches are cut
    assert [r["dpo/accuracy"] for r in runs[1][1:]] == [r["dpo/accuracy"] for r in runs[0][1:]]
    weights = [dpo.load_causal_lm(tmp_path / run / "model").state_dict() for run in ("one", "two")]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.heavy
def test_the_implicit_reward_model_is_evaluated_like_the_reward_model(smoke_stages, tmp_path):
    """Detail 19: DPO's implicit reward model on the reward model's evaluation pairs, with the
    same metrics; the SFT policy as its own reference gives every response reward 0."""
    import datasets

    from rlhf_core.evaluation.reward_eval import evaluate_reward_model

    cfg = load_config("smoke", ["reward.eval_max_samples=12", "dpo.bf16=false"])
    _dpo_on_smoke(smoke_stages, tmp_path / "dpo", "dpo.micro_batch_size=4")
    args = (cfg.dpo, cfg.reward, smoke_stages / "data")
    implicit = evaluate_dpo_reward(*args, tmp_path / "dpo" / "model", smoke_stages / "base", tmp_path / "eval")
    explicit = evaluate_reward_model(cfg.reward, smoke_stages / "data", smoke_stages / "rm", tmp_path / "rm_eval")
    assert implicit.keys() == explicit.keys() and "eval/validation_cnndm/accuracy" in implicit
    # the accuracy is that of beta * (log pi - log pi_ref) computed here, pair by pair
    rows = datasets.load_from_disk(str(smoke_stages / "data" / "preference" / "validation")).select(range(12))
    t = rows.with_format("torch", columns=["query_chosen_token", "query_rejected_token", "query_token_len"])[:]
    policy, reference = dpo.load_causal_lm(tmp_path / "dpo" / "model"), dpo.load_causal_lm(smoke_stages / "base")
    with torch.no_grad():
        pad = policy.config.pad_token_id
        pc, pr = pair_logprobs(policy, t["query_chosen_token"], t["query_rejected_token"], t["query_token_len"], pad)
        rc, rr = pair_logprobs(reference, t["query_chosen_token"], t["query_rejected_token"], t["query_token_len"], pad)
    chosen, rejected = implicit_reward(pc, rc, cfg.dpo.beta), implicit_reward(pr, rr, cfg.dpo.beta)
    assert implicit["eval/accuracy"] == pytest.approx((chosen > rejected).float().mean().item())
    assert implicit["eval/reward/chosen/mean"] == pytest.approx(chosen.double().mean().item(), abs=1e-6)
    untrained = evaluate_dpo_reward(*args, smoke_stages / "base", smoke_stages / "base", tmp_path / "eval0")
    assert untrained["eval/reward/chosen/max"] == untrained["eval/reward/chosen/min"] == 0.0
    assert untrained["eval/accuracy"] == 0.0  # a tie is not a correct pair


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, shared_runs):
    """Kill `rlhf dpo` with SIGKILL after a mid-stage checkpoint; the resumed run ends with the
    uninterrupted run's weights and per-step metrics, bit for bit. Both runs start from copies of
    one run of the stages before DPO."""
    from safetensors.torch import load_file

    upstream = ["sft.max_steps=1", "sft.eval_max_samples=1"]
    overrides = [
        *upstream,
        "dpo.num_epochs=2",
        "dpo.max_steps=12",
        "dpo.batch_size=4",
        "dpo.micro_batch_size=2",
        "dpo.checkpoint_every=2",
        "reward.eval_max_samples=2",
    ]
    logs = kill_then_resume("dpo", "dpo", overrides, tmp_path, start_from=finished_run(shared_runs, "sft", upstream))
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    for log in logs.values():
        assert "stage sft: finished earlier with the same config and code, reused" in log
    assert not (killed / "reward").exists()  # the DPO branch trains no reward model
    a, b = (load_file(str(out / "dpo" / "model" / "model.safetensors")) for out in (killed, clean))
    assert a.keys() == b.keys()
    for k in b:
        assert torch.equal(a[k], b[k]), k
    per_step = [
        {step: m["dpo/loss"] for step, m in read_metrics(out / "dpo" / "metrics.jsonl") if "dpo/loss" in m}
        for out in (killed, clean)
    ]
    assert per_step[0] == per_step[1] and sorted(per_step[1]) == list(range(1, 13))
    evaluated = [json.loads((out / "dpo_eval" / "metrics.json").read_text()) for out in (killed, clean)]
    assert evaluated[0]["eval/accuracy"] == evaluated[1]["eval/accuracy"]
