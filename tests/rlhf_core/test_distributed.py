"""Data parallelism on CPU: 2 ranks (gloo) with half the micro-batch each train exactly like
1 rank with the same global batch (Huang et al. 2024 keep the global batch sizes)."""

import os
import shutil
import subprocess
import sys

import pytest

from rlhf_core.config import load_config
from rlhf_core.data import prepare_data
from rlhf_core.distributed import World, all_reduce_sum, shard
from rlhf_core.models import import_base_model
from rlhf_core.tracking import read_metrics
from rlhf_core.training import accumulation_steps


def test_shards_split_a_global_batch_evenly_and_in_order():
    batch = list(range(10, 18))
    assert shard(batch, World(0, 2)) + shard(batch, World(1, 2)) == batch
    assert shard(batch, World(0, 1)) == batch
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        shard(batch, World(0, 3))
    assert all_reduce_sum([1.5, 2]) == [1.5, 2.0]  # one process: the identity
    assert accumulation_steps(128, 16, 2) == 4  # the global batch stays 128
    with pytest.raises(ValueError, match="x 3 rank"):
        accumulation_steps(128, 16, 3)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    cfg = load_config("smoke")
    root = tmp_path_factory.mktemp("ddp")
    prepare_data(cfg, root / "data")
    import_base_model(cfg.model, root / "base")
    shutil.copytree(root / "base", root / "sft" / "model")  # the reward model starts from a policy's `model`
    return root


def launch(stage: str, inputs: list, out, ranks: int, *overrides: str) -> list[tuple[int, dict]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "rlhf_core.launch", stage, "--preset", "smoke", "--inputs", *map(str, inputs), "--out", str(out),
           *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_two_ranks_with_half_the_micro_batch_match_one_rank(stage, inputs, tmp_path):
    if stage == "sft":
        stage_inputs, extra = [inputs / "data", inputs / "base"], ["sft.max_steps=3", "sft.eval_max_samples=1"]
    else:
        stage_inputs, extra = [inputs / "data", inputs / "sft"], ["reward.max_steps=3"]
    one = launch(stage, stage_inputs, tmp_path / "one", 1, f"{stage}.micro_batch_size=4", *extra)
    two = launch(stage, stage_inputs, tmp_path / "two", 2, f"{stage}.micro_batch_size=2", *extra)
    losses = [[m["train/loss"] for step, m in run if "train/loss" in m] for run in (one, two)]
    assert len(losses[0]) == 3 and len(losses[1]) == 3
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)
    assert losses[0][0] != losses[0][-1]  # it trained
    tokens = [[m["tokens_per_s"] > 0 for step, m in run if "train/loss" in m] for run in (one, two)]
    assert all(tokens[0]) and all(tokens[1])
    assert (tmp_path / "two" / "model").is_dir() and not (tmp_path / "two" / "checkpoints" / "step-000004").exists()
