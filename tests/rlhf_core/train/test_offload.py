"""Detail 8's offload of the frozen models (rlhf_core.train.offload): between forward passes their
parameters are their CPU tensors, during one the tensors outside the transformer blocks and one
block at a time are copies on the device (a real copy on the CPU too, so both are checked
here), and every result equals the run without offloading."""

import pytest
import torch
from transformers import LlamaForCausalLM

from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError
from rlhf_core.models.saved import disable_dropout
from rlhf_core.ppo.trainer import PPOTrainer
from rlhf_core.train import dpo
from rlhf_core.train.distributed import DataParallel
from rlhf_core.train.offload import CPUOffload, transformer_blocks
from tests.conftest import tiny_llama_config
from tests.stages import link_stages

IDS = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(3))

PPO_SMALL = [
    "ppo.batch_size=4",
    "ppo.micro_batch_size=2",
    "ppo.response_length=12",
    "ppo.bf16=false",
    "ppo.eval_max_samples=3",
]


@pytest.fixture(scope="module")
def smoke(smoke_stages, tmp_path_factory):
    """Data, a base model standing in for SFT, and a reward model made from it."""
    return link_stages(smoke_stages, tmp_path_factory.mktemp("offload"), data="data", sft="base", rm="rm")


@pytest.fixture
def tied_llama():
    """Makes fresh frozen models of ``tiny_llama``'s shape (:func:`tiny_llama_config`) with tied
    input and output embeddings (the offload moves a model's tensors and hooks its blocks, so each
    test builds its own)."""

    def make() -> LlamaForCausalLM:
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
        return disable_dropout(model).eval().requires_grad_(False)

    return make


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]


def _on_host(offload: CPUOffload, module: torch.nn.Module | None = None) -> bool:
    """Every parameter and buffer of ``module`` (default: the model) is its CPU tensor (same storage)."""
    return all(
        t.device.type == "cpu" and t.data_ptr() == offload.host[t].data_ptr()
        for t in _tensors(offload.model if module is None else module)
    )


def _copied(offload: CPUOffload, tensors: list[torch.Tensor]) -> bool:
    """Every one of ``tensors`` is a copy of its CPU tensor on the offload's device."""
    return all(
        t.device == offload.device
        and t.data_ptr() != offload.host[t].data_ptr()
        and torch.equal(t.cpu(), offload.host[t])
        for t in tensors
    )


class PlacementSpy:
    """At every forward pass of a transformer block of ``offload.model``, records whether the
    block and the tensors outside the blocks were copies on the device and every other block on
    its CPU tensors: one block at a time (``streamed``), or all of them (``whole``)."""

    def __init__(self, offload: CPUOffload):
        self.offload, self.seen = offload, []
        blocks = transformer_blocks(offload.model)
        assert blocks
        in_blocks = {id(t) for b in blocks for t in _tensors(b)}
        resident = [t for t in _tensors(offload.model) if id(t) not in in_blocks]
        for block in blocks:
            others = [b for b in blocks if b is not block]

            def look(_module, _args, block=block, others=others):
                if not _copied(offload, resident + _tensors(block)):
                    self.seen.append("not on the device")
                elif all(_on_host(offload, b) for b in others):
                    self.seen.append("streamed")
                elif all(_copied(offload, _tensors(b)) for b in others):
                    self.seen.append("whole")
                else:
                    self.seen.append("mixed")

            block.register_forward_pre_hook(look)


