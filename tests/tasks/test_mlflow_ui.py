"""The links the project prints to the MLflow UI (``make demo``, ``rlhf run``'s summary, the
run's report and Prefect artifact), opened in a real browser (tests/browser.py) against a real
MLflow server: they land on the experiment's training runs, not on the GenAI overview that
MLflow 3.x's UI opens by default. Read as a person reads the page: visible text, no pixels."""

import re

import pytest
from mlflow import MlflowClient
from mlflow.entities import Param

from tasks.mlflow_tracking import (
    MLFLOW_UI,
    TRAINING_VIEW,
    compare_link,
    experiment_id,
    experiment_link,
    ui_address,
    ui_link,
)
from tests.browser import LAPTOP


def training_view(page) -> None:
    """The experiment's navigation is the "Model training" view's (runs, models), not the GenAI
    view's (overview, judges, evaluation runs)."""
    nav = page.get_by_role("navigation")
    assert nav.get_by_role("link", name="Runs", exact=True).is_visible()
    assert nav.get_by_role("link", name="Models", exact=True).is_visible()
    for genai in ("Overview", "Judges", "Evaluation runs"):
        assert nav.get_by_role("link", name=genai, exact=True).count() == 0, f"the GenAI view: {genai}"


@pytest.mark.heavy
def test_the_printed_links_land_on_the_training_runs(mlflow_server, visit):
    client = MlflowClient(tracking_uri=mlflow_server)
    name = "rlhf-tldr-ui-links"
    exp = experiment_id(client, name)  # as the pipeline makes it
    parent = client.create_run(exp, run_name="rlhf-smoke-pipeline", tags={"rlhf.preset": "smoke"})
    for step, score in enumerate((0.1, 0.4, 0.9)):
        client.log_metric(parent.info.run_id, "evaluation/eval/ppo/score", score, step=step)
    client.log_param(parent.info.run_id, "preset", "smoke")
    child = client.create_run(exp, run_name="sft", tags={"mlflow.parentRunId": parent.info.run_id})
    client.set_terminated(child.info.run_id)
    client.set_terminated(parent.info.run_id)

    link = experiment_link(mlflow_server, name)  # what `make demo` and `rlhf run` print
    assert link == f"{mlflow_server}/#/experiments/{exp}/runs?{TRAINING_VIEW}"
    page = visit(link, LAPTOP).page
    # the runs table, with the pipeline's run by name, under the "Model training" view
    page.get_by_role("link", name="rlhf-smoke-pipeline").wait_for(timeout=30_000)
    assert page.get_by_role("heading", name="Runs").is_visible()
    assert page.get_by_text(re.compile(r"No data available|Traces: 0")).count() == 0
    training_view(page)

    page = visit(ui_link(mlflow_server, exp, parent.info.run_id), LAPTOP).page  # the run's page
    page.get_by_role("heading", name="rlhf-smoke-pipeline").wait_for(timeout=30_000)
    breadcrumb = page.get_by_role("main").get_by_role("link", name="Runs", exact=True)
    assert breadcrumb.is_visible() and page.get_by_role("link", name="Evaluations").count() == 0
    training_view(page)
    assert page.get_by_role("link", name="sft").is_visible()  # its nested stage run

    assert experiment_link(mlflow_server, "no-such-experiment") == mlflow_server


@pytest.mark.heavy
def test_the_compare_link_shows_two_runs_and_the_parameters_they_differ_in(mlflow_server, visit):
    """:func:`compare_link`, which a sweep prints for its cells, opens the MLflow UI's compare
    view: both runs by name, and with "Show diff only" the parameter that differs alone."""
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = experiment_id(client, "rlhf-tldr-compare")
    runs = []
    for seed in (1, 2):
        run = client.create_run(exp, run_name=f"smoke/seed={seed}")
        client.log_batch(run.info.run_id, params=[Param("seed", str(seed)), Param("ppo.kl_coef", "0.05")])
        client.set_terminated(run.info.run_id)
        runs.append(run.info.run_id)

    page = visit(compare_link(mlflow_server, exp, runs), LAPTOP).page
    page.get_by_role("heading", name="Comparing 2 Runs from 1 Experiment").wait_for(timeout=30_000)
    names = page.get_by_role("row").filter(has_text="Run Name:").inner_text()
    assert "smoke/seed=1" in names and "smoke/seed=2" in names
    page.get_by_role("switch", name="Parameters - Show diff only").click()
    seed = page.get_by_role("row").filter(has=page.get_by_role("rowheader", name="seed", exact=True))
    assert seed.is_visible() and seed.inner_text().split("\t")[1:] == ["1", "2"]
    assert page.get_by_role("rowheader", name="ppo.kl_coef", exact=True).count() == 0  # the same in both


def test_the_ui_of_a_store_is_its_server_without_credentials_or_mlflow_ui_over_a_local_store():
    assert ui_address("http://127.0.0.1:5000") == ("http://127.0.0.1:5000", "")
    assert ui_address("https://alice:s3cret@mlflow.example.org/ml") == ("https://mlflow.example.org/ml", "")
    assert ui_address("sqlite:///runs/smoke/mlflow.db") == (
        MLFLOW_UI,
        "mlflow ui --backend-store-uri sqlite:///runs/smoke/mlflow.db",
    )
    link = compare_link("http://127.0.0.1:5000/", "3", ["a1", "b2"])
    assert link == (
        f"http://127.0.0.1:5000/#/compare-runs?runs=%5B%22a1%22%2C%22b2%22%5D&experiments=%5B%223%22%5D&{TRAINING_VIEW}"
    )
