"""benchmarks/ppo_seeds.py: PPO's check per seed from the stage's metrics or a sweep's cells.json."""

import json

from benchmarks.ppo_seeds import cell, from_cells, from_run
from rlhf_core.run.sweep import COLUMNS

METRICS = {
    "eval/objective_gain_vs_sft": 0.2,
    "eval/objective_gain_vs_sft_ci_low": 0.05,
    "eval/objective_gain_vs_sft_ci_high": 0.35,
    "eval/kl_vs_sft": 0.5,
    "eval/score_gain_vs_sft": 0.3,
    "eval/score_gain_vs_sft_ci_low": 0.1,
    "eval/score_gain_vs_sft_ci_high": 0.5,
    "eval/eos_rate_policy": 0.95,
    "eval/eos_rate_policy_ci_low": 0.8,
    "eval/eos_rate_policy_ci_high": 0.99,
    "objective/kl": 1.2,
    "eval/repetition_rate_policy": 0.0,
    "eval/repetition_rate_sft": 0.05,
}


def test_a_cell_passes_only_with_every_part_of_the_check():
    ok = cell(2, METRICS)
    assert ok["passed"] and ok["seed"] == 2 and ok["estimator"] == "gae"
    assert ok["objective_gain"] == 0.2 and ok["objective_gain_ci"] == [0.05, 0.35] and ok["ppo_kl_vs_sft"] == 0.5
    assert ok["ppo_score_gain_ci"] == [0.1, 0.5] and ok["ppo_kl"] == 1.2
    # (a) the objective's interval includes 0: fails, whatever the score gain
    assert not cell(2, METRICS | {"eval/objective_gain_vs_sft_ci_low": -0.01})["passed"]
    # (d) the score gain is reported, not required
    assert cell(2, METRICS | {"eval/score_gain_vs_sft_ci_low": -0.01})["passed"]
    assert not cell(2, METRICS | {"eval/eos_rate_policy": 0.89})["passed"]  # (b)
    # (c) at most 5 points more loops than SFT's
    assert cell(2, METRICS | {"eval/repetition_rate_policy": 0.1})["passed"]
    assert not cell(2, METRICS | {"eval/repetition_rate_policy": 0.11})["passed"]
    assert not cell(2, {})["passed"]  # no check measured: not passed
    assert cell(2, METRICS, flagged=True)["passed"]  # the seed-health flag is reported beside it
    assert cell(2, METRICS, flagged=False)["flagged"] is False and ok["flagged"] is None


def test_cells_of_a_sweep_summary_read_the_columns_the_sweep_writes(tmp_path):
    """The column names are the sweep's own (rlhf_core.run.sweep.COLUMNS), as summary_rows writes them."""
    by_metric = {metric: (name, interval) for name, stage, metric, interval in COLUMNS if stage == "ppo"}
    row = {"cell": "cpu-demo/seed=3/ppo.advantage_estimator=rloo", "seed": 3, "error": None, "flagged": True}
    row["ppo.advantage_estimator"] = "rloo"
    for metric, value in METRICS.items():
        if metric in by_metric:
            row[by_metric[metric][0]] = value
    for name, interval in by_metric.values():
        if interval:
            row[f"{name} ci_low"], row[f"{name} ci_high"] = METRICS[interval[0]], METRICS[interval[1]]
    path = tmp_path / "cells.json"
    path.write_text(json.dumps({"cells": [row]}))
    [out] = from_cells(path)
    expected = cell(3, METRICS, flagged=True, estimator="rloo")
    assert out == expected | {"cell": "cpu-demo/seed=3/ppo.advantage_estimator=rloo", "error": None}
    assert out["estimator"] == "rloo" and out["objective_gain_ci"] == [0.05, 0.35]


def test_a_run_directory_names_its_seed_and_estimator(tmp_path):
    (tmp_path / "ppo").mkdir()
    (tmp_path / "ppo" / "metrics.json").write_text(json.dumps(METRICS))
    assert from_run(f"3:rloo={tmp_path}") == cell(3, METRICS, estimator="rloo") | {"run": str(tmp_path)}
    assert from_run(f"1={tmp_path}")["estimator"] == "gae"
