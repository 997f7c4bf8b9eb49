"""An existing reward model (``ppo.reward: model:SOURCE[@REVISION]``) with its own tokenizer.

Any Hugging Face ``AutoModelForSequenceClassification`` checkpoint with one label (a hub id, a
local directory or ``pkg:PACKAGE/PATH``) takes the trained reward model's place: the reward stage
copies it untrained (:func:`import_reward_model`), and :class:`ExternalRewardModel` scores the
texts decoded from the policy's ids, re-encoded by its own tokenizer (and chat template when it
has one), as ``transformers`` alone scores them. Normalisation (Detail 15), evaluation and
scoring go through :mod:`rlhf_core.reward` as for a trained one
(:func:`rlhf_core.reward.load_reward_model`, :func:`rlhf_core.reward.score_responses`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .errors import ModelSourceError
from .io import write_json_atomic
from .models import disable_dropout, save_pretrained_atomic
from .sources import external_reward_source, resolve_source
from .training import autocast

log = logging.getLogger(__name__)


#: The key of an imported reward model's ``config.json`` that names its ``ppo.reward`` spec
#: (``model:SOURCE[@REVISION]``): the checkpoint scores through its own tokenizer
#: (:class:`ExternalRewardModel`), not the policy's.
EXTERNAL_REWARD_KEY = "rlhf_external_reward"


def decode_query_responses(
    tokenizer: PreTrainedTokenizerBase,
    queries: torch.Tensor,
    responses: torch.Tensor,
    pad_token_id: int,
    eos_token_id: int,
) -> tuple[list[str], list[str]]:
    """The texts of query + response token ids, as another tokenizer's model reads them.

    Args:
        tokenizer: the policy's tokenizer (:func:`rlhf_core.data.load_data_tokenizer`).
        queries: ``(n, query_length)`` long token ids, left-padded with PAD.
        responses: ``(n, response_length)`` long token ids; everything from the first EOS on
            (PAD included) is dropped.

    Returns:
        ``(query_texts, response_texts)``, ``n`` strings each, decoded with special tokens
        skipped and not stripped, so that ``query_texts[i] + response_texts[i]`` is the text of
        the query and the response up to its EOS.
    """
    query_texts, response_texts = [], []
    for query, response in zip(queries.tolist(), responses.tolist()):
        end = response.index(eos_token_id) if eos_token_id in response else len(response)
        query_texts.append(tokenizer.decode([t for t in query if t != pad_token_id], skip_special_tokens=True))
        response_texts.append(
            tokenizer.decode([t for t in response[:end] if t != pad_token_id], skip_special_tokens=True)
        )
    return query_texts, response_texts


class ExternalRewardModel(nn.Module):
    """An existing reward model with its own tokenizer (``ppo.reward: model:SOURCE``): a Hugging
    Face ``...ForSequenceClassification`` checkpoint with one label, imported by
    :func:`import_reward_model`.

    It scores query + response token ids of the policy (:meth:`score`) by decoding them with the
    policy's tokenizer (:func:`decode_query_responses`), re-encoding the texts with its own
    (:meth:`texts`) and reading ``logits[:, 0]`` (the checkpoint's own pooling: its last token
    that is not its ``pad_token_id``), plus ``bias``, the normalisation of Detail 15, saved in
    its config as ``rlhf_score_bias`` (0 when never normalised).

    Attributes:
        model: the sequence-classification model, dropout off.
        tokenizer: its tokenizer.
        policy_tokenizer: the tokenizer of the ids it is given.
        bias: float added to every score.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        policy_tokenizer: PreTrainedTokenizerBase | None,
    ):
        super().__init__()
        self.model = disable_dropout(model)
        self.tokenizer, self.policy_tokenizer = tokenizer, policy_tokenizer
        self.bias = float(getattr(model.config, "rlhf_score_bias", 0.0) or 0.0)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, policy_tokenizer: PreTrainedTokenizerBase | None, revision: str | None = None
    ) -> ExternalRewardModel:
        """Load the checkpoint and its tokenizer from ``path`` (a directory or a hub id, at
        ``revision``); ``policy_tokenizer`` (the tokenizer of the ids :meth:`score` is given) may be
        ``None`` for a model that only scores texts or is saved.

        Raises:
            ValueError: the checkpoint does not have exactly one label.
        """
        config = AutoConfig.from_pretrained(str(path), revision=revision)
        if config.num_labels != 1:
            raise ValueError(
                f"ppo.reward: {path} is not a reward model: a sequence-classification checkpoint with one label "
                f"is needed, it has num_labels {config.num_labels}"
            )
        model = AutoModelForSequenceClassification.from_pretrained(str(path), revision=revision)
        tokenizer = AutoTokenizer.from_pretrained(str(path), revision=revision)
        return cls(model, tokenizer, policy_tokenizer)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Save the checkpoint, ``bias`` as ``rlhf_score_bias`` in its config, and its tokenizer."""
        self.model.config.rlhf_score_bias = self.bias
        self.model.save_pretrained(save_directory, **kwargs)
        self.tokenizer.save_pretrained(save_directory)

    def texts(self, query_texts: list[str], response_texts: list[str]) -> list[str]:
        """What the model reads of each query and response: with a chat template, the
        conversation of the query (user) and the response (assistant), each stripped of
        surrounding whitespace, rendered by the template; without one, ``query + response``."""
        if not self.tokenizer.chat_template:
            return [q + r for q, r in zip(query_texts, response_texts)]
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": q.strip()}, {"role": "assistant", "content": r.strip()}],
                tokenize=False,
            )
            for q, r in zip(query_texts, response_texts)
        ]

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each of :meth:`texts`: a rendered chat template as it is (it holds its
        special tokens), a plain text with the tokenizer's special tokens (e.g. BOS) added."""
        return self.tokenizer(list(texts), add_special_tokens=not self.tokenizer.chat_template)["input_ids"]

    @torch.no_grad()
    def score_texts(self, texts: list[str], batch_size: int, bf16: bool | str = False) -> torch.Tensor:
        """``logits[:, 0] + bias`` of each text (:meth:`texts`), in right-padded batches of
        ``batch_size`` (one text at a time when the model has no ``pad_token_id``, which its
        pooling needs to find each row's last token).

        Returns:
            ``(n,)`` float32 on the CPU.
        """
        device = next(self.model.parameters()).device
        pad = self.model.config.pad_token_id
        ids = self.encode(texts)
        size = batch_size if pad is not None else 1
        self.model.eval()
        out = []
        for start in range(0, len(ids), size):
            rows = ids[start : start + size]
            width = max(len(r) for r in rows)
            input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
            with autocast(device, bf16):
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits
            out.append(logits[:, 0].float().cpu())
        return (torch.cat(out) if out else torch.zeros(0)) + self.bias

    def score(
        self,
        queries: torch.Tensor,
        responses: torch.Tensor,
        pad_token_id: int,
        eos_token_id: int,
        batch_size: int,
        bf16: bool | str = False,
    ) -> torch.Tensor:
        """Scores of the policy's query + response ids: :func:`decode_query_responses` with the
        policy's tokenizer, then :meth:`texts` and :meth:`score_texts`.

        Args:
            queries: ``(n, query_length)`` long token ids, left-padded.
            responses: ``(n, response_length)`` long token ids, PAD after the first EOS.

        Returns:
            ``(n,)`` float32 on the CPU.
        """
        if self.policy_tokenizer is None:
            raise ValueError("ExternalRewardModel.score needs the policy's tokenizer (policy_tokenizer is None)")
        query_texts, response_texts = decode_query_responses(
            self.policy_tokenizer, queries, responses, pad_token_id, eos_token_id
        )
        return self.score_texts(self.texts(query_texts, response_texts), batch_size, bf16)


