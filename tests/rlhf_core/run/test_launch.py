"""The torchrun launcher of `rlhf run` and the stage task: how many processes, relaying rank 0's records, and a failed job."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.common.tracking import JsonlTracker, read_metrics, replay
from rlhf_core.config.presets import load_config
from rlhf_core.run.launch import LaunchError, launch_torchrun, nproc_per_node


@pytest.mark.parametrize("value,expected", [(None, 1), ("", 1), ("1", 1), ("8", 8)])
def test_process_count_comes_from_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("RLHF_NPROC_PER_NODE", raising=False)
    else:
        monkeypatch.setenv("RLHF_NPROC_PER_NODE", value)
    assert nproc_per_node() == expected


@pytest.mark.parametrize("value", ["0", "two", "-2"])
def test_a_bad_process_count_is_named(monkeypatch, value):
    monkeypatch.setenv("RLHF_NPROC_PER_NODE", value)
    with pytest.raises(ValueError, match=f"RLHF_NPROC_PER_NODE must be a positive integer, not '{value}'"):
        nproc_per_node()


def test_replay_sends_only_records_after_the_offset(tmp_path):
    source = JsonlTracker(tmp_path / "metrics.jsonl")
    source.log_metrics({"train/loss": 1.0}, step=1)
    offset = (tmp_path / "metrics.jsonl").stat().st_size
    source.log_params({"sft.batch_size": 8})
    source.log_metrics({"train/loss": 0.5, "eval/x": float("nan")}, step=2)
    source.log_table("samples", [{"a": 1}])
    sink = JsonlTracker(tmp_path / "copy.jsonl")
    end = replay(tmp_path / "metrics.jsonl", sink, offset)
    assert end == (tmp_path / "metrics.jsonl").stat().st_size
    records = read_metrics(tmp_path / "copy.jsonl")
    assert [step for step, _ in records] == [2] and records[0][1]["train/loss"] == 0.5
    text = (tmp_path / "copy.jsonl").read_text()
    assert '"sft.batch_size": 8' in text and '"samples"' in text
    assert replay(tmp_path / "metrics.jsonl", sink, end) == end  # nothing new


@pytest.mark.slow
def test_a_failed_torchrun_job_raises_with_its_exit_code_and_output(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "sft"
    out.mkdir()
    sink = JsonlTracker(tmp_path / "relayed.jsonl")
    with pytest.raises(LaunchError, match=r"stage sft: torchrun with 2 processes exited with code 1") as err:
        launch_torchrun("sft", load_config("smoke"), [tmp_path / "no-data", tmp_path / "no-model"], out, 2, sink)
    first_line = str(err.value).splitlines()[0]
    assert "[rank" in first_line and "no-data" in first_line  # the ranks' own error, not torchrun's
    assert (out / "launch_config.json").is_file() and not (out / "launch_result.json").exists()


@pytest.mark.slow
def test_rlhf_sft_trains_on_two_processes_when_asked(tmp_path):
    """`rlhf sft` with RLHF_NPROC_PER_NODE=2 runs SFT as a torchrun job; rank 0's records are written once."""
    env = {**os.environ, "RLHF_NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"}
    exe = str(Path(sys.executable).with_name("rlhf"))
    result = subprocess.run(
        [
            exe,
            "sft",
            "--preset",
            "smoke",
            "sft.max_steps=2",
            "sft.batch_size=4",
            "sft.micro_batch_size=2",
            "sft.eval_max_samples=1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sft: 2 processes:" in result.stderr and "--nproc_per_node=2" in result.stderr
    steps = [step for step, m in read_metrics(tmp_path / "sft" / "metrics.jsonl") if "train/loss" in m]
    assert steps == [1, 2]  # each optimiser step recorded once, by rank 0
    assert (tmp_path / "sft" / "model" / "model.safetensors").is_file()


@pytest.mark.heavy
def test_a_rank_leaves_its_process_group_even_when_the_stage_fails(tmp_path):
    """A rank that exits with gloo's process group still joined can abort in the interpreter's
    teardown (SIGABRT) after finishing its work; ``main`` leaves the group on every way out, here
    after the stage's argument check raises (one rank of gloo, in its own process)."""
    code = f"""
import torch.distributed as dist
from rlhf_core.run.launch import main
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://{tmp_path / "store"}")
try:
    main(["sft", "--preset", "smoke", "--out", "{tmp_path / "out"}"])
except ValueError as e:
    print("RAISED", "input directories" in str(e))
print("JOINED", dist.is_initialized())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RAISED True" in out.stdout and "JOINED False" in out.stdout, out.stdout + out.stderr[-2000:]
