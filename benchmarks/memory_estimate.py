"""Which data-parallel strategy fits each Pythia size on 8 x 80 GB and on 1 x 141 GB, and the
LoRA presets on their single GPU: a written estimate of GPU memory per rank for every training
stage (no GPU needed).

Usage::

    .venv/bin/python benchmarks/memory_estimate.py [--out benchmarks/results/memory_estimate.json]

Parameter counts are exact: each model is built on PyTorch's ``meta`` device from Pythia's
published configuration (no weights, no download). Per rank, in bytes, with ``P`` parameters,
``N`` ranks, ``L`` layers, hidden size ``h``, micro-batch ``b`` rows of ``s`` tokens:

- a trained model under bf16 autocast keeps float32 weights (4P), gradients (4P) and AdamW's
  two moments (8P): 16P under DDP; 4P + 12P/N under ZeRO-2 (gradients and optimiser state
  sharded); 16P/N under FSDP2 full sharding (plus one gathered layer at a time, counted);
- a frozen model (the reference policy; PPO's reward model) keeps float32 weights: 4P, or 4P/N
  sharded, or nothing on the GPU between its forward passes when offloaded to CPU (the paper's
  6.9B PPO, Detail 8; ``ppo.offload_frozen``, ``dpo.offload_reference``). During a pass an
  offloaded whole model (``rlhf_core.train.offload.CPUOffload``) has its weights outside the
  transformer blocks (embeddings, head) and one block on the GPU; a sharded one (FSDP2's
  ``CPUOffloadPolicy``) one gathered block, counted with the trained model's;
- activations with every decoder layer recomputed (activation checkpointing): each layer's
  float32 input kept, ``4 L b s h``, plus one layer's activations while it is recomputed,
  ``34 b s h`` (Korthikanti et al. 2022, arXiv:2205.05198, eq. 1, without the attention-score
  term that a fused attention kernel does not store); the language-model head runs in chunks;
- a model trained through rank-``r`` low-rank adapters (``rlhf_core.train.lora``; the presets
  ``pythia-6.9b-1gpu`` and ``llama-3.2-1b-lora``, one GPU) keeps its float32 weights frozen (4P)
  and 16 bytes per adapter parameter, ``r`` times the sum of in + out features over the
  backbone's linear layers; the reference policy is the policy with its adapters off (no copy);
- PPO peaks in one of two phases. The update holds both trained models whole (weights,
  gradients, AdamW state, as above), the frozen ones and one micro-batch's activations. A
  critic-free estimator (``ppo.advantage_estimator`` rloo or grpo) has no value model: one
  trained model. ``batch_size`` counts episodes, so its micro-batches are the same size.
  Sampling holds no gradients (they are freed after each optimiser step) but the key/value
  cache, ``2 L b s h x 2`` bytes (bf16), and under FSDP2 the policy gathered whole
  (``rlhf_core.train.distributed.DataParallel.gathered``): its other shards, ``4P (1 - 1/N)``.

Sequence lengths are the paper's: SFT and PPO 565 tokens (query 512 + response 53), the
reward model and DPO 638 per row, two rows (chosen, rejected) per pair. Micro-batches, batch
sizes and strategies are the presets'. A strategy "fits" when the estimate is at most 90% of
the GPU's memory (CUDA context, allocator fragmentation and communication buffers take the
rest). This is arithmetic, not a measurement: it ranks the options, and a run decides.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

#: Pythia's published configurations (EleutherAI/pythia-*-deduped config.json).
PYTHIA = {
    "pythia-1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192, vocab_size=50304
    ),
    "pythia-2.8b": dict(
        hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, intermediate_size=10240, vocab_size=50304
    ),
    "pythia-6.9b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=16384, vocab_size=50432
    ),
}
#: Tokens per row (Huang et al. 2024, Details 4 and 14).
SEQ = {"sft": 565, "reward": 638, "dpo": 638, "ppo": 565}
GB = 1e9
#: PPO's advantage estimators without a value model (ppo.advantage_estimator).
CRITIC_FREE = "rloo/grpo"
#: The stages estimated, PPO once with GAE's value model and once without.
STAGES = [("sft", "-"), ("reward", "-"), ("dpo", "-"), ("ppo", "gae"), ("ppo", CRITIC_FREE)]


#: Llama-3.2-1B's published configuration (meta-llama/Llama-3.2-1B config.json).
LLAMA_3_2_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
)
#: The LoRA presets, their model and the single GPUs they are meant for.
LORA_PRESETS = {"pythia-6.9b-1gpu": ("pythia-6.9b", [141]), "llama-3.2-1b-lora": ("llama-3.2-1b", [24, 40])}


@dataclass
class Model:
    params: int
    layer_params: int
    layers: int
    hidden: int
    #: The sum of in_features + out_features over the backbone's linear layers: rank-r adapters on
    #: all of them have r times this many parameters (A: r x in, B: out x r).
    linear_in_out: int = 0


def pythia(name: str) -> Model:
    """The exact parameter counts of a Pythia model (``GPTNeoXForCausalLM`` on the meta device)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(**PYTHIA[name], rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(cfg)
    return _counts(model, model.gpt_neox.layers[0], cfg)


def llama_3_2_1b() -> Model:
    """The exact parameter counts of Llama-3.2-1B (``LlamaForCausalLM`` on the meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**LLAMA_3_2_1B)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return _counts(model, model.model.layers[0], cfg)


def _counts(model, layer, cfg) -> Model:
    from torch import nn

    linear = sum(m.in_features + m.out_features for m in model.base_model.modules() if isinstance(m, nn.Linear))
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    layer_params = sum(p.numel() for p in layer.parameters())
    return Model(params, layer_params, cfg.num_hidden_layers, cfg.hidden_size, linear)


def trained(m: Model, strategy: str, n: int) -> float:
    """Bytes per rank of a trained model's weights, gradients and AdamW state."""
    if strategy == "ddp":
        return 16 * m.params
    if strategy == "zero2":
        return 4 * m.params + 12 * m.params / n
    return 16 * m.params / n + 2 * 4 * m.layer_params  # fsdp: shards + a gathered layer (and its prefetch)


def adapted(m: Model, r: int) -> float:
    """Bytes of a model trained through rank-``r`` adapters (``rlhf_core.train.lora``) on one GPU: its
    frozen float32 weights (4P) and the adapters' float32 weights, gradients and AdamW moments
    (16 bytes each); a scalar head trained in full is negligible."""
    return 4 * m.params + 16 * r * m.linear_in_out


def frozen(m: Model, placement: str, n: int) -> float:
    """Bytes per rank of a frozen float32 model: ``whole``, ``sharded`` or ``cpu`` (offloaded)."""
    return {"whole": 4 * m.params, "sharded": 4 * m.params / n + 2 * 4 * m.layer_params, "cpu": 0.0}[placement]


def streamed(m: Model) -> float:
    """Bytes on the GPU while an offloaded whole frozen model runs a forward pass
    (``rlhf_core.train.offload.CPUOffload``): its float32 weights outside the transformer blocks and
    one block's. That pass's own activations (one micro-batch's hidden states, without
    gradients) are small beside a training micro-batch's and not counted."""
    return 4 * (m.params - m.layers * m.layer_params) + 4 * m.layer_params


def activations(m: Model, rows: int, seq: int) -> float:
    """Bytes of activations of ``rows`` sequences of ``seq`` tokens with every layer recomputed."""
    return 4 * m.layers * rows * seq * m.hidden + 34 * rows * seq * m.hidden


def stage_bytes(
    stage: str, m: Model, micro: int, strategy: str, frozen_placement: str, n: int, value_model: bool = True
) -> float:
    """Bytes per rank of one stage: its trained and frozen models and one micro-batch's activations
    (PPO's value model trained beside the policy unless ``value_model`` is false: rloo, grpo)."""
    seq = SEQ[stage]
    if stage == "sft":
        return trained(m, strategy, n) + activations(m, micro, seq)
    if stage == "reward":
        return trained(m, strategy, n) + activations(m, 2 * micro, seq)
    if stage == "dpo":  # the policy trains, the reference is frozen (whole on each rank, or offloaded)
        if frozen_placement == "cpu":  # the reference's pass precedes the policy's in each micro-batch
            return trained(m, strategy, n) + max(activations(m, 2 * micro, seq), streamed(m))
        return trained(m, strategy, n) + frozen(m, frozen_placement, n) + activations(m, 2 * micro, seq)
    # ppo: policy and value model train, reference and reward model frozen; the larger of the update
    # (activations) and sampling (no gradients; KV cache; under FSDP2 the policy's other shards gathered)
    trained_models = 2 if value_model else 1
    models = trained_models * trained(m, strategy, n) + 2 * frozen(m, frozen_placement, n)
    gradients = trained_models * 4 * m.params / (1 if strategy == "ddp" else n)
    kv_cache = 2 * m.layers * micro * seq * m.hidden * 2
    gathered = 4 * m.params * (1 - 1 / n) if strategy == "fsdp" else 0.0
    return models + max(activations(m, micro, seq), kv_cache + gathered - gradients)


def lora_stage_bytes(
    stage: str, m: Model, micro: int, r: int, reward_placement: str, value_model: bool = True
) -> float:
    """Bytes of one stage on one GPU with rank-``r`` adapters on every trained model: no
    reference copy (the policy with its adapters off), PPO's reward model ``whole`` or on the
    ``cpu`` (``ppo.offload_frozen``: streamed to the GPU block by block for its passes), PPO's
    value model unless ``value_model`` is false; activations as without adapters (the backward
    pass still runs through every layer)."""
    seq = SEQ[stage]
    if stage == "sft":
        return adapted(m, r) + activations(m, micro, seq)
    if stage in ("reward", "dpo"):
        return adapted(m, r) + activations(m, 2 * micro, seq)
    trained_models = 2 if value_model else 1
    models = trained_models * adapted(m, r) + frozen(m, reward_placement, 1)
    gradients = trained_models * 4 * r * m.linear_in_out
    kv_cache = 2 * m.layers * micro * seq * m.hidden * 2
    scoring = streamed(m) - gradients if reward_placement == "cpu" else 0.0  # the reward model's pass
    return models + max(activations(m, micro, seq), kv_cache - gradients, scoring)


def lora_rows() -> list[dict]:
    """The LoRA presets' stages on the single GPUs they are meant for (:data:`LORA_PRESETS`)."""
    from rlhf_core.config.presets import load_config

    rows = []
    for preset, (model_name, capacities) in LORA_PRESETS.items():
        cfg = load_config(preset)
        m = pythia(model_name) if model_name in PYTHIA else llama_3_2_1b()
        for stage, estimator in STAGES:
            section = getattr(cfg, stage)
            for capacity in capacities:
                for placement in ("whole", "cpu") if stage == "ppo" else ("-",):
                    estimate = lora_stage_bytes(
                        stage, m, section.micro_batch_size, section.lora.r, placement, estimator != CRITIC_FREE
                    )
                    rows.append(
                        {
                            "preset": preset,
                            "parameters": m.params,
                            "adapter parameters": section.lora.r * m.linear_in_out,
                            "stage": stage,
                            "estimator": estimator,
                            "machine": f"1 x {capacity} GB",
                            "strategy": f"lora r={section.lora.r}",
                            "frozen models": "reward model " + placement if stage == "ppo" else "-",
                            "micro_batch_size": section.micro_batch_size,
                            "GB per GPU": round(estimate / GB, 1),
                            "fits": estimate <= 0.9 * capacity * GB,
                        }
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/memory_estimate.json")
    args = parser.parse_args()

    from rlhf_core.config.presets import load_config

    machines = {"8 x 80 GB": (8, 80), "1 x 141 GB": (1, 141)}
    rows = []
    for preset in PYTHIA:
        cfg = load_config(preset)
        m = pythia(preset)
        for stage, estimator in STAGES:
            section = getattr(cfg, stage)
            preset_strategy = getattr(section, "strategy", "ddp")
            options = [("ddp", "whole"), ("zero2", "whole"), ("fsdp", "whole"), ("fsdp", "sharded"), ("fsdp", "cpu")]
            if stage in ("sft", "reward"):
                options = options[:3]
            for machine, (n, capacity) in machines.items():
                micro = section.micro_batch_size
                for strategy, placement in options:
                    if n == 1 and strategy != "ddp" or n == 1 and placement == "sharded":
                        continue  # one rank: nothing to shard
                    estimate = stage_bytes(stage, m, micro, strategy, placement, n, estimator != CRITIC_FREE)
                    rows.append(
                        {
                            "preset": preset,
                            "parameters": m.params,
                            "stage": stage,
                            "estimator": estimator,
                            "machine": machine,
                            "strategy": strategy,
                            "frozen models": placement if stage in ("dpo", "ppo") else "-",
                            "micro_batch_size": micro,
                            "preset strategy": preset_strategy,
                            "GB per GPU": round(estimate / GB, 1),
                            "fits": estimate <= 0.9 * capacity * GB,
                        }
                    )
    rows += lora_rows()
    width = max(len(r["preset"]) for r in rows)
    print(
        f"{'preset':<{width}}  {'params':>13}  stage   estimator  machine      strategy  frozen   micro  GB/GPU  fits"
    )
    for r in rows:
        print(
            f"{r['preset']:<{width}}  {r['parameters']:>13,}  {r['stage']:<6}  {r['estimator']:<9}  {r['machine']:<11}  "
            f"{r['strategy']:<8}  "
            f"{r['frozen models']:<7}  {r['micro_batch_size']:>5}  {r['GB per GPU']:>6.1f}  {'yes' if r['fits'] else 'no'}"
        )
    Path(args.out).write_text(json.dumps({"what": __doc__.splitlines()[0], "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
