"""The links the project prints to the MLflow UI (``make demo``, ``rlhf run``'s summary, the
run's report and Prefect artifact), opened in a real browser (tests/browser.py) against a real
MLflow server: they land on the experiment's training runs, not on the GenAI overview that
MLflow 3.x's UI opens by default. Read as a person reads the page: visible text, no pixels."""

import re

from mlflow import MlflowClient

from tasks.mlflow_tracking import TRAINING_VIEW, experiment_id, experiment_link, ui_link
from tests.browser import LAPTOP


def training_view(page) -> None:
    """The experiment's navigation is the "Model training" view's (runs, models), not the GenAI
    view's (overview, judges, evaluation runs)."""
    nav = page.get_by_role("navigation")
    assert nav.get_by_role("link", name="Runs", exact=True).is_visible()
    assert nav.get_by_role("link", name="Models", exact=True).is_visible()
    for genai in ("Overview", "Judges", "Evaluation runs"):
        assert nav.get_by_role("link", name=genai, exact=True).count() == 0, f"the GenAI view: {genai}"


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