def test_a_frozen_model_lives_on_its_cpu_tensors_and_streams_its_blocks(tied_llama):
    """Between uses the model is its CPU tensors; in a pass, the tensors outside the blocks are
    copies on the device and one block at a time joins them; a ``gathered`` block holds every
    block's copy through several passes; the outputs are the unoffloaded model's."""
    model = tied_llama()
    expected = model(IDS).logits
    offload = CPUOffload(model, "cpu")
    spy = PlacementSpy(offload)
    assert _on_host(offload)
    logits = offload.inference(lambda m, ids: m(ids).logits, IDS)
    assert spy.seen == ["streamed", "streamed"]  # two blocks, one after the other
    assert _on_host(offload)  # back on the CPU tensors after the pass
    assert torch.equal(logits, expected)
    # tied input and output embeddings stay one tensor, on the CPU and in the copy
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with offload.gathered():  # several passes on one copy
        assert _copied(offload, _tensors(model))
        pointers = {model.lm_head.weight.data_ptr(), model.model.layers[1].mlp.up_proj.weight.data_ptr()}
        for _ in range(2):
            assert torch.equal(offload.inference(lambda m, ids: m(ids).logits, IDS), expected)
            assert _copied(offload, _tensors(model))
        assert pointers == {model.lm_head.weight.data_ptr(), model.model.layers[1].mlp.up_proj.weight.data_ptr()}
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert spy.seen == ["streamed"] * 2 + ["whole"] * 4 and _on_host(offload)


def test_an_error_inside_a_pass_leaves_the_model_on_the_cpu(tied_llama):
    model = tied_llama()
    offload = CPUOffload(model, "cpu")
    model.model.layers[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):  # inside the second block's pass
        offload.inference(lambda m, ids: m(ids), IDS)
    assert _on_host(offload)
    with pytest.raises(RuntimeError, match="out of memory"), offload.gathered():
        model(IDS)
    assert _on_host(offload)


