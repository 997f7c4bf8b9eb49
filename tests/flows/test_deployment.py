"""End to end on loopback: `make stack-up`'s script starts a real Prefect server, MLflow server
and process worker and deploys `rlhf/full-pipeline`; the smoke preset then runs through
`prefect deployment run`, is killed during PPO, and resumes on a second process worker with
another PREFECT_HOME, with finished stages cached.
The artifact root is an S3 bucket on a real S3 API server (moto): each run passes its artifact
root and work directory as job variables. (A local artifact root, cached across a fresh
PREFECT_HOME and resumed after a kill, is tested through `rlhf run`: tests/flows/test_pipeline.py.)"""

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tasks.mlflow_tracking import TRAINING_VIEW, compare_link, experiment_link, ui_link
from tasks.storage import ArtifactStore
from tests.browser import LAPTOP, close_mlflow_assistant
from tests.servers import free_port, fresh_mlflow_store, fresh_prefect_home

# Two groups, each run by one test process (the group's tests read what its first left in that
# process): the deployment run and its checks in the browser; the sweep's deployment run and its
# compare view. Each process that runs either starts one server stack (`server_stack`). pytest-xdist
# hands out the larger group first, and a process with two tests or fewer left another group:
# the sweep's, the shorter, is then followed by the first pipeline run of tests/flows/test_pipeline.py.
DEPLOYMENT = pytest.mark.xdist_group("server-stack")
SWEEP = pytest.mark.xdist_group("sweep-stack")

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
OVERRIDES = [
    "sft.max_steps=1",
    "sft.eval_max_samples=2",
    "reward.max_steps=1",
    "reward.eval_max_samples=4",
    "ppo.batch_size=4",
    "ppo.micro_batch_size=4",
    "ppo.total_episodes=24",
    "ppo.checkpoint_every=1",
    "ppo.eval_every=100",
    "ppo.eval_max_samples=2",
    "eval.max_samples=2",
    "dpo.max_steps=1",
    "eval.max_comparisons=8",
    "eval.diversity_prompts=1",
    "eval.diversity_samples=2",
    "eval.token_shift_samples=1",
]
STAGES = ["data", "base_model", "sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval", "evaluation"]
#: What a run killed during PPO had not finished.
UNFINISHED = ("ppo", "dpo", "dpo_eval", "evaluation")
#: The registered models a pipeline run leaves, each with the alias of its newest version.
MODELS = ("rlhf-tldr-policy", "rlhf-tldr-reward-model", "rlhf-tldr-dpo-policy")
#: What the deployment run leaves for the checks in the browser: its stack's environment,
#: MLflow experiment and run, resumed flow run and report (set once the run has passed its checks).
FINISHED: dict = {}
#: What the sweep's deployment run leaves for the compare view: the link its summary gives, its
#: cells' run names and the parameters in which they differ, with their values.
SWEPT: dict = {}


