"""Low-rank adapters (rlhf_core.train.lora, peft) in every trainer: only the adapters (and a scalar
head) train, the base weights stay bitwise as they were, the merged checkpoint loads with the
plain auto classes and computes what the adapted model computed, the adapter loads with peft,
and the reference policy is the policy with its adapters off."""

import copy

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError, LoraConfig
from rlhf_core.models.saved import load_causal_lm
from rlhf_core.ppo import trainer as ppo_trainer
from rlhf_core.ppo.algorithm import estimate_advantages, kl_penalised_rewards, logprobs_from_logits
from rlhf_core.ppo.trainer import PPOTrainer
from rlhf_core.train import dpo, lora, reward, sft
from rlhf_core.train.forward import response_logits
from rlhf_core.train.reward import ScalarModel, reward_model_from_causal_lm
from tests.stages import link_stages

LLAMA_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def smoke(smoke_stages, tmp_path_factory):
    """Data, a base model standing in for SFT, and a reward model made from it."""
    return link_stages(smoke_stages, tmp_path_factory.mktemp("lora"), data="data", sft="base", rm="rm")


def _adam_steps(model: torch.nn.Module, loss_fn, steps: int = 3) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss_fn().backward()
        optimizer.step()
        optimizer.zero_grad()


def _frozen_weights_unchanged(adapted_state: dict, before: dict) -> None:
    """Every weight of ``before`` (the model as loaded) is, bitwise, the same tensor in the adapted
    model: under peft's name (``...q_proj.base_layer.weight``), or its own."""
    for name, tensor in before.items():
        module, _, leaf = name.rpartition(".")
        candidates = [name, f"{module}.base_layer.{leaf}", f"{module}.original_module.{leaf}"]
        found = [adapted_state[c] for c in candidates if c in adapted_state]
        assert found, name
        assert torch.equal(found[0], tensor), name


# ------------------------------------------------------------------ the module


def test_config_lora_off_by_default_and_out_of_the_dumped_settings():
    cfg = load_config("smoke")
    for section in (cfg.sft, cfg.reward, cfg.dpo, cfg.ppo):
        assert section.lora.r == 0 and "lora" not in section.model_dump()
    on = load_config("smoke", ["ppo.lora.r=8", "ppo.lora.target_modules=[q_proj, v_proj]"])
    assert on.ppo.model_dump()["lora"] == {
        "r": 8,
        "alpha": 16.0,
        "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
    }
    with pytest.raises(ConfigError, match=r"sft\.lora\.r 8 needs sft\.strategy ddp"):
        load_config("smoke", ["sft.lora.r=8", "sft.strategy=fsdp"])
    with pytest.raises(ConfigError, match="dpo.lora.r"):
        load_config("smoke", ["dpo.lora.r=-1"])