@pytest.mark.parametrize("whole", [False, True], ids=["inference", "gathered"])
def test_an_error_while_copying_to_the_device_leaves_no_copy_behind(tied_llama, monkeypatch, whole):
    """Out of device memory part way through the copies of a use (the tensors outside the
    blocks, or ``gathered``'s every block): every tensor is its CPU copy again, and the next
    use works."""
    model = tied_llama()
    offload = CPUOffload(model, "cpu")
    copy, calls = offload._copy, []

    def failing_copy(tensors):
        calls.append(len(tensors))
        copy(tensors[: len(tensors) // 2])  # half copied, then the device is full
        if len(calls) == (2 if whole else 1):
            raise torch.OutOfMemoryError("out of memory while copying")
        copy(tensors)

    monkeypatch.setattr(offload, "_copy", failing_copy)
    with pytest.raises(torch.OutOfMemoryError):
        if whole:
            with offload.gathered():
                pass
        else:
            offload.inference(lambda m, ids: m(ids), IDS)
    assert _on_host(offload) and offload._uses == 0 and not offload._whole
    monkeypatch.undo()
    assert torch.equal(offload.inference(lambda m, ids: m(ids).logits, IDS), tied_llama()(IDS).logits)


def test_only_a_frozen_model_is_offloaded(tied_llama):
    model = tied_llama().requires_grad_(True)
    with pytest.raises(ValueError, match="only a frozen model.*LlamaForCausalLM"):
        CPUOffload(model, "cpu")
    with pytest.raises(ValueError, match="offload needs a frozen model and a device"):
        DataParallel(model, "ddp", offload=True, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="offload needs a frozen model and a device"):
        DataParallel(tied_llama(), "ddp", offload=True)


def test_data_parallel_of_a_frozen_model_runs_it_offloaded(tied_llama):
    model = tied_llama()
    expected = model(IDS).logits
    parallel = DataParallel(model, "ddp", offload=True, device=torch.device("cpu"))
    spy = PlacementSpy(parallel._offload)
    assert torch.equal(parallel.inference(lambda m, ids: m(ids).logits, IDS), expected)
    with parallel.gathered():
        assert _copied(parallel._offload, _tensors(model))  # on the device for the whole block
        parallel.inference(lambda m, ids: m(ids), IDS)
    assert spy.seen == ["streamed"] * 2 + ["whole"] * 2 and _on_host(parallel._offload)


def test_config_offload_needs_a_frozen_copy():
    assert load_config("smoke", ["ppo.offload_frozen=true", "ppo.lora.r=8"]).ppo.offload_frozen  # the reward model
    with pytest.raises(ConfigError, match="ppo.offload_frozen has nothing to offload"):
        load_config(
            "smoke",
            ["ppo.offload_frozen=true", "ppo.lora.r=8", "ppo.reward=python:rlhf_core.train.rule_rewards:word_count_12"],
        )
    with pytest.raises(ConfigError, match="dpo.offload_reference needs a reference copy"):
        load_config("smoke", ["dpo.offload_reference=true", "dpo.lora.r=8"])


def test_ppo_with_offloaded_frozen_models_rolls_out_and_evaluates_as_without(smoke):
    """``ppo.offload_frozen``: the reference and reward models run on copies and are back on their
    CPU tensors after a rollout; the trajectory (log-probs, reference log-probs, values, scores)
    and the evaluation against the SFT policy equal those of the run without offloading."""
    results = {}
    for offload in (False, True):
        cfg = load_config("smoke", [*PPO_SMALL, f"ppo.offload_frozen={str(offload).lower()}"]).ppo
        trainer = PPOTrainer(cfg, smoke / "data", smoke / "sft", smoke / "rm")
        spies = [PlacementSpy(p._offload) for p in (trainer.ref_parallel, trainer.reward_parallel) if offload]
        traj = trainer.generate_trajectory(trainer.queries[: cfg.batch_size])
        metrics, _ = trainer.evaluate(against_sft=True)
        results[offload] = (traj, metrics)
        if offload:
            for spy in spies:
                assert _on_host(spy.offload)
            # smoke models have 2 blocks. The reference: the rollout's 2 micro-batches, streamed;
            # the SFT policy's evaluation summaries, generated with every block on the device.
            ref, rm = spies[0].seen, spies[1].seen
            assert ref[:4] == ["streamed"] * 4 and len(ref) > 4 and set(ref[4:]) == {"whole"}
            # the reward model: the rollout's 2 micro-batches, streamed, then the evaluation's
            # scores of 3 prompts' policy, reference and SFT summaries, 2 micro-batches each, whole
            assert rm == ["streamed"] * 2 * 2 + ["whole"] * 3 * 2 * 2
        else:
            assert trainer.ref_parallel._offload is None and trainer.reward_parallel._offload is None
    (want, want_metrics), (have, have_metrics) = results[False], results[True]
    for name in ("responses", "logprobs", "ref_logprobs", "values", "scores"):
        assert torch.equal(getattr(have, name), getattr(want, name)), name
    assert have_metrics == want_metrics
    assert "eval/score_gain_vs_sft" in have_metrics


def test_dpo_with_an_offloaded_reference_trains_as_without(smoke, tmp_path, monkeypatch):
    """``dpo.offload_reference``: the reference is loaded on the CPU, runs on a copy for each
    micro-batch, and the steps' metrics equal those of the run without offloading."""
    made = []

    class Recording(CPUOffload):
        def __init__(self, model, device):
            super().__init__(model, device)
            made.append(PlacementSpy(self))

    monkeypatch.setattr(dpo, "CPUOffload", Recording)
    base = ["dpo.max_steps=2", "dpo.bf16=false", "dpo.batch_size=8", "dpo.micro_batch_size=4"]
    metrics = {}
    for offload in (False, True):
        cfg = load_config("smoke", [*base, f"dpo.offload_reference={str(offload).lower()}"]).dpo
        metrics[offload] = dpo.run_dpo(cfg, smoke / "data", smoke / "sft", tmp_path / str(offload))
    (spy,) = made
    # 2 steps x 2 micro-batches x 2 passes (the shared query, then chosen and rejected side by
    # side: rlhf_core.train.forward.pair_forward) x 2 blocks, streamed
    assert spy.seen == ["streamed"] * 16
    assert _on_host(spy.offload)
    for key in ("dpo/loss", "dpo/accuracy", "dpo/rewards/chosen", "dpo/rewards/rejected", "dpo/rewards/margin"):
        assert metrics[True][key] == metrics[False][key], key
    assert metrics[False]["dpo/rewards/margin"] != 0.0
