"""The PPO stage on the smoke preset: four models, rollouts, updates, faults and resume."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import load_config
from rlhf_core.data import prepare_data
from rlhf_core.models import import_base_model
from rlhf_core.ppo import INVALID_LOGPROB, logprobs_from_logits
from rlhf_core.ppo_trainer import PPOTrainer, response_logits, run_ppo
from rlhf_core.reward import ScalarModel, reward_model_from_causal_lm
from rlhf_core.tracking import JsonlTracker, read_metrics
from rlhf_core.training import TrainingError

REPORTED = ["objective/scores", "objective/rlhf_reward", "objective/kl", "objective/entropy",
            "objective/non_score_reward", "policy/approxkl", "policy/clipfrac", "policy/entropy", "loss/policy",
            "loss/value", "val/clipfrac", "val/ratio", "val/ratio_var", "returns/mean", "advantages/max",
            "response/length_mean", "response/no_eos_fraction", "response/length_score_corr", "lr", "episodes",
            "time/generate", "time/score", "time/train", "time/generate_tokens_per_s", "memory/peak_mb"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Data, a base model standing in for SFT, and a reward model made from it."""
    cfg = load_config("smoke")
    root = tmp_path_factory.mktemp("ppo")
    prepare_data(cfg, root / "data")
    import_base_model(cfg.model, root / "sft")
    reward_model_from_causal_lm(root / "sft", seed=1).save_pretrained(root / "rm")
    return cfg, root


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


def test_rollout_is_consistent(smoke):
    cfg, root = smoke
    trainer = PPOTrainer(cfg.ppo, root / "data", root / "sft", root / "rm")
    batch = trainer.rollout(trainer.queries[:6])
    R = trainer.response_length
    assert batch["responses"].shape == (6, R)  # exactly response_length sampled tokens
    mask = batch["token_mask"]
    # rollout log-probabilities equal a fresh forward pass of the same policy (dropout off, Detail 7)
    with torch.no_grad():
        logits = response_logits(trainer.policy, batch["query_responses"], trainer.pad_id, int(batch["context_length"]))
    fresh = logprobs_from_logits(logits, batch["responses"], cfg.ppo.temperature)
    torch.testing.assert_close(batch["logprobs"][mask], fresh[mask], rtol=1e-4, atol=1e-4)
    # the reference is the same network at the start: KL is zero
    torch.testing.assert_close(batch["logprobs"][mask], batch["ref_logprobs"][mask], rtol=1e-4, atol=1e-4)
    assert (batch["logprobs"][~mask] == INVALID_LOGPROB).all()
    # no EOS in a random model's samples: the EOS trick gives every response the penalty
    no_eos = ~batch["has_eos"]
    assert (batch["scores"][no_eos] == cfg.ppo.non_eos_penalty).all()
    # whitened advantages over valid tokens
    adv = batch["advantages"][mask]
    assert abs(adv.mean().item()) < 1e-4 and abs(adv.std().item() - 1) < 1e-2
    assert (batch["advantages"][~mask] == 0).all()


def test_ppo_stage_reports_and_saves(smoke, tmp_path):
    cfg, root = smoke
    ppo_cfg = cfg.ppo.model_copy(update={"total_episodes": 16, "eval_every": 1, "eval_max_samples": 4})
    metrics = run_ppo(ppo_cfg, root / "data", root / "sft", root / "rm", tmp_path / "ppo",
                      tracker=JsonlTracker(tmp_path / "m.jsonl"))
    records = read_metrics(tmp_path / "m.jsonl")
    assert [s for s, _ in records] == [1, 2]
    for _, m in records:
        for key in REPORTED:
            assert key in m and math.isfinite(m[key]), key
        assert "eval/score_policy" in m and "eval/score_reference" in m
    assert records[-1][1]["episodes"] == 16
    assert records[0][1]["lr"] == pytest.approx(ppo_cfg.learning_rate)
    assert records[1][1]["lr"] == pytest.approx(ppo_cfg.learning_rate / 2)  # linear decay to 0 over 2 updates
    assert metrics["ppo/updates"] == 2
    policy = load_file(str(tmp_path / "ppo" / "model" / "model.safetensors"))
    sft = load_file(str(root / "sft" / "model.safetensors"))
    assert any(not torch.equal(policy[k], sft[k]) for k in sft)
    assert ScalarModel.from_pretrained(tmp_path / "ppo" / "value_model").head.weight.shape[0] == 1
    samples = [json.loads(l) for l in (tmp_path / "ppo" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {"post", "reference", "policy", "score_policy"} <= set(samples[0])


def test_non_finite_scores_stop_with_the_update_named(smoke, tmp_path):
    cfg, root = smoke
    broken = ScalarModel.from_pretrained(root / "rm")
    with torch.no_grad():
        broken.head.bias.fill_(float("nan"))
    broken.save_pretrained(tmp_path / "broken_rm")
    with pytest.raises(TrainingError, match="non-finite .* at update 1"):
        run_ppo(cfg.ppo.model_copy(update={"non_eos_penalty": float("nan")}), root / "data", root / "sft",
                tmp_path / "broken_rm", tmp_path / "ppo")
    assert (tmp_path / "ppo" / "checkpoints" / "step-000000" / "state.pt").is_file()
    assert not (tmp_path / "ppo" / "model").exists()


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    """Kill `rlhf ppo` with SIGKILL after a checkpoint; the resumed run's final policy is identical."""
    overrides = ["ppo.total_episodes=24", "ppo.batch_size=4", "ppo.micro_batch_size=2", "ppo.checkpoint_every=2",
                 "ppo.eval_every=100", "ppo.eval_max_samples=2", "sft.max_steps=1", "sft.eval_max_samples=1",
                 "reward.max_steps=1", "reward.eval_max_samples=2"]
    exe = str(Path(sys.executable).with_name("rlhf"))
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    proc = subprocess.Popen([exe, "ppo", "--preset", "smoke", *overrides, "--out", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ)
    checkpoint = killed / "ppo" / "checkpoints" / "step-000002" / "state.pt"
    deadline = time.time() + 600
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the stage finished before it could be killed"
    assert not (killed / "ppo" / "model").exists()
    logs = {}
    for out in (killed, clean):
        result = subprocess.run([exe, "ppo", "--preset", "smoke", *overrides, "--out", str(out)],
                                capture_output=True, text=True, env=os.environ, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        logs[out] = result.stderr
    assert "resumed from" in logs[killed] and "stage reward_eval: finished earlier" in logs[killed]
    a = load_file(str(killed / "ppo" / "model" / "model.safetensors"))
    b = load_file(str(clean / "ppo" / "model" / "model.safetensors"))
    for k in b:
        assert torch.equal(a[k], b[k]), k
    va = load_file(str(killed / "ppo" / "value_model" / "model.safetensors"))
    vb = load_file(str(clean / "ppo" / "value_model" / "model.safetensors"))
    for k in vb:
        assert torch.equal(va[k], vb[k]), k
