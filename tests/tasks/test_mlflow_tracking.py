"""The MLflow tracker against a real MLflow server on 127.0.0.1."""

import json
import math

from mlflow.tracking import MlflowClient

from tasks.mlflow_tracking import MLflowTracker


def test_metrics_params_tables_and_files_reach_the_server(mlflow_server, tmp_path):
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.create_experiment(f"tracker-{tmp_path.name}")
    run = client.create_run(experiment)
    tracker = MLflowTracker(run.info.run_id, client=client, flush_seconds=3600, flush_size=5)
    tracker.log_params(
        {
            "ppo.kl_coef": 0.05,
            "data.sft_splits": {"train": 1},
            "eval.anthropic_api_key": "sk-secret",
            "model.pad_token": "[PAD]",
        }
    )
    for step in range(1, 4):
        tracker.log_metrics({"train/loss": 1.0 / step, "lr": 3e-6, "bad": math.nan}, step=step)
    tracker.log_table("samples", [{"post": "p", "sft": "s"}, {"post": "q", "sft": "t"}])
    plot = tmp_path / "calibration.png"
    plot.write_bytes(b"\x89PNG fake")
    tracker.log_artifact(plot)
    tracker.close()

    data = client.get_run(run.info.run_id).data
    assert data.params["ppo.kl_coef"] == "0.05" and data.params["model.pad_token"] == "[PAD]"
    assert "eval.anthropic_api_key" not in data.params  # secrets never logged
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, round(m.value, 4)) for m in history] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
    assert "bad" not in data.metrics
    names = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "tables")
    }
    assert {"calibration.png", "tables/samples.json"} <= names
    table = json.loads(open(client.download_artifacts(run.info.run_id, "tables/samples.json", str(tmp_path))).read())
    assert table == {"columns": ["post", "sft"], "data": [["p", "s"], ["q", "t"]]}


def test_a_stage_run_left_running_by_a_dead_attempt_is_marked_killed(tmp_path):
    """The resumed attempt of a stage (same key) ends the run its killed predecessor left RUNNING."""
    from rlhf_core.config import load_config
    from tasks.mlflow_tracking import start_stage_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config("smoke", [f"tracking.tracking_uri={uri}"])
    first, client = start_stage_run(None, "sft", cfg, "sft/abc")  # its process dies: never terminated
    other, _ = start_stage_run(None, "sft", cfg, "sft/other-key")
    second, _ = start_stage_run(None, "sft", cfg, "sft/abc")
    assert client.tracking_uri == uri  # the setting, not MLFLOW_TRACKING_URI
    assert client.get_run(first).info.status == "KILLED"
    assert client.get_run(other).info.status == client.get_run(second).info.status == "RUNNING"
