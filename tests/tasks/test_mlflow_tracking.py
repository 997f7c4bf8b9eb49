"""The MLflow tracker against a real MLflow server on 127.0.0.1."""

import json
import math
import os
import subprocess
import warnings
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tasks.mlflow_tracking import MLflowTracker, mlflow_key

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.heavy
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
    # names MLflow refuses (verl #1242), mapped, and kept apart from a name MLflow accepts as it is
    tracker.log_metrics({"train/lr(1e-3)": 1.0, "train/lr_1e-3_": 2.0, "eval//score:x": 3.0, "../up": 4.0}, step=1)
    tracker.log_params({"grid.lr(1e-3)": 0.001})
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
    assert {k: v for k, v in data.metrics.items() if k not in ("train/loss", "lr")} == {
        "train/lr_1e-3__ff3dfe4": 1.0,
        "train/lr_1e-3_": 2.0,
        "eval/score_x_37aab88": 3.0,
        "up_8c722b8": 4.0,
    }
    assert data.params["grid.lr_1e-3__b10972e"] == "0.001"
    names = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "tables")
    }
    assert {"calibration.png", "tables/samples.json"} <= names
    # an MLflow table: registered with the run, read back by MlflowClient.load_table
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(mlflow_server)  # load_table searches runs through the fluent API's store
    try:
        table = client.load_table(experiment, "tables/samples.json", run_ids=[run.info.run_id])
    finally:
        mlflow.set_tracking_uri(None)  # and the environment variable it set
        if before is not None:
            os.environ["MLFLOW_TRACKING_URI"] = before
    assert table[["post", "sft"]].values.tolist() == [["p", "s"], ["q", "t"]]
    assert (
        "tables/samples.json"
        in json.loads(client.get_run(run.info.run_id).data.tags["mlflow.loggedArtifacts"])[0]["path"]
    )


def test_a_names_mapping_depends_on_the_name_alone():
    """The name MLflow gets for a metric or param is the same whichever names came before it in
    the run, and two names that map alike are refused, not renamed by their order."""
    names = ["train/lr(1e-3)", "train/lr_1e-3_", "train/lr[1e-3]", "a" * 300, "a" * 300 + "b", "ok/name"]
    forward, backward = MLflowTracker("run", client=object()), MLflowTracker("run", client=object())
    there = [forward._key(n) for n in names]
    assert [backward._key(n) for n in reversed(names)] == list(reversed(there))
    assert len(set(there)) == len(names) and there[1] == "train/lr_1e-3_" and there[-1] == "ok/name"
    assert all(len(k) <= 250 and mlflow_key(k) == k for k in there)  # each one MLflow accepts as it is
    forward._names["train/lr_1e-3__ff3dfe4"] = "another name"
    with pytest.raises(ValueError, match=r"'another name' and 'train/lr\(1e-3\)' both map to"):
        forward._key("train/lr(1e-3)")


def test_experiments_open_on_model_runs_and_runs_name_their_source(cached_db, tmp_path):
    from tasks.mlflow_tracking import experiment_id, source_tags

    client = MlflowClient(tracking_uri=cached_db)
    exp = client.get_experiment(experiment_id(client, "kind"))
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # not the GenAI view
    chosen = client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    assert experiment_id(client, "chosen") == chosen
    assert client.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"  # a user's choice stays

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    tags = source_tags()
    assert tags["mlflow.source.git.commit"] == head and tags["mlflow.source.type"] == "JOB"
    assert tags["rlhf.git.dirty"] in {"true", "false"}
    assert "@" not in tags.get("mlflow.source.git.repoURL", "").partition("://")[2].split("/")[0]


