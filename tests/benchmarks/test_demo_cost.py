"""The demo cost benchmark's accounting (benchmarks/demo_cost.py): disk per folder with hard
links once, stage windows over the samples, FLOPs per counted token, the decoding bound."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_cost.py"
spec = importlib.util.spec_from_file_location("demo_cost", SCRIPT)
demo_cost = importlib.util.module_from_spec(spec)
sys.modules["demo_cost"] = demo_cost
spec.loader.exec_module(demo_cost)


def test_disk_usage_counts_each_top_level_folder_and_a_hard_linked_file_once(tmp_path):
    (tmp_path / "artifacts" / "sft").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "artifacts" / "sft" / "model.bin").write_bytes(b"x" * 100_000)
    (tmp_path / "work" / "metrics.jsonl").write_bytes(b"y" * 10_000)
    (tmp_path / "mlflow.db").write_bytes(b"z" * 5_000)
    os.link(tmp_path / "artifacts" / "sft" / "model.bin", tmp_path / "work" / "model.bin")

    def allocated(p):
        return os.stat(p).st_blocks * 512

    usage = demo_cost.disk_usage(tmp_path)
    assert usage == {
        "artifacts": allocated(tmp_path / "artifacts" / "sft" / "model.bin"),
        "work": allocated(tmp_path / "work" / "metrics.jsonl"),  # the link's bytes are the artifact's
        "empty": 0,
        ".": allocated(tmp_path / "mlflow.db"),
    }
    assert usage["artifacts"] >= 100_000
    assert demo_cost.disk_usage(tmp_path / "missing") == {}


SAMPLES = [(0.0, 100, 0.0), (1.0, 300, 2.0), (2.0, 200, 4.0), (3.0, 900, 5.0), (4.0, 100, 5.5)]


def test_cpu_seconds_are_interpolated_between_samples_and_held_outside_them():
    assert demo_cost.cpu_at(SAMPLES, 1.5) == pytest.approx(3.0)
    assert demo_cost.cpu_at(SAMPLES, 3.5) == pytest.approx(5.25)
    assert demo_cost.cpu_at(SAMPLES, -1.0) == 0.0
    assert demo_cost.cpu_at(SAMPLES, 9.0) == 5.5


def test_a_window_takes_its_wall_and_cpu_time_and_the_peak_of_its_samples_and_the_one_before():
    seg = demo_cost.segment(SAMPLES, 1.5, 2.5)
    assert seg == {"wall_s": 1.0, "cpu_s": pytest.approx(1.5), "peak_rss_bytes": 300}  # sample at 1.0 included
    assert demo_cost.segment(SAMPLES, 2.5, 3.5)["peak_rss_bytes"] == 900
    got = demo_cost.segments(SAMPLES, {"ppo": (2.5, 3.5), "sft": (0.5, 2.0)}, 0.0, 4.0)
    assert list(got) == ["startup", "sft", "ppo", "finish"]
    assert got["startup"]["wall_s"] == 0.5 and got["finish"]["wall_s"] == 0.5
    assert sum(s["cpu_s"] for s in got.values()) == pytest.approx(5.5 - 0.5)  # the gap 2.0-2.5 is no segment's


SHAPE = demo_cost.model_shape(
    {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 100, "tie_word_embeddings": True}, 4 * 1_800
)


def test_the_body_is_every_parameter_but_the_embedding_and_head():
    assert SHAPE["params"] == 1_800 and SHAPE["body"] == 1_000
    untied = demo_cost.model_shape({"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 100}, 4 * 2_600)
    assert untied["body"] == 1_000


def test_sft_flops_per_token_on_the_whole_sequence_are_six_n_plus_palm_attention():
    lengths = {"query": 30, "response": 10}
    got = demo_cost.flops_per_token("sft", SHAPE, lengths, loss_on="sequence")
    assert got == pytest.approx(6 * 1_800 + 12 * 2 * 8 * 40)
    # the head only on the response: 10 of 40 tokens
    got = demo_cost.flops_per_token("sft", SHAPE, lengths, loss_on="response")
    assert got == pytest.approx(6 * 1_000 + 6 * 800 * 10 / 40 + 12 * 2 * 8 * 40)


def test_a_pair_counts_its_query_twice_but_runs_it_once():
    lengths = {"query": 30, "chosen": 12, "rejected": 8}
    run, counted, context = 50, 80, 40
    reward = demo_cost.flops_per_token("reward", SHAPE, lengths)
    assert reward == pytest.approx((6 * 1_000 * run + 12 * 2 * 8 * context * run) / counted)
    dpo = demo_cost.flops_per_token("dpo", SHAPE, lengths)
    assert dpo == pytest.approx((8 * (1_000 * run + 800 * 20) + 16 * 2 * 8 * context * run) / counted)


def test_training_figures_time_the_steps_from_their_tokens_and_rates():
    steps = [{"tokens": 100.0, "tokens_per_s": 50.0}, {"tokens": 300.0, "tokens_per_s": 100.0}, {"loss": 1.0}]
    got = demo_cost.training_figures(steps, per_token=10.0, matmul_flops=1_000.0)
    assert got["steps"] == 2 and got["tokens"] == 400 and got["seconds"] == pytest.approx(5.0)
    assert got["flops_per_s"] == pytest.approx(800.0) and got["mfu"] == pytest.approx(0.8)
    assert demo_cost.training_figures([{"loss": 1.0}], 10.0, 1.0) is None


def test_the_decoding_bound_is_rows_times_bandwidth_over_the_weight_bytes():
    updates = [
        {"time/generate": 2.0, "time/generate_tokens_per_s": 10.0},
        {"time/generate": 6.0, "time/generate_tokens_per_s": 30.0},
    ]
    got = demo_cost.decoding_figures(updates, rows=4, weight_bytes=1_000, bandwidth=5_000.0)
    assert got["tokens"] == 200 and got["tokens_per_s"] == pytest.approx(25.0)
    assert got["bound_tokens_per_s"] == pytest.approx(20.0) and got["fraction"] == pytest.approx(1.25)