def test_lora_off_leaves_the_model_alone(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    assert lora.add_lora(model, LoraConfig(r=0), 0) is None
    assert all(p.requires_grad for p in model.parameters())
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_adapters_train_alone_and_merge_into_a_plain_checkpoint(tiny_llama, tmp_path):
    model = copy.deepcopy(tiny_llama)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert lora.linear_layer_names(model.base_model) == LLAMA_LINEAR  # the backbone's, not lm_head
    adapted = lora.add_lora(model, LoraConfig(r=4, alpha=8), 0)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {n.split(".")[-4] for n in trained} == set(LLAMA_LINEAR)  # ...q_proj.lora_A.default.weight
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    _adam_steps(model, lambda: model(ids).logits.logsumexp(-1).mean())
    _frozen_weights_unchanged(model.state_dict(), before)
    assert any(p.any() for n, p in model.named_parameters() if ".lora_B." in n)  # B starts at 0: it trained
    with torch.no_grad():
        expected = model(ids).logits
    assert not torch.allclose(expected, tiny_llama(ids).logits)
    lora.save_adapter(adapted, tmp_path / "adapter")
    merged = lora.merge_lora(adapted)
    assert merged is model and type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    merged.save_pretrained(tmp_path / "model")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)
        # the adapter on a fresh copy of the model it was trained from computes the same
        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(tiny_llama), tmp_path / "adapter")
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_a_scalar_models_head_trains_in_full_beside_the_adapters(smoke, tmp_path):
    model = reward_model_from_causal_lm(smoke / "sft", seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapted = lora.add_lora(model, LoraConfig(r=4), 0, trained_in_full=["head"])
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in trained if ".lora_" not in n} == {
        "head.modules_to_save.default.weight",
        "head.modules_to_save.default.bias",
    }
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    _adam_steps(model, lambda: model(ids)[:, -1].mean())
    _frozen_weights_unchanged(model.state_dict(), before)
    assert not torch.equal(model.head.modules_to_save["default"].weight, before["head.weight"])
    with torch.no_grad():
        expected = model(ids)
    merged = lora.finish(adapted, model, tmp_path / "adapter")
    merged.save_pretrained(tmp_path / "model")
    with torch.no_grad():
        torch.testing.assert_close(ScalarModel.from_pretrained(tmp_path / "model")(ids), expected, rtol=1e-5, atol=1e-5)
        base = reward_model_from_causal_lm(smoke / "sft", seed=7)  # another head: the adapter's replaces it
        reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
        torch.testing.assert_close(reloaded(ids), expected, rtol=1e-5, atol=1e-5)


def test_adapters_are_drawn_from_their_seed_without_touching_the_callers_random_stream(tiny_llama):
    def adapters(seed: int) -> dict:
        model = copy.deepcopy(tiny_llama)
        lora.add_lora(model, LoraConfig(r=4), seed)
        return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_A." in n}

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = adapters(1)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's stream goes on as without adapters
    torch.manual_seed(456)  # another process state: the same adapters
    again, other = adapters(1), adapters(2)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)


def test_unknown_target_modules_name_the_setting_and_the_layers(tiny_llama):
    with pytest.raises(ValueError, match=r"lora.target_modules \['qkv'\] name no linear layer .*'q_proj'"):
        lora.add_lora(copy.deepcopy(tiny_llama), LoraConfig(r=4, target_modules=["q_proj", "qkv"]), 0)


