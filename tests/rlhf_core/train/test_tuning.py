"""CUDA's speed choices run on the CPU (the ``cuda_tuning`` fixture): SFT, the reward model and
DPO train to the same losses and weights with them as with the CPU's. On the CPU they are
off, so without this no test here could fail for them."""

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.common.tracking import JsonlTracker, read_metrics
from rlhf_core.config.presets import load_config
from rlhf_core.train import training
from rlhf_core.train.dpo import run_dpo
from rlhf_core.train.reward import run_reward_training
from rlhf_core.train.sft import run_sft
from rlhf_core.train.training import CUDA_TUNING, DEFAULT_TUNING, device_tuning
from tests.stages import link_stages

STAGES = {
    "sft": (run_sft, "base"),
    "reward": (run_reward_training, "base"),
    "dpo": (run_dpo, "base"),
}


def test_the_tuning_values_are_pinned():
    """What was measured (docs/results/speed.md) is what runs: change them there too."""
    assert CUDA_TUNING == training.DeviceTuning(
        fused_adamw=True, head_chunk_bytes=256 * 2**20, width_multiple=64, group_lengths=True
    )
    assert DEFAULT_TUNING == training.DeviceTuning(fused_adamw=False, head_chunk_bytes=32 * 2**20, width_multiple=1)
    assert device_tuning("cuda:1") is CUDA_TUNING and device_tuning("cpu") is DEFAULT_TUNING


@pytest.fixture(scope="module")
def stages(smoke_stages, tmp_path_factory):
    return load_config("smoke"), link_stages(smoke_stages, tmp_path_factory.mktemp("tuning"), data="data", base="base")


def _train(stage: str, stages, out, monkeypatch) -> tuple[list[float], dict[str, torch.Tensor], list[bool]]:
    """Two steps of ``stage`` from the smoke model: each step's loss, the weights, and for each
    micro-batch order taken whether it differs from the drawn order."""
    cfg, root = stages
    # float32, whatever the machine: the tolerances below are float32's rounding of reordered sums
    # (bf16 autocast rounds each product's output, where one float32 ulp can flip a bf16 one).
    section = getattr(cfg, stage).model_copy(
        update={"max_steps": 2, "batch_size": 8, "micro_batch_size": 2, "eval_max_samples": 2, "bf16": False}
    )
    grouped, order = [], training.row_order

    def spy(lengths, device, group=None):
        taken = order(lengths, device, group)
        grouped.append(taken != list(range(len(lengths))))
        return taken

    monkeypatch.setattr("rlhf_core.train.trainer.row_order", spy)
    run, model_dir = STAGES[stage]
    if stage == "dpo":  # DPO also evaluates: keep it short
        section = section.model_copy(update={"eval_max_samples": 2})
    run(section, root / "data", root / model_dir, out, tracker=JsonlTracker(out.with_suffix(".jsonl")))
    name = "dpo/loss" if stage == "dpo" else "train/loss"
    losses = [m[name] for _, m in read_metrics(out.with_suffix(".jsonl")) if name in m]
    return losses, load_file(str(out / "model" / "model.safetensors")), grouped


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.heavy
def test_cuda_choices_train_as_the_cpu_choices(stage, stages, tmp_path, monkeypatch, cuda_tuning):
    """Rows grouped shortest first into micro-batches, widths rounded to 64, 256 MiB head chunks
    and fused AdamW: the same sums in another order, so the same losses and weights up to
    float32 rounding. A grouping that moved chosen rows but not their rejected ones, or
    queries but not their lengths, would change the loss at once."""
    monkeypatch.setattr(training, "DEFAULT_TUNING", DEFAULT_TUNING)
    cpu_losses, cpu_weights, cpu_grouped = _train(stage, stages, tmp_path / "cpu", monkeypatch)
    monkeypatch.setattr(training, "DEFAULT_TUNING", cuda_tuning)
    cuda_losses, cuda_weights, cuda_grouped = _train(stage, stages, tmp_path / "cuda", monkeypatch)
    assert not any(cpu_grouped) and any(cuda_grouped)  # the lever ran, and changed the order
    assert len(cpu_losses) == len(cuda_losses) == 2
    # The first step's loss is computed from the same weights: equal up to the order of sums.
    assert cuda_losses[0] == pytest.approx(cpu_losses[0], rel=1e-5)
    # After it, AdamW moves a weight whose gradient is rounding noise by up to the learning rate
    # (its update is about the gradient's sign): the second loss and the weights agree to that.
    assert cuda_losses[1] == pytest.approx(cpu_losses[1], rel=1e-3)
    assert cpu_weights.keys() == cuda_weights.keys()
    lr = getattr(stages[0], stage).learning_rate
    for name, weight in cpu_weights.items():
        difference = (cuda_weights[name] - weight).abs()
        assert difference.max() <= 2 * lr * 1.01 and difference.mean() <= lr / 10, name