def test_the_prepared_splits_are_logged_as_dataset_inputs(smoke_stages, cached_db, tmp_path, tldr_dir):
    from rlhf_core.config.presets import load_config
    from tasks.mlflow_tracking import dataset_inputs

    cfg = load_config("smoke")
    client = MlflowClient(tracking_uri=cached_db)
    run = client.create_run(client.create_experiment("inputs"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inputs = dataset_inputs(smoke_stages / "data", cfg)
    assert not [str(w.message) for w in caught if "Inferred schema" in str(w.message)]  # no noise per split
    client.log_inputs(run.info.run_id, datasets=inputs)
    logged = {i.dataset.name: i for i in client.get_run(run.info.run_id).inputs.dataset_inputs}
    expected = {f"tldr/sft/{s}" for s in cfg.data.sft_splits} | {
        f"tldr/preference/{s}" for s in cfg.data.preference_splits
    }
    assert set(logged) == expected
    train = logged["tldr/sft/train"]
    state = json.loads((smoke_stages / "data" / "sft" / "train" / "state.json").read_text())
    assert train.dataset.digest == state["_fingerprint"][:16]  # the split's content digest
    assert json.loads(train.dataset.source)["uri"] == str(
        tldr_dir / "sft_validation.jsonl"
    )  # smoke: sft/train from the validation file
    rows = len(__import__("datasets").load_from_disk(str(smoke_stages / "data" / "sft" / "train")))
    assert json.loads(train.dataset.profile)["num_rows"] == rows
    assert {t.key: t.value for t in train.tags}["mlflow.data.context"] == "training"
    assert {t.key: t.value for t in logged["tldr/preference/validation"].tags}["mlflow.data.context"] == "evaluation"


@pytest.mark.heavy
def test_the_data_stages_policy_pairs_and_token_lengths_reach_its_run(smoke_stages, cached_db, tmp_path):
    """Table 2 in MLflow: each preference split's distinct policy pairs and comparisons per pair
    as metrics, every pair as the table ``policy_pairs``, beside the token lengths' plot."""
    from tasks.stages import POLICY_PAIRS_TABLE, log_data_figures

    client = MlflowClient(tracking_uri=cached_db)
    run = client.create_run(client.create_experiment("data"))
    log_data_figures(smoke_stages / "data", MLflowTracker(run.info.run_id, client=client, flush_seconds=3600))
    stats = json.loads((smoke_stages / "data" / "stats.json").read_text())
    metrics = client.get_run(run.info.run_id).data.metrics
    for name in ("train", "validation", "validation_cnndm"):
        pairs = stats["splits"][f"preference/{name}"]["policy_pairs"]
        assert metrics[f"data/preference/{name}/policy_pairs"] == pairs["unique"] > 0
        assert metrics[f"data/preference/{name}/comparisons_per_pair_max"] == pairs["per_pair"]["max"]
    assert metrics["data/preference/train/policy_pairs"] == 1  # the offline re-split: batch13, one pair
    names = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "tables")
    }
    assert {"token_lengths.png", f"tables/{POLICY_PAIRS_TABLE}.json"} <= names
    table = json.loads(
        Path(client.download_artifacts(run.info.run_id, f"tables/{POLICY_PAIRS_TABLE}.json")).read_text()
    )
    assert table["columns"] == ["split", "policies", "comparisons"]
    assert table["data"][0] == ["preference/train", "sup4_12b_t0.7, sup4_ppo_rm4_t.7", 32]
    assert len(table["data"]) == sum(
        s["policy_pairs"]["unique"] for s in stats["splits"].values() if "policy_pairs" in s
    )


def test_a_stage_run_left_running_by_a_dead_attempt_is_marked_killed(cached_db, tmp_path):
    """The resumed attempt of a stage (same key) ends the run its killed predecessor left RUNNING."""
    from rlhf_core.config.presets import load_config
    from tasks.mlflow_tracking import start_stage_run

    uri = cached_db
    cfg = load_config("smoke", [f"tracking.tracking_uri={uri}"])
    first, client = start_stage_run(None, "sft", cfg, "sft/abc")  # its process dies: never terminated
    other, _ = start_stage_run(None, "sft", cfg, "sft/other-key")
    second, _ = start_stage_run(None, "sft", cfg, "sft/abc")
    assert client.tracking_uri == uri  # the setting, not MLFLOW_TRACKING_URI
    assert client.get_run(first).info.status == "KILLED"
    assert client.get_run(first).data.tags["rlhf.replaced_by"] == second
    assert client.get_run(other).info.status == client.get_run(second).info.status == "RUNNING"


def test_a_registered_model_in_a_local_artifact_store_links_the_stage_artifacts_weights(cached_db, tmp_path):
    """The MLflow copy of a stage's model shares the stored weights' inode (on disk once),
    unless no store is given."""
    import shutil

    from tasks.mlflow_tracking import register_model_version
    from tasks.storage import ArtifactStore

    store = ArtifactStore(str(tmp_path / "store"))
    stage = tmp_path / "ppo" / "model"
    stage.mkdir(parents=True)
    (stage / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (stage / "config.json").write_text("{}")
    record = store.put_dir(stage.parent, "ppo/k1")
    stored = Path(record["uri"]) / "model" / "model.safetensors"
    client = MlflowClient(tracking_uri=cached_db)
    exp = client.create_experiment("e", artifact_location=str(tmp_path / "mlartifacts"))

    def save(path):  # an MLflow model holding the stage's files, as save_policy_model writes them
        shutil.copytree(Path(record["uri"]) / "model", path / "model")
        (path / "MLmodel").write_text("flavors: {}\n")

    inodes = {}
    for name, given in (("linked", store), ("copied", None)):
        run = client.create_run(exp).info.run_id
        register_model_version(client, name, run, record["digest"], record["uri"], save, store=given)
        logged = Path(client.get_run(run).info.artifact_uri) / "model" / "model" / "model.safetensors"
        assert logged.read_bytes() == stored.read_bytes()
        inodes[name] = logged.stat().st_ino
    assert inodes["linked"] == stored.stat().st_ino != inodes["copied"]
