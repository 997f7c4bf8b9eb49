"""The registered models as MLflow models, loadable with ``mlflow.pyfunc.load_model``:

- the policy (``rlhf-tldr-policy``) in MLflow's ``transformers`` flavor, task
  ``text-generation``: ``predict`` takes TL;DR prompts (the query format is in the model's
  metadata as ``prompt_format``) and returns the summaries. It samples with the pipeline's
  settings (``model_config``), not with the PPO rollout's (PAD suppressed, fixed response
  length: :func:`rlhf_core.train.generation.generate`).
- the DPO policy (``rlhf-tldr-dpo-policy``), the same way.
- the normalised reward model (``rlhf-tldr-reward-model``) as a pyfunc, :class:`RewardModelScorer`:
  ``predict`` takes a DataFrame with the columns ``post`` and ``summary`` (and optionally
  ``subreddit`` and ``title``) and returns a column ``score``, the reward the pipeline gives
  the summary (query formatted and truncated as the data stage does, Details 1-3; summary
  ending with EOS; score at the EOS, Detail 12).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, Schema

from rlhf_core.config.settings import PipelineConfig

#: What MLflow says on every save of these models that asks nothing of the user: the policy
#: comes from a local folder (no hub model card or licence to read), its generation settings
#: are integers, and the reward model is a Python object with a fixed signature.
_EXPECTED_MESSAGES = (
    "model card could not be retrieved",
    "Unable to find license information",
    "Inferred schema contains integer column",
    "An input example was not provided",
    "Passing a Python object as `python_model`",
)


class _DropExpected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in record.getMessage() for m in _EXPECTED_MESSAGES)


@contextmanager
def _without_expected_messages() -> Iterator[None]:
    """Silence :data:`_EXPECTED_MESSAGES` (warnings and MLflow's log records) and nothing else."""
    # a logger's filters see only its own records: every MLflow module's logger gets one
    names = {n for n in list(logging.Logger.manager.loggerDict) if n.split(".")[0] == "mlflow"}
    loggers = [logging.getLogger(n) for n in names | {"mlflow.transformers", "mlflow.pyfunc", "mlflow.models"}]
    dropper = _DropExpected()
    with warnings.catch_warnings():
        for message in _EXPECTED_MESSAGES:
            warnings.filterwarnings("ignore", message=f".*{message}")
        for logger in loggers:
            logger.addFilter(dropper)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(dropper)


def _requirements() -> list[str]:
    """What a loaded model needs, at this environment's versions (stated, not inferred: inferring
    loads the model in a subprocess)."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("torch", "transformers", "mlflow", "pandas")]


@contextmanager
def _shards_as_the_stages_write_them() -> Iterator[None]:
    """MLflow's shard size for the weights it saves (``MLFLOW_HUGGINGFACE_MODEL_MAX_SHARD_SIZE``,
    500MB unless set) set to ``save_pretrained``'s own default, with which the stages write their
    models: the logged weights are then the stage's file byte for byte, which a local artifact
    store keeps once (:func:`tasks.mlflow_tracking.register_model_version`)."""
    import inspect

    from transformers import PreTrainedModel

    name = "MLFLOW_HUGGINGFACE_MODEL_MAX_SHARD_SIZE"
    default = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    before = os.environ.get(name)
    os.environ[name] = str(default)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def save_policy_model(
    model_dir: str | os.PathLike,
    path: str | os.PathLike,
    cfg: PipelineConfig,
    data_dir: str | os.PathLike,
    method: str = "PPO",
) -> None:
    """Write the policy in ``model_dir`` (a causal LM with its tokenizer) to ``path`` as an
    MLflow ``transformers`` model for text generation: at most PPO's response length new tokens
    (``ppo.response_length``, else the SFT response length of the data in ``data_dir``) at
    ``eval.temperature``, only the summary returned; the TL;DR prompt format and the EOS token
    are in its metadata, with ``method`` (``"PPO"`` or ``"DPO"``) naming how it was trained."""
    import json

    import mlflow.transformers
    from transformers import AutoTokenizer

    from rlhf_core.models.saved import load_causal_lm

    stats = json.loads((Path(data_dir) / "stats.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with _without_expected_messages(), _shards_as_the_stages_write_them():
        mlflow.transformers.save_model(
            {"model": load_causal_lm(model_dir), "tokenizer": tokenizer},
            path=str(path),
            task="text-generation",
            model_config={
                "max_new_tokens": cfg.ppo.response_length or stats["padded_lengths"]["sft_response"],
                "do_sample": True,
                "temperature": cfg.eval.temperature,
                "return_full_text": False,
            },
            metadata={
                # TRL-format data: the prompt as given, or a conversation through the chat template
                "prompt_format": cfg.data.tldr_format.template if cfg.data.format == "tldr" else "trl",
                "max_query_tokens": (
                    cfg.data.tldr_format.max_query_length
                    if cfg.data.format == "tldr"
                    else cfg.data.trl_max_query_length
                ),
                "eos_token": tokenizer.eos_token,
                "source": f"rlhf-tldr {method} policy (Huang et al. 2024, arXiv:2403.17031)",
            },
            pip_requirements=_requirements(),
        )


#: The reward model's input and output columns.
REWARD_SIGNATURE = ModelSignature(
    inputs=Schema(
        [
            ColSpec("string", "post"),
            ColSpec("string", "summary"),
            ColSpec("string", "subreddit", required=False),
            ColSpec("string", "title", required=False),
        ]
    ),
    outputs=Schema([ColSpec("double", "score")]),
)


class RewardModelScorer(mlflow.pyfunc.PythonModel):
    """The reward model as a pyfunc: (post, summary) rows in, their scores out.

    ``model_config``: ``query_format`` (:class:`rlhf_core.config.settings.QueryFormat` as a dict) and
    ``batch_size``. Artifact ``reward_model``: a directory saved by
    :meth:`rlhf_core.train.reward.ScalarModel.save_pretrained`, with its tokenizer, or an existing
    reward model (``ppo.reward: model:SOURCE``) with its own, which then builds the queries too
    (:func:`rlhf_core.train.reward.load_reward_model`).
    """

    def load_context(self, context) -> None:
        from transformers import AutoTokenizer

        from rlhf_core.config.data_settings import QueryFormat
        from rlhf_core.train.reward import load_reward_model

        path = context.artifacts["reward_model"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = load_reward_model(path, self.tokenizer).eval()
        self.query_format = QueryFormat(**context.model_config["query_format"])
        self.batch_size = int(context.model_config.get("batch_size", 8))

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        """Scores of ``model_input``'s rows (``post``, ``summary``, optional ``subreddit``,
        ``title``), as a DataFrame with one column ``score`` (float).

        Raises:
            ValueError: a query that does not fit in the format's ``max_query_length`` even
                with an empty post.
        """
        import torch

        from rlhf_core.data.prepare import left_pad, right_pad, tokenize_response, truncate_query
        from rlhf_core.data.rows import BadRow
        from rlhf_core.train.reward import score_responses

        tok, rows = self.tokenizer, model_input.to_dict("records")
        queries, responses = [], []
        for i, row in enumerate(rows):
            fields = {k: ("" if v is None or v != v else str(v)) for k, v in row.items()}  # NaN: missing
            try:
                queries.append(truncate_query(fields, tok, self.query_format)[1])
            except BadRow as exc:
                raise ValueError(f"row {i}: {exc}") from None
            responses.append(tokenize_response(fields["summary"], tok))
        q_len, r_len = max(map(len, queries), default=0), max(map(len, responses), default=0)
        scores = score_responses(
            self.model,
            torch.tensor([left_pad(q, q_len, tok.pad_token_id) for q in queries], dtype=torch.long),
            torch.tensor([right_pad(r, r_len, tok.pad_token_id) for r in responses], dtype=torch.long),
            tok.pad_token_id,
            tok.eos_token_id,
            None,
            self.batch_size,
        ).raw_scores
        return pd.DataFrame({"score": scores.double().tolist()})


def save_reward_model(
    model_dir: str | os.PathLike, path: str | os.PathLike, cfg: PipelineConfig, data_dir: str | os.PathLike
) -> None:
    """Write the reward model in ``model_dir`` to ``path`` as a pyfunc (:class:`RewardModelScorer`)
    with :data:`REWARD_SIGNATURE`; the model directory is copied in as its artifact."""
    with _without_expected_messages():
        mlflow.pyfunc.save_model(
            path=str(path),
            python_model=RewardModelScorer(),
            artifacts={"reward_model": str(Path(model_dir))},
            model_config={"query_format": cfg.data.tldr_format.model_dump(), "batch_size": cfg.reward.micro_batch_size},
            signature=REWARD_SIGNATURE,
            metadata={
                "source": "rlhf-tldr normalised reward model (Huang et al. 2024, arXiv:2403.17031, Details 10-15)"
            },
            pip_requirements=_requirements(),
        )


#: The stages whose ``model`` folder is registered: the registered model's name, and how its
#: MLflow model is written.
MLFLOW_MODELS = {
    "ppo": ("rlhf-tldr-policy", save_policy_model),
    "reward_norm": ("rlhf-tldr-reward-model", save_reward_model),
    "dpo": ("rlhf-tldr-dpo-policy", partial(save_policy_model, method="DPO")),
}


def download_registered_model(client: Any, uri: str, root: Path) -> Path:
    """The model directory (``save_pretrained`` layout) of the registered model ``uri``
    (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``), downloaded once into
    ``root/NAME-vVERSION``: a policy's ``model/`` folder (MLflow's ``transformers`` flavor) with
    its tokenizer's files beside the weights, or a reward model's ``artifacts/reward_model``.

    Raises:
        ModelSourceError: naming ``uri``: not a ``models:/`` URI, no such model, version or
            alias, or no model directory in it.
    """
    import shutil

    from mlflow.exceptions import MlflowException

    from rlhf_core.common.errors import ModelSourceError

    match = re.fullmatch(r"models:/([^/@]+)(?:@([^/@]+)|/(\d+))", uri)
    if match is None:
        raise ModelSourceError(f"{uri}: a registered model is models:/NAME@ALIAS or models:/NAME/VERSION")
    name, alias, number = match.groups()
    try:
        version = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, number)
    except MlflowException as exc:
        raise ModelSourceError(f"{uri}: not in the model registry at {client.tracking_uri}: {exc.message}") from None
    target = root / f"{name}-v{version.version}"
    if not (target / "MLmodel").is_file():
        partial_dir = root / f".{name}-v{version.version}.partial"
        shutil.rmtree(partial_dir, ignore_errors=True)
        partial_dir.mkdir(parents=True)
        mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{name}/{version.version}",
            dst_path=str(partial_dir),
            tracking_uri=client.tracking_uri,
            registry_uri=client.tracking_uri,  # the registry lives beside the runs, as the pipeline registers
        )
        shutil.rmtree(target, ignore_errors=True)
        partial_dir.rename(target)
    if (target / "model" / "config.json").is_file():  # the transformers flavor: the tokenizer beside the weights
        tokenizer = target / "components" / "tokenizer"
        for file in tokenizer.iterdir() if tokenizer.is_dir() else ():
            if not (target / "model" / file.name).exists():
                shutil.copyfile(file, target / "model" / file.name)
        return target / "model"
    found = sorted(p.parent for p in (target / "artifacts").glob("*/config.json"))
    if not found:
        raise ModelSourceError(f"{uri}: version {version.version} holds no model directory (config.json)")
    return found[0]
