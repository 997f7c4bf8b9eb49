"""The registered models as MLflow models, saved and loaded through MLflow's own code."""

import logging
import os
import shutil
import warnings

import datasets
import mlflow
import pandas as pd
import pytest
import torch

from rlhf_core.config.presets import load_config
from rlhf_core.data.prepared import load_data_tokenizer
from rlhf_core.train.reward import ScalarModel, get_reward
from tasks.mlflow_models import _EXPECTED_MESSAGES, _without_expected_messages, save_policy_model, save_reward_model


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def mlflow_messages():
    """Every warning and every record of MLflow's loggers while a test runs."""
    handler = _Records()
    logging.getLogger("mlflow").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: handler.messages + [str(w.message) for w in caught]
    logging.getLogger("mlflow").removeHandler(handler)


def _expected_in(messages: list[str]) -> list[str]:
    return [m for m in messages if any(e in m for e in _EXPECTED_MESSAGES)]


def test_saving_is_quiet_about_what_asks_nothing_of_the_user_only(mlflow_messages):
    with _without_expected_messages():
        warnings.warn("Hint: Inferred schema contains integer column(s). ...", UserWarning, stacklevel=1)
        logging.getLogger("mlflow.transformers").warning("The model card could not be retrieved from the hub")
        warnings.warn("something else", UserWarning, stacklevel=1)
        logging.getLogger("mlflow.store").warning("another thing")
    assert mlflow_messages() == ["another thing", "something else"]


@pytest.fixture(scope="module")
def rows(smoke_stages):
    return datasets.load_from_disk(str(smoke_stages / "data" / "sft" / "validation")).select(range(6))


def test_the_reward_model_pyfunc_scores_rows_as_the_pipeline_does(smoke_stages, rows, tmp_path, mlflow_messages):
    cfg = load_config("smoke")
    shutil.copytree(smoke_stages / "rm", tmp_path / "rm_dir")  # a stage's model/: weights and tokenizer
    load_data_tokenizer(smoke_stages / "data").save_pretrained(tmp_path / "rm_dir")
    save_reward_model(tmp_path / "rm_dir", tmp_path / "rm", cfg, smoke_stages / "data")
    assert not _expected_in(mlflow_messages())
    scorer = mlflow.pyfunc.load_model(str(tmp_path / "rm"))
    frame = pd.DataFrame({k: rows[k] for k in ("post", "summary", "subreddit", "title")})
    scores = scorer.predict(frame)
    model = ScalarModel.from_pretrained(smoke_stages / "rm")
    with torch.no_grad():
        expected = get_reward(model, torch.tensor(rows["query_reference_response_token"]), model.config.pad_token_id)[1]
    assert list(scores.columns) == ["score"] and len(scores) == len(rows)
    assert scores["score"].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    # subreddit and title are optional; a missing one is an empty field, as in the data stage
    alone = scorer.predict(frame[["post", "summary"]].iloc[:2])
    assert alone["score"].tolist() != pytest.approx(scores["score"].tolist()[:2], abs=1e-6)
    with pytest.raises(Exception, match="summary"):
        scorer.predict(frame[["post"]])  # the signature requires a summary


@pytest.mark.heavy
def test_an_existing_reward_model_pyfunc_scores_through_its_own_tokenizer(rows, llama_tokenizer, tmp_path):
    """``ppo.reward: model:DIR``: the registered model is the existing checkpoint, whose own
    tokenizer builds the queries; its scores are ``transformers``' own on the chat template's texts."""
    from rlhf_core.data.prepare import truncate_query
    from rlhf_core.train.external_reward import import_reward_model
    from tests.rlhf_core.train.test_external_reward import CHAT_TEMPLATE, direct_scores, save_llama_reward_model

    save_llama_reward_model(tmp_path / "source", llama_tokenizer, CHAT_TEMPLATE)
    cfg = load_config("smoke", [f"ppo.reward=model:{tmp_path / 'source'}"])
    import_reward_model(cfg.ppo.reward, tmp_path / "reward")
    save_reward_model(tmp_path / "reward" / "model", tmp_path / "rm", cfg, None)
    scores = mlflow.pyfunc.load_model(str(tmp_path / "rm")).predict(
        pd.DataFrame({k: rows[k] for k in ("post", "summary", "subreddit", "title")})
    )
    fields = [{k: rows[k][i] for k in ("post", "subreddit", "title")} for i in range(len(rows))]
    queries = [truncate_query(f, llama_tokenizer, cfg.data.tldr_format)[0] for f in fields]
    expected = direct_scores(tmp_path / "source", queries, rows["summary"])
    assert scores["score"].tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_the_policy_is_a_transformers_text_generation_model(smoke_stages, rows, tmp_path, mlflow_messages, monkeypatch):
    cfg = load_config("smoke", ["eval.temperature=0.01"])
    # MLflow's shard size made smaller than the model: the weights are still the stage's one
    # file, byte for byte (which a local artifact store then keeps once), and the setting is back
    monkeypatch.setenv("MLFLOW_HUGGINGFACE_MODEL_MAX_SHARD_SIZE", "1MB")
    save_policy_model(smoke_stages / "base", tmp_path / "policy", cfg, smoke_stages / "data")
    assert os.environ["MLFLOW_HUGGINGFACE_MODEL_MAX_SHARD_SIZE"] == "1MB"
    [weights] = (tmp_path / "policy").rglob("*.safetensors")
    assert weights.read_bytes() == (smoke_stages / "base" / "model.safetensors").read_bytes()
    assert not _expected_in(mlflow_messages())
    info = mlflow.models.get_model_info(str(tmp_path / "policy"))
    assert info.flavors["transformers"]["task"] == "text-generation"
    assert info.metadata["prompt_format"] == cfg.data.tldr_format.template
    policy = mlflow.pyfunc.load_model(str(tmp_path / "policy"))
    summaries = policy.predict(rows["query"][:2])
    assert len(summaries) == 2 and all(isinstance(s, str) and not s.startswith("SUBREDDIT") for s in summaries)
