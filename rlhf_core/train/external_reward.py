"""An existing reward model (``ppo.reward: model:SOURCE[@REVISION]``) with its own tokenizer.

Any Hugging Face ``AutoModelForSequenceClassification`` checkpoint with one label (a hub id, a
local directory or ``pkg:PACKAGE/PATH``) takes the trained reward model's place: the reward stage
copies it untrained (:func:`import_reward_model`), and :class:`ExternalRewardModel` scores the
texts decoded from the policy's ids, re-encoded by its own tokenizer (and chat template when it
has one), reading ``AutoModelForSequenceClassification``'s raw logit (no sigmoid, which
``transformers``' text-classification pipeline would apply). Normalisation (Detail 15), evaluation and
scoring go through :mod:`rlhf_core.train.reward` as for a trained one
(:func:`rlhf_core.train.reward.load_reward_model`, :func:`rlhf_core.train.reward.score_responses`).
"""

from __future__ import annotations

import json
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

from ..common.errors import ModelSourceError
from ..common.io import write_json_atomic
from ..models.saved import disable_dropout, save_pretrained_atomic
from ..models.sources import external_reward_source, resolve_source
from .training import autocast

log = logging.getLogger(__name__)


#: The key of an imported reward model's ``config.json`` that names its ``ppo.reward`` spec
#: (``model:SOURCE[@REVISION]``): the checkpoint scores through its own tokenizer
#: (:class:`ExternalRewardModel`), not the policy's.
EXTERNAL_REWARD_KEY = "rlhf_external_reward"
#: The key of an imported reward model's ``config.json`` that says whether its plain texts end
#: with its EOS (``reward.external_append_eos``).
APPEND_EOS_KEY = "rlhf_append_eos"


