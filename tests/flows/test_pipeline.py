"""`rlhf run`: the `rlhf` flow in the command's process, on the test process's Prefect server
(the `prefect_api` fixture) or, where a test is about it, on a temporary server of the command's
own (Prefect's ephemeral mode), with a local SQLite MLflow store and a local artifact root in the
run directory. Killing and resuming is tested through the deployment
(tests/flows/test_deployment.py)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlhf_core.config.settings import policy_key
from rlhf_core.run.pipeline import STAGES
from tasks.storage import ArtifactStore
from tests.servers import fresh_mlflow_store, fresh_prefect_home
from tests.stages import run_made_once

REPO = Path(__file__).resolve().parents[2]
FAST = [
    "sft.max_steps=2",
    "sft.eval_max_samples=2",
    "reward.max_steps=2",
    "reward.eval_max_samples=4",
    "ppo.batch_size=4",
    "ppo.micro_batch_size=4",
    "ppo.total_episodes=8",
    "ppo.eval_max_samples=2",
    "eval.max_samples=4",
    "dpo.max_steps=2",
    "eval.max_comparisons=16",
    "eval.diversity_prompts=1",
    "eval.diversity_samples=2",
    "eval.token_shift_samples=1",
]


def flow_env(root: Path, migrated: bool = True, api: str | None = None, store: bool = True) -> dict:
    """The environment of an ``rlhf`` command on the run directory ``root``: its own Prefect home
    (:func:`fresh_prefect_home` the first time, unless not ``migrated``: then the first command
    creates its database), MLflow store (with ``store``, a copy of the migrated one the first
    time: :func:`fresh_mlflow_store`), artifact root and work directory. With ``api`` (the
    ``prefect_api`` fixture), the command's flow runs on that Prefect server; without, on a
    temporary server of its own (Prefect's ephemeral mode, which ``rlhf run`` starts)."""
    home = fresh_prefect_home(root / "prefect") if migrated else root / "prefect"
    if store:
        fresh_mlflow_store(root / "mlflow.db")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return {
        **env,
        **({"PREFECT_API_URL": api} if api else {}),
        "PREFECT_HOME": str(home),
        "RLHF_ARTIFACT_ROOT": str(root / "artifacts"),
        "RLHF_WORK_DIR": str(root / "work"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }


def rlhf_run(
    root: Path, *args: str, env: dict | None = None, timeout: int = 900, api: str | None = None, store: bool = True
) -> subprocess.CompletedProcess:
    """``rlhf run --preset smoke ARGS --out ROOT`` in a subprocess, with the run's own stores
    (:func:`flow_env`: ``api``, ``store``)."""
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--preset", "smoke", *args, "--out", str(root)],
        cwd=root,
        env={**flow_env(root, api=api, store=store), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_flow(
    root: Path, *overrides: str, timeout: int = 900, env: dict | None = None, api: str | None = None
) -> tuple[dict, str]:
    """A short smoke run (``FAST``) that must succeed: its JSON record and its whole output."""
    result = rlhf_run(root, "--json", *FAST, *overrides, env=env, timeout=timeout, api=api)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    out = result.stdout
    return json.loads(out[out.index("{\n") : out.rindex("}") + 1]), result.stdout + result.stderr


def rlhf_plan(root: Path, *args: str) -> dict[str, list[str]]:
    """``rlhf plan --preset smoke ARGS --out ROOT`` in a subprocess, with the run's own stores:
    ``{stage: [key, "cached" or "runs", reason...]}``; it must succeed and load no torch."""
    code = (
        "import contextlib, io, json, sys\n"
        "from flows.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    code = main(['plan', '--preset', 'smoke', *{list(args)!r}, '--out', {str(root)!r}])\n"
        "print(json.dumps({'code': code, 'lines': out.getvalue().splitlines(), 'torch': 'torch' in sys.modules}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=flow_env(root), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    printed = json.loads(result.stdout.splitlines()[-1])
    assert printed["code"] == 0 and not printed["torch"]
    return {line.split()[0]: line.split()[1:] for line in printed["lines"][:-1]}


def finished_task_runs(log: str) -> list[tuple[str, str]]:
    """``(task run name, final state)`` of each "Task run ... Finished in state ..." log line, in order."""
    found = []
    for line in log.splitlines():
        if "Task run '" in line and "Finished in state" in line:
            name = line.split("Task run '", 1)[1].split("'", 1)[0]
            found.append((name, line.split("Finished in state ", 1)[1].split("(", 1)[0].strip()))
    return found


def states(log: str) -> dict[str, str]:
    """Each stage's final state in a run's log."""
    return dict(finished_task_runs(log))


def check_registered_models_load_with_pyfunc(root: Path, result: dict) -> None:
    """The registered versions are MLflow models: from their alias, the reward model scores
    (post, summary) rows as the pipeline does, and the policy writes summaries of TL;DR prompts."""
    import datasets
    import mlflow
    import pandas as pd
    import torch

    from rlhf_core.train.reward import ScalarModel, get_reward

    rows = datasets.load_from_disk(str(Path(result["stages"]["data"]["uri"]) / "sft" / "validation")).select(range(4))
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    try:
        scorer = mlflow.pyfunc.load_model("models:/rlhf-tldr-reward-model@latest-pipeline")
        scores = scorer.predict(pd.DataFrame({k: rows[k] for k in ("post", "summary", "subreddit", "title")}))
        policy = mlflow.pyfunc.load_model("models:/rlhf-tldr-policy@latest-pipeline")
        summaries = policy.predict(rows["query"][:2])
        dpo_policy = mlflow.pyfunc.load_model("models:/rlhf-tldr-dpo-policy@latest-pipeline")
    finally:
        mlflow.set_tracking_uri(None)
        if before is not None:
            os.environ["MLFLOW_TRACKING_URI"] = before
    reward_model = ScalarModel.from_pretrained(Path(result["stages"]["reward_norm"]["uri"]) / "model")
    with torch.no_grad():
        expected = get_reward(
            reward_model, torch.tensor(rows["query_reference_response_token"]), reward_model.config.pad_token_id
        )[1]
    assert list(scores.columns) == ["score"]
    assert scores["score"].tolist() == pytest.approx(expected.tolist(), abs=1e-4)
    assert len(summaries) == 2 and all(isinstance(s, str) for s in summaries)
    assert scorer.metadata.get_input_schema().input_names()[:2] == ["post", "summary"]
    assert policy.metadata.metadata["prompt_format"].endswith("TL;DR:")
    assert "PPO policy" in policy.metadata.metadata["source"] and "DPO policy" in dpo_policy.metadata.metadata["source"]


@pytest.fixture(scope="session")
def first_run(shared_runs, prefect_api) -> tuple[Path, dict, str]:
    """One ``rlhf run`` of every stage from nothing (``FAST``), made once for all test processes
    (:func:`tests.stages.run_made_once`): its directory, JSON record and output. The tests of
    the ``smoke-flow`` group (one test process runs them, one after the other) go on in its
    directory; the digest test (group ``two-at-once``) reads only its record, taken before any
    other test used the directory."""

    def build(root: Path) -> None:
        record, log = run_flow(root, api=prefect_api)
        (root / "first-run.json").write_text(json.dumps(record))
        (root / "first-run.log").write_text(log)

    root = run_made_once(shared_runs, "first-run", build)
    return root, json.loads((root / "first-run.json").read_text()), (root / "first-run.log").read_text()


@pytest.mark.slow
@pytest.mark.xdist_group("smoke-flow")
def test_flow_caches_stages_tracks_in_mlflow_and_reruns_only_what_changed(first_run, prefect_api):
    tmp_path, first, log = first_run
    assert states(log) == {s: "Completed" for s in first["stages"]}
    for stage in first["stages"]:  # each stage's freed memory given back before the next one runs
        assert f"after stage {stage}: freed memory given back to the system" in log, stage
    for stage, record in first["stages"].items():  # each output moved into the store, not kept twice
        assert (Path(record["uri"]) / "MANIFEST.json").is_file()
        assert not [p.name for p in (tmp_path / "work" / stage).iterdir() if p.is_dir()], stage
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.data.params["ppo.kl_coef"] == "0.05" and "ppo/objective/kl" in parent.data.metrics
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert sorted(r.info.run_name for r in children) == sorted(first["stages"])
    sft_run = next(r for r in children if r.info.run_name == "sft")
    assert (
        "eval/rougeL" in sft_run.data.metrics and len(client.get_metric_history(sft_run.info.run_id, "train/loss")) == 2
    )
    assert client.get_model_version_by_alias("rlhf-tldr-policy", "latest-pipeline").source.endswith("/model")
    check_registered_models_load_with_pyfunc(tmp_path, first)
    eval_run = next(r for r in children if r.info.run_name == "evaluation")
    assert (
        0 <= eval_run.data.metrics["eval/ppo/win_rate"] <= 1 and "evaluation/eval/ppo/win_rate" in parent.data.metrics
    )
    assert {"report/report.html", "report/length_control.png", "report/win_rate_by_length.png"} <= {
        f.path for f in client.list_artifacts(parent.info.run_id, "report")
    }
    # The run's report names it: preset, config digest, commit, date, MLflow run (stamped on a
    # copy: the evaluation artifact stays identical for identical work).
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    report = Path(first["report"]).read_text()
    this_run = report[report.index("<h2>This run</h2>") : report.index('<h2 id="headline">Headline</h2>')]
    for value in ("smoke", parent.data.tags["rlhf.config_digest"], head, parent.info.run_id):
        assert f"<td>{value}" in this_run, value
    assert parent.data.tags["mlflow.source.git.commit"] == head == sft_run.data.tags["mlflow.source.git.commit"]
    assert "This run" not in (Path(first["stages"]["evaluation"]["uri"]) / "report.html").read_text()
    assert client.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    inputs = {i.dataset.name for i in parent.inputs.dataset_inputs}
    assert {"tldr/sft/train", "tldr/preference/train", "tldr/preference/validation_cnndm"} <= inputs
    # the data stage's token lengths are drawn for its MLflow run, not written into its artifact
    data_run = next(r for r in children if r.info.run_name == "data")
    assert "token_lengths.png" in {f.path for f in client.list_artifacts(data_run.info.run_id)}
    assert not (Path(first["stages"]["data"]["uri"]) / "token_lengths.png").exists()
    assert "stage ppo runs: not run yet" in log

    # `rlhf plan` says so beforehand, with the flow's keys: every stage from the cache; with
    # another ppo.kl_coef, PPO runs under a key known now, the evaluation after it.
    plan = rlhf_plan(tmp_path, *FAST)
    assert {name: line[:2] for name, line in plan.items()} == {
        name: [record["key"], "cached"] for name, record in first["stages"].items()
    }
    plan = rlhf_plan(tmp_path, *FAST, "ppo.kl_coef=0.1")
    planned_ppo = plan.pop("ppo")
    assert planned_ppo[1] == "runs" and plan.pop("evaluation")[:2] == ["-", "runs"]
    assert " ".join(planned_ppo[2:]) == "no cache entry: its settings changed: ppo.kl_coef 0.05 -> 0.1"
    assert {line[1] for line in plan.values()} == {"cached"}

    # A fresh PREFECT_HOME and a temporary Prefect server of its own, as in a new container: the
    # cache entries live beside the artifacts (tasks.stages.result_storage), so the unchanged
    # stages are still cache hits.
    fresh_home = fresh_prefect_home(tmp_path / "prefect-fresh")  # no flow runs, no cache records
    second, log = run_flow(tmp_path, "ppo.kl_coef=0.1", env={"PREFECT_HOME": str(fresh_home)})
    s = states(log)
    assert s.pop("ppo") == s.pop("evaluation") == "Completed" and set(s.values()) == {"Cached"}
    assert "stage ppo runs: its settings changed: ppo.kl_coef 0.05 -> 0.1" in log  # why, in the task's log
    assert second["stages"]["ppo"]["key"] == planned_ppo[0]
    for stage in ("data", "sft", "reward_norm"):
        assert second["stages"][stage] == first["stages"][stage]  # same artifact, same digest
    assert second["stages"]["ppo"]["key"] != first["stages"]["ppo"]["key"]
    # the reward model was cached: same registered version; the new policy is a new version
    assert second["registered"]["rlhf-tldr-reward-model"] == first["registered"]["rlhf-tldr-reward-model"]
    assert int(second["registered"]["rlhf-tldr-policy"]) == int(first["registered"]["rlhf-tldr-policy"]) + 1

    # Only evaluation settings changed (which pairs the reward models are evaluated on, a judge
    # setting): only the evaluation stages run, and two stored artifacts are found unusable since
    # their cache entries were written: DPO's was deleted, and PPO's weights had 64 KiB
    # overwritten in place (same size). Both stages run again under their keys instead of
    # returning a dead URI or damaged weights.
    shutil.rmtree(second["stages"]["dpo"]["uri"])
    weights = Path(second["stages"]["ppo"]["uri"]) / "model" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(bytes(65_536))
    assert weights.stat().st_size == size
    third, log = run_flow(
        tmp_path, "ppo.kl_coef=0.1", "reward.eval_max_samples=2", "eval.title_copy_threshold=0.5", api=prefect_api
    )
    s = states(log)
    # reward.eval_* also sets which pairs DPO's implicit reward model is evaluated on
    rerun = [s.pop(name) for name in ("reward_eval", "dpo_eval", "dpo", "ppo", "evaluation")]
    assert rerun == ["Completed"] * 5 and set(s.values()) == {"Cached"}
    dpo_uri = second["stages"]["dpo"]["uri"]
    assert f"{dpo_uri} is missing or incomplete (no MANIFEST.json); running it again" in log
    assert "model/model.safetensors: SHA-256 differs from its manifest (changed in place); running it again" in log
    for stage in ("data", "sft", "reward", "reward_norm"):
        assert third["stages"][stage] == second["stages"][stage]
    assert third["stages"]["reward_eval"]["key"] != second["stages"]["reward_eval"]["key"]
    for stage in ("dpo", "ppo"):  # same settings, artifact rebuilt
        assert third["stages"][stage]["key"] == second["stages"][stage]["key"]
        assert ArtifactStore(str(tmp_path / "artifacts")).is_intact(
            third["stages"][stage]["key"], third["stages"][stage]["digest"]
        )

    # Two training processes (the GPU pools set RLHF_NPROC_PER_NODE from their `gpus` job
    # variable): the task launches SFT under torchrun, 2 gloo ranks with half the micro-batch,
    # relays rank 0's records to MLflow, and trains exactly like the single process above.
    fourth, log = run_flow(
        tmp_path, "sft.micro_batch_size=2", "--until", "sft", env={"RLHF_NPROC_PER_NODE": "2"}, api=prefect_api
    )
    assert states(log) == {"data": "Cached", "base_model": "Cached", "sft": "Completed"}
    assert "sft: 2 processes" in log and "torch.distributed.run" in log

    def losses(record: dict) -> list[float]:
        history = client.get_metric_history(record["mlflow_run_id"], "train/loss")
        return [m.value for m in sorted(history, key=lambda m: m.step)]

    assert len(losses(fourth["stages"]["sft"])) == 2
    assert losses(fourth["stages"]["sft"]) == pytest.approx(losses(first["stages"]["sft"]), rel=1e-4)
    sft_run = client.get_run(fourth["stages"]["sft"]["mlflow_run_id"])
    assert sft_run.info.status == "FINISHED" and "eval/rougeL" in sft_run.data.metrics
    assert sft_run.data.params["sft.micro_batch_size"] == "2"


EVAL_FAST = [o for o in FAST if o.startswith("eval.")]


def rlhf_evaluate(root: Path, *args: str, api: str | None = None) -> tuple[dict, str]:
    """``rlhf evaluate --preset smoke --json ARGS`` (with ``FAST``'s evaluation settings) in a subprocess on ``root``'s stores;
    it must succeed: its JSON record and its whole output."""
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "evaluate", "--preset", "smoke", "--json", *args, *EVAL_FAST],
        cwd=root,
        env=flow_env(root, api=api),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    out = result.stdout
    return json.loads(out[out.index("{\n") : out.rindex("}") + 1]), result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("smoke-flow")
def test_evaluate_two_checkpoints_and_a_registered_model_in_one_mlflow_run_and_report(first_run, prefect_api):
    root, first, _ = first_run
    sft = str(Path(first["stages"]["sft"]["uri"]) / "model")
    base = first["stages"]["base_model"]["uri"]
    registered = "models:/rlhf-tldr-policy@latest-pipeline"
    policies = ["--policy", sft, "--policy", base, "--policy", registered]
    result, log = rlhf_evaluate(root, *policies, "--out", str(root), api=prefect_api)
    assert states(log) == {"data": "Cached", "base_model": "Cached", "policy_eval": "Completed"}
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["rlhf.command"] == "evaluate" and run.info.status == "FINISHED"
    keys = {name: policy_key(name) for name in (sft, base, registered)}
    assert result["policies"] == keys
    for name, key in keys.items():
        assert run.data.params[f"policy.{key}"] == name
        for metric in ("win_rate", "win_rate_ci_low", "win_rate_ci_high", "rougeL", "response_tokens"):
            assert f"eval/{key}/{metric}" in run.data.metrics, (name, metric)
    version = client.get_model_version_by_alias("rlhf-tldr-policy", "latest-pipeline").version
    assert result["registered"][registered].endswith(f"rlhf-tldr-policy-v{version}/model")
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/report.html", "report/report.md", "report/win_rate_by_length.png"} <= artifacts
    md = Path(result["report"]).with_name("report.md").read_text()
    for name in keys:
        assert f"| {name} | " in md
    assert f"| {run.info.run_id} in sqlite:" in md.replace("| MLflow run | ", "| ")  # the report names its run
    # the same policies again: the stage comes from the cache, keyed by their files
    again, log = rlhf_evaluate(root, *policies, "--out", str(root), api=prefect_api)
    assert states(log) == {"data": "Cached", "base_model": "Cached", "policy_eval": "Cached"}
    assert again["stages"]["policy_eval"] == result["stages"]["policy_eval"]


def test_run_with_a_bad_setting_stops_before_starting_anything(tmp_path, capsys):
    from flows.cli import main

    assert main(["run", "--preset", "smoke", "eval.judge=gpt", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "rlhf run: error" in err and "eval.judge" in err
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="session")
def two_runs_at_once(tmp_path_factory) -> tuple[Path, list[str]]:
    """Two ``rlhf run --until reward_norm`` processes (``FAST``), each on a temporary Prefect
    server of its own, started together on one new run directory: the directory and their
    outputs. The ``two-at-once`` group's digest test goes on in it, after the test of the two runs."""
    root = tmp_path_factory.mktemp("two-at-once")
    argv = [sys.executable, "-m", "flows.cli", "run", "--json", "--preset", "smoke", *FAST, "--until", "reward_norm"]
    # Both create the Prefect and MLflow databases as well (no copies of migrated ones), which
    # keeps them in step until their first stage: one then computes each stage while the other
    # waits for it.
    env = flow_env(root, migrated=False, store=False)
    procs = [
        subprocess.Popen(
            [*argv, "--out", str(root)],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return root, outputs


@pytest.mark.slow
@pytest.mark.xdist_group("two-at-once")
def test_two_runs_at_once_on_one_fresh_directory_give_one_result(two_runs_at_once):
    """Two ``rlhf run`` processes started together on one new run directory: the stores are
    created once, each stage is computed by one of them while the other waits for it, and both
    return the same records; the reward model is registered once and the SFT metrics hold one
    run's records, not two interleaved."""
    tmp_path, outputs = two_runs_at_once
    results = [json.loads(out[out.index("{\n") : out.rindex("}") + 1]) for out in outputs]
    assert results[0]["stages"] == results[1]["stages"]
    assert results[0]["registered"] == results[1]["registered"] == {"rlhf-tldr-reward-model": "1"}
    assert any("waiting for" in out and "pid" in out for out in outputs)
    for stage, record in results[0]["stages"].items():
        assert [p.name for p in (tmp_path / "artifacts" / stage).iterdir()] == [record["key"].split("/")[1]]
    metrics = [json.loads(line) for line in (Path(results[0]["stages"]["sft"]["uri"]) / "metrics.jsonl").open()]
    steps = [m["step"] for m in metrics if m["kind"] == "metrics" and "train/loss" in m["metrics"]]
    assert steps == [1, 2]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(client.search_model_versions("name='rlhf-tldr-reward-model'")) == 1


@pytest.mark.parametrize(
    "setup, env, message",
    [
        (
            lambda root: (root / "artifacts").write_text("a file"),
            {},
            r"artifact root \S*artifacts \(RLHF_ARTIFACT_ROOT\) is not writable",
        ),
        (
            lambda root: None,
            {"RLHF_NPROC_PER_NODE": "3"},
            r"3 processes.*sft\.batch_size 8 is not a multiple of sft\.micro_batch_size 4 x 3",
        ),
    ],
)
@pytest.mark.heavy
def test_what_must_hold_for_the_whole_run_is_checked_before_any_stage(tmp_path, setup, env, message):
    setup(tmp_path)
    result = rlhf_run(tmp_path, env=env, timeout=600, store=False)
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert re.search(r"rlhf run: error: .*" + message, result.stderr)
    assert "Task run" not in result.stdout + result.stderr  # no stage started
    assert not (tmp_path / "work" / "data").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("two-at-once")
def test_identical_work_in_two_directories_gives_identical_digests(first_run, two_runs_at_once, prefect_api):
    """Timings, absolute paths and random dataset fingerprints stay out of a stage's digest:
    the same settings run twice from nothing, in two directories, give equal digests for every
    stage (the models are bitwise equal), so a re-run of identical work leaves downstream cached.
    The second directory is the one of the two runs at once (stages up to reward_norm), where a
    third run computes the remaining stages."""
    _, first, _ = first_run  # its record, taken before any other test used its directory
    second, log = run_flow(two_runs_at_once[0], api=prefect_api)
    s = states(log)
    assert [s.pop(name) for name in ("data", "base_model", "sft", "reward", "reward_norm")] == ["Cached"] * 5
    assert set(s.values()) == {"Completed"}
    assert list(first["stages"]) == list(STAGES)
    for stage in STAGES:
        assert first["stages"][stage]["digest"] == second["stages"][stage]["digest"], stage
        assert first["stages"][stage]["uri"] != second["stages"][stage]["uri"]


@pytest.mark.slow
def test_a_run_killed_part_way_is_ended_by_the_next(tmp_path):
    """``kill -9`` of ``rlhf run`` (with its Prefect server) leaves its MLflow runs RUNNING and its
    flow run Running; the next run on the directory marks them KILLED and Crashed, and finishes."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "--preset",
            "smoke",
            *FAST,
            "--until",
            "sft",
            "--out",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=flow_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while not (tmp_path / "work" / "sft").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    [lock] = (tmp_path / "work" / "attempts").glob("*.lock")
    dead_run, _, dead_flow_run = lock.stem.partition("__")

    result, log = run_flow(tmp_path, "--until", "sft")
    assert "had died; marked KILLED" in log
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(dead_run).info.status == "KILLED"
    assert client.get_run(result["mlflow_run_id"]).info.status == "FINISHED"
    runs = client.search_runs([client.get_run(dead_run).info.experiment_id])
    assert {r.info.status for r in runs} <= {"FINISHED", "KILLED"}  # the dead attempt's stage runs too
    assert not list((tmp_path / "work" / "attempts").glob("*.lock"))
    state = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from prefect import get_client\n"
            "with get_client(sync_client=True) as c: print(c.read_flow_run(sys.argv[1]).state.type.value)",
            dead_flow_run,
        ],
        cwd=tmp_path,
        env=flow_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert state.stdout.strip().splitlines()[-1] == "CRASHED", state.stderr[-2000:]


FLAKY_REWARD = """
from pathlib import Path

from rlhf_core.train.rule_rewards import word_count_12


def fails_on_second_call(*args):
    calls = Path(__file__).with_name("reward_calls")
    n = int(calls.read_text()) if calls.exists() else 0
    calls.write_text(str(n + 1))
    if n == 1:
        raise RuntimeError("injected failure in the second reward call")
    return word_count_12(*args)
"""


@pytest.mark.slow
def test_a_failed_stage_is_retried_and_resumes_from_its_checkpoint(tmp_path, prefect_api):
    """A PPO reward that fails once, in the second update, after the first update's checkpoint:
    Prefect retries the task (orchestration.retries) and PPO resumes from that checkpoint,
    training the second update only once. The run tracks to the store that
    ``tracking.tracking_uri`` names, not the run directory's, and ends (without ``--json``) with
    a summary: its MLflow run, each stage's artifact, and how to open the MLflow UI on that store."""
    (tmp_path / "flaky_reward.py").write_text(FLAKY_REWARD)
    elsewhere = tmp_path / "elsewhere.db"
    fresh_mlflow_store(elsewhere)
    done = rlhf_run(
        tmp_path,
        *FAST,
        "ppo.reward=python:flaky_reward:fails_on_second_call",
        "ppo.checkpoint_every=1",
        "ppo.eval_every=100",
        "orchestration.retry_delay_seconds=0",
        f"tracking.tracking_uri=sqlite:///{elsewhere}",
        "--until",
        "ppo",
        env={"PYTHONPATH": str(tmp_path)},
        api=prefect_api,
        store=False,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "injected failure in the second reward call" in log and "Retry 1/1" in log
    assert states(log)["ppo"] == "Completed"
    summary = done.stdout[done.stdout.index("rlhf run: finished; MLflow run ") :].splitlines()
    run_id = summary[0].rsplit(" ", 1)[1]
    uris = dict(line.split() for line in summary[1:] if line.startswith("  "))
    assert list(uris) == [s for s in STAGES if s in states(log)] and "ppo" in uris
    experiment = MlflowClient(f"sqlite:///{elsewhere}").get_run(run_id).info.experiment_id
    assert summary[-1] == (
        f"MLflow UI: mlflow ui --backend-store-uri sqlite:///{elsewhere}, "
        f"then http://127.0.0.1:5000/#/experiments/{experiment}/runs?workflowType=machine_learning"
    )
    for stage, uri in uris.items():
        assert Path(uri).parent == tmp_path / "artifacts" / stage and (Path(uri) / "MANIFEST.json").is_file()

    records = [json.loads(line) for line in (Path(uris["ppo"]) / "metrics.jsonl").open()]
    assert [r["metrics"]["resume/from_step"] for r in records if "resume/from_step" in r.get("metrics", {})] == [1]
    updates = [r["step"] for r in records if "objective/scores" in r.get("metrics", {})]
    assert updates == [1, 2]  # the failed attempt never finished update 2
    assert not list((tmp_path / "work" / "ppo").glob("*/checkpoints"))  # stored whole: none kept
    assert not (tmp_path / "mlflow.db").exists()  # the run directory's default store was not used
    client = MlflowClient(tracking_uri=f"sqlite:///{elsewhere}")
    parent = client.get_run(run_id)
    assert parent.info.status == "FINISHED" and parent.data.params["tracking.tracking_uri"].endswith("elsewhere.db")
    children = client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    assert sorted((r.info.run_name, r.info.status) for r in children) == sorted(
        [(stage, "FINISHED") for stage in uris] + [("ppo", "FAILED")]
    )