def test_adapters_off_is_the_model_they_adapt(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    adapted = lora.add_lora(model, LoraConfig(r=4), 0)
    ids = torch.randint(0, 40, (3, 8), generator=torch.Generator().manual_seed(1))
    _adam_steps(model, lambda: model(ids).logits.logsumexp(-1).mean())

    class Plain:  # a frozen model's DataParallel on one process: inference runs fn(model)
        def inference(self, fn, *args):
            return fn(model, *args)

    with torch.no_grad():
        off = lora.AdaptersDisabled(Plain(), adapted).inference(lambda m, x: m(x).logits, ids)
        assert torch.equal(off, tiny_llama(ids).logits)
        assert not torch.allclose(model(ids).logits, off)  # and on again after it


# ------------------------------------------------------------------ every trainer


class FinishSpy:
    """Wraps ``rlhf_core.train.lora.finish``: before the real one runs, records the adapted model's
    state and its outputs on ``ids``, so a test can compare them with what the stage saved."""

    def __init__(self, monkeypatch, ids: torch.Tensor):
        self.calls, self.ids, self.real = [], ids, lora.finish
        monkeypatch.setattr(lora, "finish", self)

    def __call__(self, adapted, model, adapter_dir):
        assert adapted is not None
        with torch.no_grad():
            out = model(self.ids)
        out = out.logits if hasattr(out, "logits") else out
        self.calls.append(
            {"state": {k: v.clone() for k, v in model.state_dict().items()}, "out": out, "dir": adapter_dir}
        )
        return self.real(adapted, model, adapter_dir)


IDS = torch.randint(3, 1000, (2, 10), generator=torch.Generator().manual_seed(2))
#: PPO on the smoke model, small: 4 episodes an update of 16 tokens, float32, a learning rate
#: that moves the adapters visibly in one update.
PPO_SMALL = [
    "ppo.batch_size=4",
    "ppo.micro_batch_size=4",
    "ppo.response_length=16",
    "ppo.bf16=false",
    "ppo.learning_rate=1e-2",
]


def _check_stage_output(call: dict, start: torch.nn.Module, saved: torch.nn.Module, adapter_base: torch.nn.Module):
    """Base weights unchanged, adapters trained, the saved merged model and the saved adapter on
    ``adapter_base`` both computing what the adapted model computed."""
    _frozen_weights_unchanged(call["state"], start.state_dict())
    assert any(t.any() for n, t in call["state"].items() if ".lora_B." in n)
    with torch.no_grad():
        got = saved(IDS)
        got = got.logits if hasattr(got, "logits") else got
        torch.testing.assert_close(got, call["out"], rtol=1e-4, atol=1e-5)
        out = peft.PeftModel.from_pretrained(adapter_base, call["dir"])(input_ids=IDS)
        out = out.logits if hasattr(out, "logits") else out
        torch.testing.assert_close(out, call["out"], rtol=1e-4, atol=1e-5)


def test_sft_with_adapters(smoke, tmp_path, monkeypatch):
    spy = FinishSpy(monkeypatch, IDS)
    cfg = load_config("smoke", ["sft.lora.r=8", "sft.max_steps=2", "sft.bf16=false", "sft.eval_max_samples=2"]).sft
    sft.run_sft(cfg, smoke / "data", smoke / "sft", tmp_path / "sft")
    (call,) = spy.calls
    assert call["dir"] == tmp_path / "sft" / "adapter"
    base = load_causal_lm(smoke / "sft")
    _check_stage_output(
        call, base, AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "model"), load_causal_lm(smoke / "sft")
    )


def test_reward_model_with_adapters(smoke, tmp_path, monkeypatch):
    spy = FinishSpy(monkeypatch, IDS)
    cfg = load_config("smoke", ["reward.lora.r=8", "reward.max_steps=2", "reward.bf16=false"]).reward
    reward.run_reward_training(cfg, smoke / "data", smoke / "sft", tmp_path / "rm")
    (call,) = spy.calls
    start = reward_model_from_causal_lm(smoke / "sft", seed=cfg.seed)
    assert not torch.equal(call["state"]["head.modules_to_save.default.weight"], start.head.weight)  # trained in full
    _check_stage_output(
        call, start, ScalarModel.from_pretrained(tmp_path / "rm" / "model"), reward_model_from_causal_lm(smoke / "sft")
    )


def test_dpo_with_adapters_against_the_policy_with_them_off(smoke, tmp_path, monkeypatch):
    spy = FinishSpy(monkeypatch, IDS)
    monkeypatch.setattr(dpo, "load_reference", None)  # no second copy of the SFT model is loaded
    cfg = load_config(
        "smoke", ["dpo.lora.r=8", "dpo.max_steps=2", "dpo.bf16=false", "dpo.batch_size=8", "dpo.learning_rate=1e-2"]
    ).dpo
    metrics = dpo.run_dpo(cfg, smoke / "data", smoke / "sft", tmp_path / "dpo")
    (call,) = spy.calls
    base = load_causal_lm(smoke / "sft")
    _check_stage_output(
        call, base, AutoModelForCausalLM.from_pretrained(tmp_path / "dpo" / "model"), load_causal_lm(smoke / "sft")
    )
    assert metrics["dpo/rewards/margin"] != 0.0  # the implicit reward moved: the reference did not follow


