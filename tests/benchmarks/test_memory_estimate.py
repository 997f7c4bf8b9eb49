"""The memory estimate's accounting (benchmarks/memory_estimate.py): exact parameter counts of
the three Pythia sizes and the per-rank bytes of each strategy."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_estimate.py"
spec = importlib.util.spec_from_file_location("memory_estimate", SCRIPT)
memory_estimate = importlib.util.module_from_spec(spec)
sys.modules["memory_estimate"] = memory_estimate  # its dataclass looks itself up there
spec.loader.exec_module(memory_estimate)


@pytest.mark.parametrize(
    "name, published", [("pythia-1b", 1_011_781_632), ("pythia-2.8b", 2_775_208_960), ("pythia-6.9b", 6_857_302_016)]
)
def test_parameter_counts_are_pythias_published_ones(name, published):
    assert memory_estimate.pythia(name).params == published


def test_per_rank_bytes_of_weights_gradients_and_adam_under_each_strategy():
    m = memory_estimate.Model(params=8_000, layer_params=100, layers=4, hidden=8)
    assert memory_estimate.trained(m, "ddp", 8) == 16 * 8_000
    assert memory_estimate.trained(m, "zero2", 8) == 4 * 8_000 + 12 * 1_000
    assert memory_estimate.trained(m, "fsdp", 8) == 16 * 1_000 + 800
    assert [memory_estimate.frozen(m, p, 8) for p in ("whole", "sharded", "cpu")] == [32_000, 4_000 + 800, 0]
    # PPO holds two trained models (policy, value) and two frozen ones (reference, reward model),
    # and peaks in the update (activations) or in sampling (KV cache, no gradients)
    acts, kv = memory_estimate.activations(m, 2, 565), 2 * 4 * 2 * 565 * 8 * 2
    ppo = memory_estimate.stage_bytes("ppo", m, 2, "ddp", "whole", 8)
    assert ppo == 2 * 16 * 8_000 + 2 * 32_000 + max(acts, kv - 2 * 4 * 8_000)
    # under FSDP2 the policy is gathered whole to sample: the other 7/8 of its weights
    sharded = memory_estimate.stage_bytes("ppo", m, 2, "fsdp", "sharded", 8)
    trained, frozen = 16 * 1_000 + 800, 4_000 + 800
    assert sharded == pytest.approx(2 * trained + 2 * frozen + max(acts, kv + 4 * 7_000 - 2 * 4 * 1_000))
    # rloo and grpo train no value model: one trained model, its gradients alone freed while sampling
    critic_free = memory_estimate.stage_bytes("ppo", m, 2, "ddp", "whole", 8, value_model=False)
    assert critic_free == 16 * 8_000 + 2 * 32_000 + max(acts, kv - 4 * 8_000)
    assert ppo - critic_free == 16 * 8_000  # when the activations decide the peak


def test_llama_3_2_1b_and_its_adapter_parameters_are_counted_exactly():
    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    assert memory_estimate.llama_3_2_1b().params == 1_235_814_400  # the published count
    # r x (in + out) per adapted linear layer equals what peft builds (a 2-layer model of that shape)
    cfg = LlamaConfig(**{**memory_estimate.LLAMA_3_2_1B, "num_hidden_layers": 2, "vocab_size": 64})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    m = memory_estimate._counts(model, model.model.layers[0], cfg)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == 8 * m.linear_in_out


def test_lora_presets_hold_no_reference_copy_and_no_optimiser_state_for_frozen_weights():
    m = memory_estimate.Model(params=8_000, layer_params=100, layers=4, hidden=8, linear_in_out=50)
    assert memory_estimate.adapted(m, 4) == 4 * 8_000 + 16 * 4 * 50
    acts = memory_estimate.activations(m, 2, 638)
    assert memory_estimate.lora_stage_bytes("dpo", m, 1, 4, "-") == memory_estimate.adapted(m, 4) + acts
    # PPO: policy and value model adapted, the reward model whole or on the CPU, no reference
    acts = memory_estimate.activations(m, 2, 565)
    kv = 2 * 4 * 2 * 565 * 8 * 2
    for placement, frozen in (("whole", 32_000), ("cpu", 0)):
        expected = 2 * memory_estimate.adapted(m, 4) + frozen + max(acts, kv - 2 * 4 * 4 * 50)
        assert memory_estimate.lora_stage_bytes("ppo", m, 2, 4, placement) == expected
        without_value = memory_estimate.adapted(m, 4) + frozen + max(acts, kv - 4 * 4 * 50)
        assert memory_estimate.lora_stage_bytes("ppo", m, 2, 4, placement, value_model=False) == without_value


def test_every_stage_of_the_one_gpu_presets_fits_by_the_estimate():
    rows = memory_estimate.lora_rows()
    assert {r["preset"] for r in rows} == {"pythia-6.9b-1gpu", "llama-3.2-1b-lora"}
    assert {(r["stage"], r["estimator"]) for r in rows} == set(memory_estimate.STAGES)
    assert all(r["fits"] for r in rows), [r for r in rows if not r["fits"]]


def test_an_offloaded_frozen_model_holds_its_blocks_one_at_a_time_during_a_pass():
    """``ppo.offload_frozen``, ``dpo.offload_reference`` (rlhf_core.train.offload.CPUOffload): nothing
    of the frozen model on the GPU between passes; during one, its weights outside the blocks
    and one block."""
    m = memory_estimate.Model(params=8_000, layer_params=1_000, layers=4, hidden=8)
    assert memory_estimate.streamed(m) == 4 * (8_000 - 4 * 1_000) + 4 * 1_000
    # a model whose pass outweighs a micro-batch's activations
    big = memory_estimate.Model(params=10**9, layer_params=10**8, layers=8, hidden=8, linear_in_out=50)
    pass_bytes = 4 * (10**9 - 8 * 10**8) + 4 * 10**8
    dpo_acts = memory_estimate.activations(big, 2, 638)
    assert pass_bytes > dpo_acts
    # DPO: the reference's pass precedes the policy's forward in each micro-batch
    trained = memory_estimate.trained(big, "ddp", 1)
    assert memory_estimate.stage_bytes("dpo", big, 1, "ddp", "cpu", 1) == trained + pass_bytes
    assert memory_estimate.stage_bytes("dpo", big, 1, "ddp", "whole", 1) == trained + 4 * 10**9 + dpo_acts
    # PPO with adapters: the reward model's pass, with the adapters' gradients freed
    grads = 2 * 4 * 4 * 50
    assert memory_estimate.lora_stage_bytes("ppo", big, 1, 4, "cpu") == 2 * memory_estimate.adapted(big, 4) + (
        pass_bytes - grads
    )