def decode_query_responses(
    tokenizer: PreTrainedTokenizerBase,
    queries: torch.Tensor,
    responses: torch.Tensor,
    pad_token_id: int,
    eos_token_id: int,
) -> tuple[list[str], list[str]]:
    """The texts of query + response token ids, as another tokenizer's model reads them.

    Args:
        tokenizer: the policy's tokenizer (:func:`rlhf_core.data.prepared.load_data_tokenizer`).
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
    (:meth:`texts`; a conversational row's own prompt messages and the response, through its
    chat template, once :meth:`read_conversations` has read the data) and reading ``logits[:, 0]`` (the checkpoint's own pooling: its last token
    that is not its ``pad_token_id``), plus ``bias``, the normalisation of Detail 15, saved in
    its config as ``rlhf_score_bias`` (0 when never normalised). A text longer than the model's
    positions (``max_position_embeddings``) loses the start of its query, as the policy's query
    is truncated: the end of the query and the whole response are read (a warning gives the
    count the first time).

    Attributes:
        model: the sequence-classification model, dropout off.
        tokenizer: its tokenizer.
        policy_tokenizer: the tokenizer of the ids it is given.
        bias: float added to every score.
        append_eos: a plain text ends with the tokenizer's EOS (``rlhf_append_eos`` in the
            config, default true: ``reward.external_append_eos``).
        max_length: the most tokens the model reads (``max_position_embeddings``), or ``None``.
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
        self.append_eos = bool(getattr(model.config, APPEND_EOS_KEY, True))
        self.max_length: int | None = getattr(model.config, "max_position_embeddings", None)
        self._warned_cut = False
        #: the prompt's messages of each conversational row, by its query's ids (PAD dropped)
        self.conversations: dict[tuple[int, ...], list[dict[str, str]]] = {}

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
        surrounding whitespace, rendered by the template; without one, ``query + response``,
        then the tokenizer's EOS text unless it ends with it already, as TRL's RewardTrainer
        trains on plain texts (with :attr:`append_eos`)."""
        if not self.tokenizer.chat_template:
            eos = self.tokenizer.eos_token if self.append_eos else None
            plain = [q + r for q, r in zip(query_texts, response_texts)]
            return [t + eos if eos and not t.endswith(eos) else t for t in plain]
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": q.strip()}, {"role": "assistant", "content": r.strip()}],
                tokenize=False,
            )
            for q, r in zip(query_texts, response_texts)
        ]

    def read_conversations(self, data_dir: str | os.PathLike, pad_token_id: int) -> int:
        """Learn the prompt's messages of each conversational row (TRL's conversational form,
        ``prompt_messages``) of the prepared data in ``data_dir`` (its SFT, preference and
        prompt-only splits: PPO samples from ``prompt/train`` when ``data.prompt_splits`` names
        it), by its query's token ids, so that :meth:`score` renders the row's own conversation
        with this model's chat template, not the policy's rendering of it. Returns how many
        queries were learnt."""
        from ..data.prepared import load_prepared, load_prompts

        sft, preference, _ = load_prepared(data_dir)
        prompts = load_prompts(data_dir)
        for ds in [*sft.values(), *preference.values(), *(prompts.values() if prompts is not None else [])]:
            if "prompt_messages" not in ds.column_names:
                continue
            for ids, messages in zip(ds["query_token"], ds["prompt_messages"]):
                if messages:
                    self.conversations[tuple(t for t in ids if t != pad_token_id)] = json.loads(messages)
        return len(self.conversations)

    def conversation_text(self, messages: list[dict[str, str]], response: str) -> tuple[str, bool]:
        """The conversation of a row's prompt ``messages`` and the response (assistant,
        stripped; continuing the prompt's last message when that is the assistant's), rendered
        by the chat template, within :attr:`max_length` tokens as the
        policy's query is truncated: while it is longer, its earliest turns other than a system
        turn are left out, down to the last; then the start of that last turn's content is cut.
        The whole response and the end of the prompt are read; a response that does not fit
        alone loses its end (:meth:`within_positions`).

        Returns:
            ``(text, whether the prompt was shortened)``.
        """
        turns = [dict(m) for m in messages]
        if turns and turns[-1]["role"] == "assistant":  # a prompt the response continues (TRL's continue_final_message)
            response = turns.pop()["content"].rstrip() + response  # as the template continues it, trailing space cut
        response, given = response.strip(), [dict(m) for m in turns]

        def render() -> tuple[str, int]:
            text = self.tokenizer.apply_chat_template(
                [*turns, {"role": "assistant", "content": response}], tokenize=False
            )
            return text, (len(self.encode([text])[0]) - self.max_length) if self.max_length else 0

        text, excess = render()
        droppable = [i for i, m in enumerate(turns) if m["role"] != "system"]
        while excess > 0 and len(droppable) > 1:
            del turns[droppable.pop(0)]
            droppable = [i - 1 for i in droppable]
            text, excess = render()
        if excess > 0 and turns:
            last = turns[droppable[-1] if droppable else -1]
            for _ in range(8):  # a cut text may tokenise to a token more or less than counted
                ids = self.tokenizer(last["content"], add_special_tokens=False)["input_ids"]
                last["content"] = self.tokenizer.decode(ids[excess:]) if excess < len(ids) else ""
                text, excess = render()
                if excess <= 0 or not last["content"]:
                    break
        return text, turns != given

    def fit(self, query_texts: list[str], response_texts: list[str]) -> tuple[list[str], int]:
        """The query texts cut at their start until each query's text with its response fits
        :attr:`max_length` tokens (:meth:`texts`, :meth:`encode`), as the policy's queries are
        truncated: the end of the query and the whole response kept. Returns ``(query_texts,
        how many were cut)``; a response that does not fit alone keeps no query text (and loses
        its end in :meth:`score_texts`, :meth:`within_positions`)."""
        if not self.max_length:
            return list(query_texts), 0
        fitted, cut = [], 0
        for query, response in zip(query_texts, response_texts):
            for _ in range(8):  # a cut query may tokenise to a token more or less than counted
                excess = len(self.encode(self.texts([query], [response]))[0]) - self.max_length
                if excess <= 0:
                    break
                ids = self.tokenizer(query, add_special_tokens=False)["input_ids"]
                query = self.tokenizer.decode(ids[min(excess, len(ids)) :]) if excess < len(ids) else ""
            cut += query != query_texts[len(fitted)]
            fitted.append(query)
        return fitted, cut

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each of :meth:`texts`: a rendered chat template as it is (it holds its
        special tokens), a plain text with the tokenizer's special tokens (e.g. BOS) added."""
        return self.tokenizer(list(texts), add_special_tokens=not self.tokenizer.chat_template)["input_ids"]

    def within_positions(self, ids: list[list[int]]) -> list[list[int]]:
        """``ids`` cut to :attr:`max_length` tokens, keeping their start: the last resort for a
        response too long for the model's positions even with no query (:meth:`fit`)."""
        return [r[: self.max_length] for r in ids] if self.max_length else ids

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
        ids = self.within_positions(self.encode(texts))
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
        keys = [tuple(t for t in q if t != pad_token_id) for q in queries.tolist()]
        rows = [self.conversations.get(k) if self.tokenizer.chat_template else None for k in keys]
        fitted, cut = self.fit(query_texts, response_texts)
        texts = self.texts(fitted, response_texts)
        for i, messages in enumerate(rows):  # a conversational row: its own turns, not the policy's rendering
            if messages is not None:
                texts[i], shortened = self.conversation_text(messages, response_texts[i])
                cut += shortened - (fitted[i] != query_texts[i])
        if cut and not self._warned_cut:
            over = sum(len(ids) > self.max_length for ids in self.encode(texts))  # type: ignore[operator]
            log.warning(
                "existing reward model: %d of %d texts were longer than its %d positions; the start of their "
                "query was cut (the end of the query and the whole response read)%s",
                cut,
                len(query_texts),
                self.max_length,
                f"; {over} response(s) too long even alone lost their end" if over else "",
            )
            self._warned_cut = True
        return self.score_texts(texts, batch_size, bf16)


def import_reward_model(spec: str, out_dir: str | os.PathLike, append_eos: bool = True) -> dict[str, Any]:
    """The reward stage of ``ppo.reward: model:SOURCE[@REVISION]``: the existing reward model
    copied, untrained, into ``out_dir/model`` with its tokenizer, its config recording the spec
    (:data:`EXTERNAL_REWARD_KEY`), ``append_eos`` (:data:`APPEND_EOS_KEY`,
    ``reward.external_append_eos``) and ``rlhf_score_bias`` (kept when the checkpoint has one,
    else 0; :func:`rlhf_core.train.reward.normalize_reward_model` sets it). The log says what the
    model reads. Writes ``out_dir/metrics.json``.

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
    model.model.config.update({EXTERNAL_REWARD_KEY: spec, APPEND_EOS_KEY: append_eos})
    out_dir = Path(out_dir)
    save_pretrained_atomic(model, out_dir / "model")  # type: ignore[arg-type]
    metrics = {"train/steps": 0.0}
    write_json_atomic(out_dir / "metrics.json", metrics)
    if model.tokenizer.chat_template:
        reads = "the conversation as its chat template renders it"
    elif append_eos:
        reads = f"query + response + its EOS {model.tokenizer.eos_token!r}, as TRL's RewardTrainer trains plain texts"
    else:
        reads = "query + response, no EOS appended (reward.external_append_eos false)"
    log.info("reward model: %s imported (%s), not trained; it reads %s", spec, type(model.model).__name__, reads)
    return metrics