@pytest.fixture(scope="session")
def server_stack(tmp_path_factory):
    """One stack (Prefect server, MLflow server, worker, deployment) for the tests of this
    module that run in this test process; session-scoped, so that a test process which runs
    other tests between them does not stop and start it again."""
    root = tmp_path_factory.mktemp("stack")
    fresh_prefect_home(root / "stack" / "prefect")  # the servers' databases, migrated already
    fresh_mlflow_store(root / "stack" / "mlflow.db")
    env = {
        **os.environ,
        "STACK_DIR": str(root / "stack"),
        "PREFECT_PORT": str(free_port()),
        "MLFLOW_PORT": str(free_port()),
        "VENV": str(BIN.parent),
        # a task that finds no free slot under a tag concurrency limit asks again after 1 s, not
        # 30; a worker asks the server for scheduled flow runs every second, not every 10
        "PREFECT_TASK_RUN_TAG_CONCURRENCY_SLOT_WAIT_SECONDS": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
    }
    up = subprocess.run([str(REPO / "infra" / "stack.sh"), "up"], env=env, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{env['PREFECT_PORT']}/api"
    env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{env['MLFLOW_PORT']}"
    yield env
    subprocess.run([str(REPO / "infra" / "stack.sh"), "down"], env=env, capture_output=True, timeout=120)
    pids = list((root / "stack").glob("*.pid"))
    assert not pids, f"stack-down left {pids}"


@pytest.fixture
def stack(server_stack, moto_s3, tmp_path):
    """The stack's environment plus an artifact root in the S3 bucket and a local work
    directory, which reach the flow-run process as job variables of each deployment run."""
    job_env = {"RLHF_WORK_DIR": str(tmp_path / "work"), "PREFECT_LOGGING_EXTRA_LOGGERS": "rlhf_core"}
    job_env.update(
        {
            k: os.environ[k]
            for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
        }
    )
    job_env["RLHF_ARTIFACT_ROOT"] = f"s3://{moto_s3['bucket']}/e2e-{tmp_path.name}"
    return {**server_stack, **job_env, "JOB_ENV": json.dumps(job_env), "EXPERIMENT": "e2e-s3"}


def deployment_run(env: dict, *extra: str, watch: bool = True) -> subprocess.CompletedProcess:
    overrides = OVERRIDES + [f"tracking.experiment_name={env['EXPERIMENT']}"] + list(extra)
    cmd = [
        str(BIN / "prefect"),
        "deployment",
        "run",
        "rlhf/full-pipeline",
        "--param",
        "preset=smoke",
        "--params",
        json.dumps({"overrides": overrides}),
        "--job-variable",
        "env=" + env["JOB_ENV"],
    ]
    if not watch:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return subprocess.run(
        cmd + ["--watch", "--watch-timeout", "1200"], env=env, capture_output=True, text=True, timeout=1300
    )


def task_states(output: str) -> dict[str, str]:
    states = {}
    for state, name in re.findall(r"prefect\.task-run\.(\w+) \* ([\w-]+)", output):
        if name in STAGES:  # events of a pending task carry its default name, rlhf-stage-...
            states[name] = state
    return states


def manifests(env: dict) -> dict[str, str]:
    store = ArtifactStore(env["RLHF_ARTIFACT_ROOT"])
    store.fs.invalidate_cache()  # s3fs keeps directory listings: a stage written since would be missed
    found = {}
    for path in store.fs.glob(f"{store.base}/*/*/MANIFEST.json"):
        stage = path.rsplit("/", 3)[-3]
        with store.fs.open(path, "r") as fh:
            found[stage] = fh.read()
    return found


def stack_sh(env: dict, *args: str, **extra_env: str) -> None:
    done = subprocess.run(
        [str(REPO / "infra" / "stack.sh"), *args], env={**env, **extra_env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def flow_run_id(output: str) -> str:
    return re.search(r"UUID: ([0-9a-f-]{36})", output).group(1)


def kill_flow_run(env: dict) -> None:
    worker = psutil.Process(int((Path(env["STACK_DIR"]) / "worker.pid").read_text()))
    victims = worker.children(recursive=True)
    assert victims, "no flow-run process under the worker"
    for proc in victims:
        proc.kill()
    psutil.wait_procs(victims, timeout=30)


@DEPLOYMENT
@pytest.mark.slow
def test_deployment_runs_caches_resumes_and_tracks(stack):
    env = stack
    started = deployment_run(env, watch=False)
    assert started.returncode == 0, started.stdout + started.stderr
    work = Path(env["RLHF_WORK_DIR"])
    deadline = time.time() + 900
    # the newest checkpoint alone is kept (ppo.keep_checkpoints 1): any after update 2
    while not list(work.glob("ppo/*/checkpoints/step-00000[2-6]/state.pt")) and time.time() < deadline:
        time.sleep(0.2)
    assert list(work.glob("ppo/*/checkpoints/step-00000[2-6]/state.pt")), "PPO never checkpointed"
    kill_flow_run(env)
    before = manifests(env)
    assert set(before) == set(STAGES) - set(UNFINISHED)

    # The resumed flow run goes to a second worker with an empty PREFECT_HOME, as a fresh
    # container or another machine would have: the finished stages' cache entries are in the
    # artifact store (local or S3), not in the first worker's home.
    stack_dir = Path(env["STACK_DIR"])
    stack_sh(env, "stop", "worker")
    second_home = work.parent / "worker-2-home"
    stack_sh(env, "worker", "worker-2", WORKER_HOME=str(second_home))
    try:
        resumed = deployment_run(env)
    finally:
        stack_sh(env, "stop", "worker-2")
        stack_sh(env, "worker", "worker", WORKER_HOME=str(stack_dir / "prefect"))  # as `up` left it
    assert resumed.returncode == 0 and "Completed" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    first_log, second_log = (stack_dir / "worker.log").read_text(), (stack_dir / "worker-2.log").read_text()
    assert flow_run_id(started.stdout) in first_log and flow_run_id(resumed.stdout) in second_log
    assert flow_run_id(resumed.stdout) not in first_log
    states = task_states(resumed.stdout)
    assert states == {s: "Completed" if s in UNFINISHED else "Cached" for s in STAGES}
    after = manifests(env)
    for stage, text in before.items():
        assert after[stage] == text, f"{stage} artifact changed"  # byte-identical (same SHA-256s)
    assert re.search(re.escape(env["RLHF_WORK_DIR"]) + r"/ppo/\w+/checkpoints/step-00000[2-6]", second_log)

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(env["EXPERIMENT"])
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    finished = {r.info.run_name: r for r in children if r.info.status == "FINISHED"}
    assert set(finished) == set(STAGES)
    assert "eval/rougeL" in finished["sft"].data.metrics and "objective/kl" in finished["ppo"].data.metrics
    assert len(client.get_metric_history(finished["ppo"].info.run_id, "objective/scores")) >= 2
    assert {p.info.status for p in parents} >= {"FINISHED"}
    done = next(p for p in parents if p.info.status == "FINISHED")
    assert done.data.tags["rlhf.stage_run.sft"] == finished["sft"].info.run_id
    assert done.data.tags["prefect.flow_run_id"]
    assert "report/report.html" in {f.path for f in client.list_artifacts(done.info.run_id, "report")}
    assert done.data.tags["rlhf.artifact.ppo"].startswith(env["RLHF_ARTIFACT_ROOT"] + "/ppo/")
    for name, stage in (("rlhf-tldr-policy", "ppo"), ("rlhf-tldr-reward-model", "reward_norm")):
        version = client.get_model_version_by_alias(name, "latest-pipeline")
        assert version.tags["rlhf.digest"] == json.loads(after[stage])["digest"]
    # The flow run's markdown artifact in the Prefect UI: stages, win rates, MLflow run, report.
    inspect = subprocess.run(
        [str(BIN / "prefect"), "artifact", "inspect", "rlhf-run-smoke", "--limit", "1", "-o", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    markdown = json.loads(inspect.stdout)[0]["data"]
    assert f"/#/experiments/{experiment.experiment_id}/runs/{done.info.run_id}" in markdown
    assert "| ppo | win rate" not in markdown and re.search(r"\| ppo \| \d+\.\d% \[", markdown)
    assert f"Report: {env['RLHF_WORK_DIR']}/reports/{done.info.run_id}/report.html" in markdown
    FINISHED.update(
        env=env,
        experiment_id=experiment.experiment_id,
        run=done,
        flow_run_id=flow_run_id(resumed.stdout),
        report=Path(env["RLHF_WORK_DIR"]) / "reports" / done.info.run_id / "report.html",
    )


@DEPLOYMENT
@pytest.mark.heavy
def test_the_sweep_is_deployed_beside_the_pipeline(server_stack):
    """`make stack-up` deploys `rlhf/sweep` (infra/prefect.yaml) from flows/sweep.py, its
    default spec the one that runs on a CPU."""
    done = subprocess.run(
        [str(BIN / "prefect"), "deployment", "inspect", "rlhf/sweep", "--output", "json"],
        env=server_stack,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    deployment = json.loads(done.stdout[done.stdout.index("{") :])
    assert deployment["entrypoint"] == "flows/sweep.py:sweep"
    assert deployment["parameters"] == {"spec": "cpu-seeds", "overrides": []}
    assert deployment["work_pool_name"] == "rlhf-process"


@SWEEP
@pytest.mark.slow
def test_a_sweep_runs_its_cells_at_once_on_the_workers_one_model_stage_at_a_time(server_stack, tmp_path):
    """`rlhf/sweep` with 2 cells at a time and a spec that sets a `gpu` tag limit of 1: each cell
    is its own flow run of `rlhf/full-pipeline` in the worker's processes, linked to the sweep's;
    the cells' runs overlap in time, no two model stages do (the server's limit holds across
    processes), the stages the cells share run once, and the summary holds every cell."""
    import yaml

    spec = yaml.safe_load((REPO / "configs" / "sweeps" / "smoke-seeds.yaml").read_text())
    spec |= {"name": "smoke-seeds-at-once", "max_concurrent": 2, "concurrency_limits": {"gpu": 1}}
    spec["overrides"].append("tracking.experiment_name=e2e-sweep")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    job_env = {"RLHF_WORK_DIR": str(tmp_path / "work"), "RLHF_ARTIFACT_ROOT": str(tmp_path / "artifacts")}
    cmd = [str(BIN / "prefect"), "deployment", "run", "rlhf/sweep", "--param", f"spec={tmp_path / 'spec.yaml'}"]
    cmd += ["--job-variable", "env=" + json.dumps(job_env | {"PREFECT_LOGGING_EXTRA_LOGGERS": "rlhf_core"})]
    try:
        done = subprocess.run(
            cmd + ["--watch", "--watch-timeout", "1500"], env=server_stack, capture_output=True, text=True, timeout=1600
        )
        assert done.returncode == 0 and "Completed" in done.stdout, (done.stdout + done.stderr)[-4000:]
        sweep_id = flow_run_id(done.stdout)
        api = server_stack["PREFECT_API_URL"]
        import httpx

        cell_names = ["smoke/seed=1", "smoke/seed=2"]
        found = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": cell_names}}}).json()
        assert sorted(r["name"] for r in found) == cell_names
        deployment = httpx.get(f"{api}/deployments/name/rlhf/full-pipeline").json()
        for run in found:  # a run of the pipeline's deployment, on a worker, linked to the sweep
            assert run["deployment_id"] == deployment["id"] and run["state_type"] == "COMPLETED"
            assert run["parent_task_run_id"] is not None and run["id"] != sweep_id
        limit = httpx.get(f"{api}/concurrency_limits/tag/gpu").json()
        assert limit["concurrency_limit"] == 1  # set by the spec, the server had none
    finally:
        subprocess.run([str(BIN / "prefect"), "concurrency-limit", "delete", "gpu"], env=server_stack, timeout=120)

    client = MlflowClient(tracking_uri=server_stack["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("e2e-sweep")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    sweep_run = next(r for r in runs if r.data.tags.get("rlhf.sweep") == "smoke-seeds-at-once")
    assert sweep_run.info.status == "FINISHED" and sweep_run.data.params["max_concurrent"] == "2"
    cells = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == sweep_run.info.run_id]
    assert sorted(r.data.tags["rlhf.sweep_cell"] for r in cells) == ["smoke/seed=1", "smoke/seed=2"]
    assert max(r.info.start_time for r in cells) < min(r.info.end_time for r in cells)  # both in flight at once
    stages = [r for r in runs if "rlhf.stage" in r.data.tags]
    assert Counter(r.data.tags["rlhf.stage"] for r in stages) == {
        s: 1 if s in ("data", "base_model") else 2 for s in STAGES
    }
    timed = sorted((r.info.start_time, r.info.end_time, r.data.tags["rlhf.stage"]) for r in stages)
    model_stages = [t for t in timed if t[2] not in ("data", "base_model")]
    for before, after in zip(model_stages, model_stages[1:]):
        assert before[1] <= after[0], (before, after)  # one model stage at a time
    # the summary's values are the cells' own, read back from their runs
    summary = Path(client.download_artifacts(sweep_run.info.run_id, "summary/cells.json", str(tmp_path / "dl")))
    rows = json.loads(summary.read_text())["cells"]
    for row in rows:
        cell_run = next(r for r in cells if r.data.tags["rlhf.sweep_cell"] == row["cell"])
        assert row["mlflow_run_id"] == cell_run.info.run_id and row["error"] is None
        assert row["PPO KL"] == pytest.approx(cell_run.data.metrics["ppo/objective/kl"], rel=1e-12)
        assert row["SFT ROUGE-L"] == pytest.approx(cell_run.data.metrics["sft/eval/rougeL"], rel=1e-12)
    # the summary in the Prefect UI links the cells side by side in the MLflow UI's compare view
    import httpx

    found = httpx.post(
        f"{server_stack['PREFECT_API_URL']}/artifacts/filter",
        json={"artifacts": {"key": {"any_": ["sweep-smoke-seeds-at-once"]}}},
    ).json()
    link = re.search(r"\[The cells side by side in the MLflow UI\]\((.+)\)", found[0]["data"]).group(1)
    cells.sort(key=lambda r: r.data.tags["rlhf.sweep_cell"])
    ids = [r.info.run_id for r in cells]
    assert link == compare_link(server_stack["MLFLOW_TRACKING_URI"], exp.experiment_id, ids)
    params = [c.data.params for c in cells]
    differ = {k: tuple(p.get(k) for p in params) for k in set(params[0]) | set(params[1])}
    SWEPT.update(
        link=link,
        names=[c.info.run_name for c in cells],
        differ={k: v for k, v in differ.items() if v[0] != v[1]},
        same=sorted(k for k, v in differ.items() if v[0] == v[1]),
    )
    assert SWEPT["differ"]["seed"] == ("1", "2")


@DEPLOYMENT
@pytest.mark.slow
def test_the_smoke_run_reads_well_in_the_mlflow_and_prefect_uis(visit):
    """The deployment run above as a person finds it in a browser (tests/browser.py), read by
    visible text and roles, no pixels: in the MLflow UI's training view, the pipeline run with
    its metrics, parameters, report and ten stage runs, and the registered models each with its
    alias; in the Prefect UI, the deployment and the resumed flow run's stages with their states.
    With ``RLHF_SCREENSHOTS`` set to a folder, the pages are also saved there as PNGs
    (``make screenshots``)."""
    if not FINISHED:
        pytest.skip("needs the deployment run of test_deployment_runs_caches_resumes_and_tracks, in the same process")
    env, run = FINISHED["env"], FINISHED["run"]
    mlflow_url, prefect_url = env["MLFLOW_TRACKING_URI"], env["PREFECT_API_URL"].removesuffix("/api")
    shots = os.environ.get("RLHF_SCREENSHOTS")

    def seen(page, name: str) -> None:
        if shots:
            page.screenshot(path=str(Path(shots) / f"{name}.png"), animations="disabled")

    report = visit(FINISHED["report"].as_uri(), LAPTOP).page  # read in full in tests/rlhf_core/views
    assert report.get_by_role("heading", name=re.compile("^Does it learn")).is_visible()
    seen(report, "report")

    # MLflow: the experiment's training runs, both pipeline runs' stages under them; the pages
    # after it open in the same browser, which has closed the Assistant panel (as a user does once)
    page = visit(experiment_link(mlflow_url, env["EXPERIMENT"]), LAPTOP).page
    page.get_by_role("link", name=run.info.run_name).wait_for(timeout=30_000)
    close_mlflow_assistant(page)
    assert page.get_by_role("heading", name="Runs").is_visible()
    parents = page.get_by_role("row").filter(has=page.get_by_role("link", name=re.compile("^smoke-")))
    assert parents.count() == 2  # the run killed during PPO, and the resumed one
    for row in parents.all():
        row.get_by_role("button").first.click()  # the [+] that shows its nested runs
    page.get_by_role("link", name="evaluation", exact=True).wait_for(timeout=30_000)
    main = page.get_by_role("main")
    shown = {stage for stage in STAGES if main.get_by_role("link", name=stage, exact=True).first.is_visible()}
    assert shown == set(STAGES)
    seen(page, "mlflow-experiment")

    # the pipeline run's page: metrics, parameters, its own stage runs, the report among its artifacts
    page.goto(ui_link(mlflow_url, FINISHED["experiment_id"], run.info.run_id))
    page.get_by_role("heading", name=run.info.run_name).wait_for(timeout=30_000)
    assert page.get_by_text(re.compile(r"^Metrics \(\d+\)$")).is_visible()
    assert page.get_by_text(re.compile(r"^Parameters \(\d+\)$")).is_visible()
    assert page.get_by_role("cell", name="ppo/objective/kl", exact=True).is_visible()
    assert page.get_by_role("cell", name="eval.max_samples", exact=True).is_visible()
    for stage in UNFINISHED:  # the stages this run ran; the others came from cache, run by the first
        assert page.get_by_role("link", name=stage, exact=True).is_visible()
    seen(page, "mlflow-run")
    page.get_by_role("tab", name="Model metrics").click()  # the training curves, as charts
    section = page.get_by_text("ppo/objective", exact=True).first  # a group of charts, one per metric
    section.wait_for(state="attached", timeout=30_000)
    section.scroll_into_view_if_needed()
    assert section.is_visible()
    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("report", exact=True).wait_for(timeout=30_000)

    # the registered models, each with the alias of its newest version, in sight once the note
    # MLflow shows over the page on a first visit (on its new registry UI) is closed
    page.goto(f"{mlflow_url}/#/models?{TRAINING_VIEW}")
    page.get_by_role("link", name=MODELS[0]).wait_for(timeout=30_000)
    note = page.get_by_role("dialog").filter(has_text="Model Registry UI")
    note.or_(page.get_by_role("row").nth(len(MODELS))).first.wait_for(timeout=30_000)
    if note.is_visible():
        note.get_by_role("button", name="Close").click()
        note.wait_for(state="hidden", timeout=30_000)
    for name in MODELS:
        row = page.get_by_role("row").filter(has=page.get_by_role("link", name=name, exact=True))
        assert row.count() == 1, name
        assert re.search(r"@\s*latest-pipeline\s*: Version \d+", row.inner_text()), f"{name}: no alias shown"
        alias = row.get_by_text("latest-pipeline").first
        box = alias.bounding_box()
        assert alias.is_visible() and box["x"] + box["width"] <= LAPTOP["width"], f"{name}: the alias out of sight"
    assert page.get_by_role("dialog").count() == 0
    seen(page, "mlflow-models")

    # Prefect: the deployment, and the resumed flow run's stages with their states
    page = visit(f"{prefect_url}/deployments", LAPTOP).page
    page.get_by_role("link", name="full-pipeline", exact=True).wait_for(timeout=30_000)
    page = visit(f"{prefect_url}/runs/flow-run/{FINISHED['flow_run_id']}", LAPTOP).page
    page.get_by_text("Task Runs", exact=True).first.click()
    page.get_by_text(re.compile(r"^10 Task runs$")).first.wait_for(timeout=30_000)
    for stage in STAGES:  # each stage's task run, by name, once the list has loaded
        page.get_by_role("link", name=stage, exact=True).wait_for(timeout=30_000)
    listed = page.get_by_text(re.compile(r"^10 Task runs$")).first.locator("xpath=ancestor::*[.//input][1]")
    text = listed.inner_text()
    states = dict(re.findall(r"^(\w+)\n(?:gpu\n)?(Completed|Cached|Failed|Crashed|Running)$", text, re.MULTILINE))
    assert states == {s: "Completed" if s in UNFINISHED else "Cached" for s in STAGES}, text
    seen(page, "prefect-flow-run")


@SWEEP
@pytest.mark.slow
def test_the_sweeps_cells_read_side_by_side_in_mlflows_compare_view(visit):
    """The link the sweep's summary gives (its Prefect artifact, ``rlhf sweep``'s last line)
    opens the MLflow UI's compare view of its two cells: both runs by name, and with "Show diff
    only" the parameters in which they differ, with each cell's value, and none of the others."""
    if not SWEPT:
        pytest.skip("needs the sweep's deployment run of test_a_sweep_runs_its_cells_at_once..., in the same process")
    page = visit(SWEPT["link"], LAPTOP).page
    page.get_by_role("heading", name="Comparing 2 Runs from 1 Experiment").wait_for(timeout=30_000)
    close_mlflow_assistant(page)
    names = page.get_by_role("row").filter(has_text="Run Name:").inner_text()
    assert all(name in names for name in SWEPT["names"]), names
    page.get_by_role("switch", name="Parameters - Show diff only").click()
    for key, values in SWEPT["differ"].items():
        row = page.get_by_role("row").filter(has=page.get_by_role("rowheader", name=key, exact=True))
        assert row.is_visible() and row.inner_text().split("\t")[1:] == list(values), key
    for key in SWEPT["same"]:
        assert page.get_by_role("rowheader", name=key, exact=True).count() == 0, f"{key}: the same in both, yet shown"
    if os.environ.get("RLHF_SCREENSHOTS"):
        page.get_by_text("Parameters", exact=True).first.scroll_into_view_if_needed()
        page.screenshot(path=str(Path(os.environ["RLHF_SCREENSHOTS"]) / "mlflow-compare.png"), animations="disabled")
