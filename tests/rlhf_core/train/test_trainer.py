"""The trainer skeleton (rlhf_core.train.trainer): the shared setup, the loop's checkpoint key, and the
main rank's finish (adapters merged, model saved, evaluation, metrics.json)."""

import json

import pytest
import torch

from rlhf_core.config.presets import load_config
from rlhf_core.models.saved import load_causal_lm
from rlhf_core.train.trainer import global_means, start_stage
from rlhf_core.train.training import TrainingError


def test_global_means_divides_each_sum_by_the_global_rows_and_keeps_the_tokens_summed():
    means = global_means({"loss": 6.0, "accuracy": 3.0}, 4, 100.0)
    assert means == {"loss": 1.5, "accuracy": 0.75, "tokens": 100.0}
    assert list(means) == ["loss", "accuracy", "tokens"]


def test_start_stage_loads_the_data_and_checks_the_batch_against_the_micro_batch(smoke_stages, tmp_path):
    cfg = load_config("smoke", ["reward.batch_size=8", "reward.micro_batch_size=4"]).reward
    stage = start_stage("reward", cfg, smoke_stages / "data", tmp_path / "rm")
    assert (tmp_path / "rm").is_dir() and stage.device == torch.device("cpu")
    assert stage.pad_id == stage.tokenizer.pad_token_id is not None
    assert len(stage.pref["train"]) > 0 and len(stage.sft["train"]) > 0
    assert stage.metric_prefix == "train/" and stage.world.size == 1
    odd = cfg.model_copy(update={"batch_size": 6})  # past the config's own check
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size 4"):
        start_stage("reward", odd, smoke_stages / "data", tmp_path / "odd")


def test_finish_saves_the_merged_model_evaluates_it_and_writes_the_stage_metrics(smoke_stages, tmp_path):
    cfg = load_config("smoke", ["dpo.lora.r=8", "dpo.gradient_checkpointing=selective"]).dpo
    stage = start_stage("dpo", cfg, smoke_stages / "data", tmp_path / "dpo", metric_prefix="dpo/")
    model = load_causal_lm(smoke_stages / "base")
    adapted = stage.adapt(model)
    assert adapted is not None and model.base_model.gradient_checkpointing  # adapters and recomputation
    seen = []

    def evaluate(saved: torch.nn.Module) -> dict[str, float]:
        seen.append(saved)
        return {"eval/x": 2.0}

    last = {"dpo/loss": 0.5, "lr": 1e-3, "tokens": 10.0, "tokens_per_s": 5.0, "step": 3, "steps": 3, "seconds": 1.5}
    metrics = stage.finish(model.train(), adapted, last, evaluate)
    assert metrics == {"dpo/loss": 0.5, "dpo/steps": 3.0, "dpo/seconds": 1.5, "eval/x": 2.0}
    assert json.loads((tmp_path / "dpo" / "metrics.json").read_text()) == metrics
    (saved,) = seen
    assert type(saved.model.layers[0].self_attn.q_proj) is torch.nn.Linear and not saved.training  # merged, eval
    assert (tmp_path / "dpo" / "adapter" / "adapter_config.json").is_file()
    reloaded = load_causal_lm(tmp_path / "dpo" / "model")
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in saved.state_dict().items())
    assert (tmp_path / "dpo" / "model" / "tokenizer_config.json").is_file()


def test_the_checkpoint_key_holds_the_model_folder_the_stage_starts_from(smoke_stages, tmp_path):
    """A checkpoint written by a stage that started from one model folder is not resumed by a
    stage that starts from another: the loop raises instead."""
    overrides = ["sft.batch_size=4", "sft.micro_batch_size=4", "sft.max_steps=2", "sft.checkpoint_every=1"]
    cfg = load_config("smoke", overrides).sft
    stage = start_stage("sft", cfg, smoke_stages / "data", tmp_path / "sft")
    model = load_causal_lm(smoke_stages / "base")
    ids = torch.tensor([[5, 6, 7, 8]])

    def step_fn(indices, parallel):
        loss = parallel(lambda m, x: m(x).logits.float().pow(2).mean(), ids)
        loss.backward()
        return {"loss": loss.item(), "tokens": 4.0}

    trained, last = stage.train(model, 8, step_fn, smoke_stages / "base", lambda: model)
    assert last["steps"] == 2 and (tmp_path / "sft" / "checkpoints" / "step-000001").is_dir()
    stage.train(load_causal_lm(smoke_stages / "base"), 8, step_fn, smoke_stages / "base", lambda: model)  # resumes
    with pytest.raises(TrainingError, match="different configuration"):
        stage.train(load_causal_lm(smoke_stages / "base"), 8, step_fn, smoke_stages / "rm", lambda: model)


class _Crash(Exception):
    """The process dies here: nothing after the last checkpoint is saved."""


@pytest.mark.parametrize("crash_after", [2, 3], ids=["at-the-epochs-last-step", "after-the-next-epochs-first"])
@pytest.mark.parametrize("section", ["sft", "reward"])
def test_a_run_resumed_at_an_epoch_boundary_equals_the_uninterrupted_run(section, crash_after, tmp_path):
    """Two steps an epoch (5 rows, batches of 2), three epochs. A run dies right after the
    checkpoint of step 2, the last of the first epoch (verl #7401: the next epoch was skipped),
    or of step 3, the first of the second; resumed, it trains the same rows in the same order
    (OpenRLHF #928), takes the same number of steps and ends with the same weights, bitwise."""
    from rlhf_core.train.trainer import train_loop

    cfg = load_config("smoke", [f"{section}.num_epochs=3", f"{section}.batch_size=2", f"{section}.micro_batch_size=2"])
    optim = getattr(cfg, section).model_copy(update={"max_steps": None, "checkpoint_every": 1})

    def run(out, seen, crash_at=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        features = torch.arange(15.0).reshape(5, 3) / 10

        def step_fn(rows, parallel):
            if crash_at is not None and len(seen) == crash_at:
                raise _Crash
            seen.append(list(rows))
            loss = ((model(features[rows]) - 1.0) ** 2).mean() + 1e-3 * torch.randn(())  # the RNG is resumed too
            loss.backward()
            return {"loss": loss.item(), "tokens": float(len(rows))}

        kwargs = dict(desc=section, n_rows=5, optim=optim, device=torch.device("cpu"), inputs=[], rebuild=None)
        return train_loop(model=model, step_fn=step_fn, out_dir=out, **kwargs)

    clean_rows: list[list[int]] = []
    clean, clean_metrics = run(tmp_path / "clean", clean_rows)
    assert len(clean_rows) == clean_metrics["steps"] == 6  # 3 epochs of 2 steps, the fifth row dropped
    assert clean_rows[:2] != clean_rows[2:4]  # each epoch its own shuffle
    killed_rows: list[list[int]] = []
    with pytest.raises(_Crash):
        run(tmp_path / "killed", killed_rows, crash_at=crash_after)
    assert killed_rows == clean_rows[:crash_after]
    resumed, resumed_metrics = run(tmp_path / "killed", killed_rows)
    assert killed_rows == clean_rows and resumed_metrics["steps"] == 6
    for (name, want), got in zip(clean.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(got, want), name