@pytest.mark.heavy
def test_ppo_with_adapters_saves_merged_policy_and_value_model(smoke, tmp_path, monkeypatch):
    spy = FinishSpy(monkeypatch, IDS)
    cfg = load_config("smoke", ["ppo.lora.r=8", "ppo.total_episodes=8", "ppo.eval_max_samples=2", *PPO_SMALL]).ppo
    ppo_trainer.run_ppo(cfg, smoke / "data", smoke / "sft", smoke / "rm", tmp_path / "ppo")
    policy_call, value_call = spy.calls
    assert value_call["dir"] == tmp_path / "ppo" / "value_adapter"
    _check_stage_output(
        policy_call,
        load_causal_lm(smoke / "sft"),
        load_causal_lm(tmp_path / "ppo" / "model"),
        load_causal_lm(smoke / "sft"),
    )
    _check_stage_output(
        value_call,
        ScalarModel.from_pretrained(smoke / "rm"),
        ScalarModel.from_pretrained(tmp_path / "ppo" / "value_model"),
        ScalarModel.from_pretrained(smoke / "rm"),
    )


def test_ppo_reference_is_the_policy_with_adapters_off(smoke):
    """With ``ppo.lora.r``, no reference copy is loaded: after an update has moved the adapters,
    the rollout's reference log-probabilities equal those of a separate frozen SFT model, and
    the policy's differ from them."""
    ppo_cfg = load_config("smoke", ["ppo.lora.r=8", "ppo.ppo_epochs=1", *PPO_SMALL]).ppo
    trainer = PPOTrainer(ppo_cfg, smoke / "data", smoke / "sft", smoke / "rm")
    assert trainer.ref_policy is None
    trained = {n for n, p in trainer.models.named_parameters() if p.requires_grad}
    assert all(".lora_" in n or ".modules_to_save." in n for n in trained)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in trainer.models.parameters() if p.requires_grad
    }
    queries = trainer.queries[: ppo_cfg.batch_size]
    traj = trainer.generate_trajectory(queries)
    stats = trainer.optimise(estimate_advantages(kl_penalised_rewards(traj, ppo_cfg), ppo_cfg), update=0)
    assert abs(stats.ratio_mean - 1.0) < 1e-5 and stats.ratio_var < 1e-9  # the first minibatch: the policy that sampled
    traj = trainer.generate_trajectory(queries)
    frozen = load_causal_lm(smoke / "sft").eval()
    with torch.no_grad():
        logits = response_logits(frozen, traj.query_responses, trainer.pad_id, traj.context_length)
    expected = logprobs_from_logits(logits, traj.responses, ppo_cfg.temperature, trainer.pad_id)
    mask = traj.token_mask
    torch.testing.assert_close(traj.ref_logprobs[mask], expected[mask], rtol=0, atol=1e-6)
    assert (traj.logprobs[mask] - traj.ref_logprobs[mask]).abs().max() > 1e-3


def test_a_checkpoint_holds_what_trains_and_resumes_it(tiny_llama, tmp_path):
    """With adapters a mid-stage checkpoint holds the adapters, not the frozen weights; loading it
    into a freshly adapted copy restores the trained model exactly."""
    from transformers import get_scheduler

    from rlhf_core.train.training import CheckpointManager, TrainingError, adamw

    def build(**settings):
        model = copy.deepcopy(tiny_llama)
        lora.add_lora(model, LoraConfig(**{"r": 4, **settings}), 0)
        optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-8)
        return model, optimizer, get_scheduler("constant", optimizer)

    model, optimizer, scheduler = build()
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(3))
    loss = model(ids).logits.logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    manager = CheckpointManager(tmp_path / "checkpoints", "digest")
    path = manager.save(1, model, optimizer, scheduler)
    state = torch.load(path / "state.pt", weights_only=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(state["model"]) == trained  # the adapters only
    fresh, fresh_optimizer, fresh_scheduler = build()
    assert manager.load_latest(fresh, fresh_optimizer, fresh_scheduler)["step"] == 1
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    # adapters on other layers: the checkpoint's are not this model's
    with pytest.raises(TrainingError, match="does not hold this model's trained parameters"):
        manager.load_latest(*build(target_modules=["q_proj"]))