def import_reward_model(spec: str, out_dir: str | os.PathLike) -> dict[str, Any]:
    """The reward stage of ``ppo.reward: model:SOURCE[@REVISION]``: the existing reward model
    copied, untrained, into ``out_dir/model`` with its tokenizer, its config recording the spec
    (:data:`EXTERNAL_REWARD_KEY`) and ``rlhf_score_bias`` (kept when the checkpoint has one,
    else 0; :func:`rlhf_core.reward.normalize_reward_model` sets it). Writes ``out_dir/metrics.json``.

    Returns:
        ``{"train/steps": 0.0}``: nothing is trained.

    Raises:
        ValueError: ``spec`` is not ``model:SOURCE``, or the checkpoint has not exactly one label.
        ModelSourceError: the source cannot be resolved, or is a GGUF file.
    """
    external = external_reward_source(spec)
    if external is None:
        raise ValueError(f"ppo.reward {spec!r} names no existing reward model (expected model:SOURCE[@REVISION])")
    source = resolve_source(external[0])
    if source.kind == "gguf":
        raise ModelSourceError(
            f"ppo.reward {spec!r}: a GGUF file holds no sequence-classification model; name a directory or hub id"
        )
    model = ExternalRewardModel.from_pretrained(source.location, None, revision=external[1])
    model.model.config.update({EXTERNAL_REWARD_KEY: spec})
    out_dir = Path(out_dir)
    save_pretrained_atomic(model, out_dir / "model")  # type: ignore[arg-type]
    metrics = {"train/steps": 0.0}
    write_json_atomic(out_dir / "metrics.json", metrics)
    log.info("reward model: %s imported (%s), not trained", spec, type(model.model).__name__)
    return metrics
