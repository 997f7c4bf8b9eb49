"""benchmarks/gpu_stages.py: its accounting (MFU, phase shares, the timed window, utilisation
windows, card names) and a ``--tiny`` run of all four stages through the project's stage code."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_stages = _load("gpu_stages")
worker = _load("_ours_worker")


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_the_cards_dense_bf16_peak_is_found_by_name(name, tflops):
    assert gpu_stages.peak_tflops(name, None) == tflops
    assert gpu_stages.peak_tflops(name, 500.0) == 500.0  # --peak-tflops wins


def test_card_slugs_name_the_result_file():
    assert gpu_stages.card_slug({"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}) == "h100"
    assert gpu_stages.card_slug({"type": "cuda", "name": "NVIDIA H200"}) == "h200"
    assert gpu_stages.card_slug({"type": "cpu", "name": "AMD EPYC 9R14 96-Core"}) == "cpu-amd-epyc-9r14-96-core"


def test_the_timed_window_skips_the_warmup_steps():
    ends = [10.0, 12.0, 13.0, 14.5, 16.0]
    assert worker._timed_window(ends, 9.9, warmup=3) == {
        "timed_seconds": 16.0 - 13.0,
        "timed_from_step": 3,
        "warmup_included": False,
    }
    assert worker._timed_window(ends, 9.9, warmup=9)["timed_from_step"] == 4  # at most all but one step
    assert worker._timed_window([10.0], 9.9, warmup=3) == {
        "timed_seconds": 9.9,
        "timed_from_step": 0,
        "warmup_included": True,
    }


def test_utilisation_is_averaged_over_the_timed_window_only():
    busy = gpu_stages.GpuBusy.__new__(gpu_stages.GpuBusy)
    busy.samples = [(1.0, 0.0), (2.0, 50.0), (3.0, 100.0), (4.0, 90.0), (5.0, 0.0)]
    assert busy.mean_between(2.0, 4.0) == pytest.approx(0.8)
    assert busy.mean_between(6.0, 7.0) is None


class _Section:
    def __init__(self, batch_size, micro_batch_size=8, total_episodes=0, num_epochs=1):
        self.batch_size, self.micro_batch_size = batch_size, micro_batch_size
        self.total_episodes, self.num_epochs = total_episodes, num_epochs


class _Cfg:
    sft = _Section(128, 16)
    dpo = _Section(64, 8)
    ppo = _Section(128, 32, total_episodes=116_736)


def test_mfu_is_6n_tokens_per_second_over_the_peak_and_8n_for_dpo():
    run = {
        "timed_from_step": 2,
        "timed_seconds": 4.0,
        "step_ends": [1.0, 2.0, 4.0, 6.0],
        "step_seconds": [1.0, 2.0, 2.0],
        "gpu_peak_mb": 2048.0,
        "gradient_checkpointing": False,
    }
    info = {"tokens_per_step": [999, 999, 30_000, 50_000]}  # the warm-up's tokens are not counted
    sft = gpu_stages.stage_figures("sft", run, info, _Cfg, n_params=1_000_000_000, peak=1000.0, busy=0.5)
    assert sft["tokens_per_s"] == pytest.approx(80_000 / 4.0)
    assert sft["mfu"] == pytest.approx(6 * 1e9 * 20_000 / 1e15)
    assert sft["peak_gib"] == pytest.approx(2.0) and sft["peak_memory"] == "torch.cuda.max_memory_allocated"
    assert sft["seconds_per_step"] == pytest.approx(2.0) and sft["steps_timed"] == 2
    dpo = gpu_stages.stage_figures("dpo", run, info, _Cfg, n_params=1_000_000_000, peak=1000.0, busy=None)
    assert dpo["mfu"] == pytest.approx(8 * 1e9 * 20_000 / 1e15)
    assert gpu_stages.stage_figures("sft", run, info, _Cfg, 1, peak=None, busy=None)["mfu"] is None
    # the preset's whole SFT stage: 116,722 // 128 steps at 2 s
    assert gpu_stages.estimated_hours("sft", sft, _Cfg) == pytest.approx(911 * 2.0 / 3600)


def test_ppo_phase_shares_and_update_rate():
    phases = [{"generate_s": 9.0, "score_s": 9.0, "train_s": 9.0}] + [
        {"generate_s": 2.0, "score_s": 1.0, "train_s": 7.0}
    ] * 2
    run = {
        "timed_from_step": 1,
        "timed_seconds": 20.0,
        "step_ends": [30.0, 40.0, 50.0],
        "step_seconds": [10.0, 10.0],
        "peak_rss_mb": 512.0,
        "phases": phases,
        "gradient_checkpointing": True,
    }
    ppo = gpu_stages.stage_figures("ppo", run, {"response_length": 53}, _Cfg, 1, peak=None, busy=None)
    assert ppo["seconds_per_update"] == pytest.approx(10.0)
    assert ppo["episodes_per_s"] == pytest.approx(12.8)
    assert ppo["phase_share"] == pytest.approx({"generate": 0.2, "score": 0.1, "optimise": 0.7})
    assert ppo["phase_seconds_per_update"] == pytest.approx({"generate": 2.0, "score": 1.0, "optimise": 7.0})
    assert ppo["compile_failure"] is None  # the worker's report of a compiled decoding that fell back
    assert ppo["peak_memory"] == "process peak RSS" and ppo["peak_gib"] == pytest.approx(0.5)
    assert gpu_stages.estimated_hours("ppo", ppo, _Cfg) == pytest.approx(912 * 10.0 / 3600)


def test_the_default_run_is_a_random_llama_1b_shape_with_just_enough_rows():
    args = gpu_stages.parse_args(["--stages", "sft,ppo", "--steps", "5", "--warmup", "2"])
    overrides, cfg = gpu_stages.settings(args)
    assert cfg.name == "llama-3.2-1b-h200"
    assert cfg.model.random_init.hidden_size == 2048 and cfg.model.random_init.num_hidden_layers == 16
    assert cfg.data.sft_splits["train"].max_rows == 128 * 5  # SFT and PPO batches of 128, 5 steps
    assert cfg.sft.max_steps == 5 and cfg.ppo.total_episodes == 128 * 5 and cfg.ppo.response_length == 53
    assert cfg.sft.batch_size == 128 and cfg.sft.micro_batch_size == 16  # the preset's trainer settings
    later = gpu_stages.settings(gpu_stages.parse_args(["--set", "sft.micro_batch_size=32"]))[1]
    assert later.sft.micro_batch_size == 32  # the user's overrides win
    with pytest.raises(SystemExit):
        gpu_stages.parse_args(["--steps", "3", "--warmup", "3"])


def test_levers_off_gives_a_cuda_device_the_cpus_choices(monkeypatch):
    """``--levers off``: the worker makes CUDA's kernel choices the CPU's and decodes eagerly with
    the dynamic cache, so the same stage code runs without the speed levers on a GPU."""
    from rlhf_core.train import generation, training

    monkeypatch.setattr(training, "CUDA_TUNING", training.CUDA_TUNING)  # restored after the test
    monkeypatch.setattr(generation, "COMPILED_STATIC_CACHE", generation.COMPILED_STATIC_CACHE)
    assert training.device_tuning("cuda") != training.DEFAULT_TUNING
    assert generation.decoding_for("cuda").compile_config is not None
    worker.levers_off()
    assert training.device_tuning("cuda") == training.DEFAULT_TUNING
    assert generation.decoding_for("cuda") is generation.DYNAMIC_CACHE
    args = gpu_stages.parse_args(["--levers", "off"])
    assert args.levers == "off"
    assert gpu_stages.parse_args([]).levers == "on"


@pytest.mark.slow
def test_tiny_runs_every_stage_through_the_stage_code(tmp_path):
    out = tmp_path / "gpu_stages.json"
    code = gpu_stages.main(["--tiny", "--threads", "1", "--work", str(tmp_path / "work"), "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["device"]["type"] == "cpu" and record["versions"]["torch"]
    assert record["settings"]["levers"] == "on"
    assert set(record["stages"]) == {"sft", "reward", "dpo", "ppo"}
    for name in ("sft", "reward", "dpo"):
        stage = record["stages"][name]
        assert stage["tokens_per_s"] > 0 and stage["steps_timed"] == 2 and stage["warmup_steps"] == 1
        assert stage["mfu"] is None and stage["gpu_busy"] is None  # no GPU, no peak to divide by
        assert stage["peak_gib"] > 0 and stage["peak_memory"] == "process peak RSS"
    ppo = record["stages"]["ppo"]
    assert ppo["seconds_per_update"] > 0 and ppo["steps_timed"] == 2
    assert ppo["episodes_per_s"] == pytest.approx(8 / ppo["seconds_per_update"])
    assert sum(ppo["phase_share"].values()) == pytest.approx(1.0)
    assert all(v > 0 for v in ppo["phase_share"].values())
    assert ppo["compile_failure"] is None and "static_cache=False" in ppo["decoding"]  # the CPU decodes eagerly
    assert ppo["tuning"]["width_multiple"] == 1  # the CPU's choices
