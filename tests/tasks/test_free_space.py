"""The free-space preflight of a stage: its output, its kept checkpoints and the one being written."""

import shutil
from collections import namedtuple

import pytest

from rlhf_core.config.presets import load_config
from tasks.stages import FREE_SPACE_MIN, check_free_space, estimate_stage_space
from tasks.storage import ArtifactError

GIB = 2**30
usage = namedtuple("usage", "total used free")


def test_the_estimate_is_the_output_plus_the_kept_and_the_written_checkpoint():
    # a 1B model in float32 (about 4.6 GiB): checkpoints of 3 x its size, one kept + one written
    model = 5 * 10**9
    est = estimate_stage_space(model, keep_checkpoints=1)
    assert (est.output, est.checkpoint, est.checkpoints) == (model, 3 * model, 2)
    assert est.total == model + 2 * 3 * model + FREE_SPACE_MIN
    assert estimate_stage_space(model, keep_checkpoints=3).total == model + 4 * 3 * model + FREE_SPACE_MIN
    assert estimate_stage_space(model, keep_checkpoints=None).total == model + FREE_SPACE_MIN  # no checkpoints
    # what the work directory holds already (an interrupted attempt's checkpoint) is not needed again
    assert estimate_stage_space(model, 1, written=3 * model).total == model + 3 * model + FREE_SPACE_MIN
    assert estimate_stage_space(model, None, written=2 * model).total == FREE_SPACE_MIN


def _artifact(path, size):
    path.mkdir(parents=True)
    with open(path / "model.safetensors", "wb") as fh:
        fh.truncate(size)  # sparse: its size without the disk
    return path


def test_ppo_counts_the_policy_and_the_value_model_and_names_the_figures(tmp_path, monkeypatch):
    """PPO trains the SFT policy and a value model from the reward model: its checkpoint is 3 x
    both (the data artifact does not count); the error names the space free, the space needed
    and its parts."""
    inputs = [
        _artifact(tmp_path / "data", 3 * GIB),
        _artifact(tmp_path / "sft", GIB),
        _artifact(tmp_path / "reward_norm", GIB),
    ]
    work = tmp_path / "work"
    work.mkdir()
    cfg = load_config("smoke")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 50, 0, 10 * GIB))
    with pytest.raises(ArtifactError) as err:
        check_free_space("ppo", inputs, [work], cfg)
    assert str(err.value) == (
        f"stage ppo: {work} has 10.00 GiB free; the stage needs about 14.25 GiB (its output 2.00 GiB + "
        "(1 kept + 1 being written) x 6.00 GiB per checkpoint (3 x the float32 weights it trains: weights and "
        "AdamW's two moments), + 256 MiB). Free some space or point RLHF_WORK_DIR / RLHF_ARTIFACT_ROOT elsewhere"
    )
    with pytest.raises(ArtifactError, match=r"needs about 26\.25 GiB .*\(3 kept \+ 1 being written\).*lower ppo\.keep"):
        check_free_space("ppo", inputs, [work], load_config("smoke", ["ppo.keep_checkpoints=3"]))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 50, 0, 15 * GIB))
    check_free_space("ppo", inputs, [work], cfg)
    # SFT trains the base model alone; a stage that trains nothing needs about its largest input
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 50, 0, 7 * GIB))
    with pytest.raises(ArtifactError, match=r"needs about 7\.25 GiB \(its output 1\.00 GiB \+ \(1 kept"):
        check_free_space("sft", [inputs[0], inputs[1]], [work], cfg)
    check_free_space("reward_eval", [inputs[0], inputs[2]], [work], cfg)  # 3.25 GiB


def test_a_resumed_stage_needs_no_room_for_the_checkpoint_it_already_has(tmp_path, monkeypatch):
    inputs = [_artifact(tmp_path / "data", 0), _artifact(tmp_path / "sft", GIB)]
    work = _artifact(tmp_path / "work" / "checkpoints" / "step-000004", 3 * GIB).parents[1]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 50, 0, 4 * GIB))
    with pytest.raises(ArtifactError, match=r"needs about 4\.25 GiB .* - 3\.00 GiB already written"):
        check_free_space("dpo", inputs, [work], load_config("smoke"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 50, 0, 5 * GIB))
    check_free_space("dpo", inputs, [work], load_config("smoke"))
