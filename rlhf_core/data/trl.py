"""Rows in TRL's dataset formats (``data.format: trl``): validated, normalised, and made queries.

The formats are TRL's (its ``dataset_formats`` page), which OpenRLHF and NeMo-RL also read:

- SFT, standard: ``prompt`` and ``completion`` strings; conversational: ``messages``, a list of
  ``{role, content}`` whose last message is the assistant's response, or ``prompt`` and
  ``completion`` as message lists; language modelling: ``text`` alone (form
  ``language_modeling``), trained on whole as TRL's ``SFTTrainer`` trains it: the tokenizer's
  own prefix (BOS, or nothing) as the query, the text and EOS as the response. Such a split
  holds no prompts: SFT trains on it, and a stage that samples from a split's prompts refuses
  it (:func:`rlhf_core.data.prepared.require_prompts`).
- Preferences, standard: ``prompt``, ``chosen`` and ``rejected`` strings; conversational: the
  same as message lists. Without ``prompt`` (TRL's implicit prompt), ``chosen`` and
  ``rejected`` are whole texts or conversations split at their common prefix
  (:func:`split_implicit_prompt`).
- Prompts (PPO's, ``data.prompt_splits``): ``prompt`` alone, a string (standard) or a message
  list (conversational), TRL's prompt-only format.

``data.columns`` renames the data's columns onto these first. A row comes out in the flat form
of :func:`rlhf_core.data.rows.normalise_row`, so the rest of the pipeline reads it as a TL;DR
row: ``post`` holds the prompt's text for reports and the judge (the last user message of a
conversation), ``summary`` / ``chosen`` / ``rejected`` the responses as given (not stripped:
a response brings its own leading space, if any), ``subreddit`` and ``title`` are empty, and
the metadata the evaluation groups by (``batch``, ``chosen_policy``, ``rejected_policy``,
``confidence``, ``split``) and the labeller (``worker``) are kept when present, else ``None``. The prompt itself is kept in
``prompt`` (a string) or ``prompt_messages`` (the conversation as JSON), and made a query by
:func:`trl_query` with the tokenizer. A prompt-only row has no response field.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..common.errors import BadRow, DataError
from ..config.data_settings import LANGUAGE_MODELING

#: Reasons a row is dropped by a setting rather than for being bad: counted, never an error.
DROPPED_BY_SETTING = ("prompt_too_long",)
#: Metadata a preference row may carry, used by the reward model's per-group tables.
PREFERENCE_METADATA = ("batch", "chosen_policy", "rejected_policy", "split", "worker")


def rename_columns(rec: dict, columns: dict[str, str]) -> dict:
    """``rec`` with each column ``columns[name]`` renamed ``name`` (``data.columns``), all at
    once: ``{chosen: rejected, rejected: chosen}`` swaps the two.

    Raises:
        BadRow: ``missing_column:COLUMN`` when a mapped column is absent; ``column_clash:NAME``
            when a column is renamed ``NAME`` and the row has a column ``NAME`` of its own that
            is not renamed too (two sources for one name).
    """
    if not columns:
        return rec
    for name, column in columns.items():
        if column not in rec:
            raise BadRow(f"missing_column:{column}", f"data.columns.{name} names column {column!r}, not in the row")
        if name in rec and name not in columns.values():
            raise BadRow(
                f"column_clash:{name}",
                f"data.columns.{name} renames column {column!r} to {name!r}, and the row has a column {name!r} too",
            )
    renamed = set(columns.values())
    return {k: v for k, v in rec.items() if k not in renamed} | {name: rec[column] for name, column in columns.items()}


def _messages(value: Any, name: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRow(f"bad_messages:{name}", "a non-empty list of {role, content} is needed")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRow(f"bad_messages:{name}", f"message {i} has no role")
        if not isinstance(message.get("content"), str):
            raise BadRow(f"bad_messages:{name}", f"message {i} has no string content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _assistant_text(messages: list[dict[str, str]], name: str) -> str:
    """The content of a response given as messages: one assistant message."""
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = [m["role"] for m in messages]
        raise BadRow(f"not_one_assistant_message:{name}", f"roles {roles}")
    return messages[0]["content"]


def _string(value: Any, name: str) -> str:
    if value is None:
        raise BadRow(f"null_field:{name}")
    if not isinstance(value, str):
        raise BadRow(f"non_string_field:{name}", f"got {type(value).__name__}")
    if not value.strip():
        raise BadRow(f"empty_field:{name}")
    return value


def split_implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """Split two whole responses sharing a prompt into ``(prompt, chosen, rejected)``, as TRL's
    ``extract_prompt`` (``trl.data_utils``) splits them, so that a dataset reads alike here and
    in TRL.

    The split is at the first element (character of a string, message of a conversation) where
    the two differ, one element earlier when the character before it is a space (the responses
    then start with it); where one is a prefix of the other, it is one element before the
    shorter one's end, where TRL's loop stops. This is not a word boundary: ``"The sky is
    blue."`` and ``"The sky is black."`` split after ``"The sky is bl"``.

    Raises:
        BadRow: ``identical_responses``; ``no_common_prompt`` when the split would leave an empty
            prompt (there TRL would wrap round to the last character and invent one).
    """
    if chosen == rejected:
        raise BadRow("identical_responses")
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx > 0 and chosen[idx - 1] == " ":
                idx -= 1
            break
    if idx == 0:
        raise BadRow("no_common_prompt", "chosen and rejected share no leading text or message")
    return chosen[:idx], chosen[idx:], rejected[idx:]


def row_form(rec: dict, kind: str) -> str:
    """``standard``, ``conversational`` or (SFT's ``text`` rows) ``language_modeling``, from the
    row's columns (after renaming).

    Raises:
        BadRow: ``missing_field:...`` when the columns make no form of ``kind``.
    """
    if kind == "sft":
        if "messages" in rec:
            return "conversational"
        if "text" in rec and "prompt" not in rec:
            return LANGUAGE_MODELING
        for name in ("prompt", "completion"):
            if name not in rec:
                raise BadRow(f"missing_field:{name}", "an SFT row needs prompt and completion, messages, or text")
        return "conversational" if isinstance(rec["prompt"], list) else "standard"
    if kind == "prompt":
        if "prompt" not in rec:
            raise BadRow("missing_field:prompt", "a prompt-only row needs prompt")
        return "conversational" if isinstance(rec["prompt"], list) else "standard"
    for name in ("chosen", "rejected"):
        if name not in rec:
            raise BadRow(f"missing_field:{name}", "a preference row needs chosen and rejected (and prompt)")
    probe = rec["prompt"] if "prompt" in rec else rec["chosen"]
    return "conversational" if isinstance(probe, list) else "standard"


def normalise_trl_row(rec: dict, kind: str, columns: dict[str, str]) -> tuple[str, dict]:
    """Validate one TRL-format row and return ``(form, row)``, ``row`` in the flat form above.

    Raises:
        BadRow: not an object (``not_an_object``), a missing, null, empty or mistyped column (``missing_field:completion``,
            ``bad_messages:prompt``, ``not_one_assistant_message:chosen``, ...).
    """
    if not isinstance(rec, dict):
        raise BadRow("not_an_object", f"a JSON {type(rec).__name__}, not an object")
    rec = rename_columns(rec, columns)
    form = row_form(rec, kind)
    out: dict[str, Any] = {"id": rec.get("id") if isinstance(rec.get("id"), str) else ""}
    if kind == "sft":
        if form == "conversational" and "messages" in rec:
            messages = _messages(rec["messages"], "messages")
            if messages[-1]["role"] != "assistant" or len(messages) < 2:
                raise BadRow(
                    "no_assistant_response:messages", "the last message must be the assistant's, after a prompt"
                )
            prompt, responses = messages[:-1], {"summary": messages[-1]["content"]}
        elif form == "conversational":
            prompt = _messages(rec["prompt"], "prompt")
            responses = {"summary": _assistant_text(_messages(rec["completion"], "completion"), "completion")}
        elif form == LANGUAGE_MODELING:
            prompt, responses = "", {"summary": _string(rec["text"], "text")}
        else:
            prompt, responses = _string(rec["prompt"], "prompt"), {"summary": _string(rec["completion"], "completion")}
    elif kind == "prompt":
        form_prompt = _messages if form == "conversational" else _string
        prompt, responses = form_prompt(rec["prompt"], "prompt"), {}
    else:
        chosen, rejected = rec["chosen"], rec["rejected"]
        if "prompt" in rec:
            prompt = rec["prompt"]
        else:
            if form == "conversational":
                chosen, rejected = _messages(chosen, "chosen"), _messages(rejected, "rejected")
            else:
                chosen, rejected = _string(chosen, "chosen"), _string(rejected, "rejected")
            prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        if form == "conversational":
            prompt = _messages(prompt, "prompt")
            responses = {
                "chosen": _assistant_text(_messages(chosen, "chosen"), "chosen"),
                "rejected": _assistant_text(_messages(rejected, "rejected"), "rejected"),
            }
        else:
            prompt = _string(prompt, "prompt")
            responses = {"chosen": _string(chosen, "chosen"), "rejected": _string(rejected, "rejected")}
        for name in PREFERENCE_METADATA:
            value = rec.get(name)
            out[name] = value if isinstance(value, str) else None
        confidence = rec.get("confidence")
        out["confidence"] = confidence if isinstance(confidence, int) and not isinstance(confidence, bool) else None
    for name, text in responses.items():
        if not text.strip():
            raise BadRow(f"empty_field:{name}")
    if isinstance(prompt, list):
        users = [m["content"] for m in prompt if m["role"] == "user"]
        out |= {
            "post": users[-1] if users else prompt[-1]["content"],
            "prompt": "",
            "prompt_messages": json.dumps(prompt),
        }
    else:
        out |= {"post": prompt, "prompt": prompt, "prompt_messages": ""}
    return form, out | {"subreddit": "", "title": "", "site": ""} | responses


#: The roles a conversational prompt may end with: a user or tool turn, after which the
#: generation prompt opens the assistant's, or an assistant turn that the response continues.
PROMPT_LAST_ROLES = ("user", "tool", "assistant")


def render_prompt(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase) -> str:
    """A conversational prompt rendered by the tokenizer's chat template as TRL's
    ``maybe_apply_chat_template`` renders it: after a final user or tool turn with the generation
    prompt added; a final assistant turn left open to be continued (``continue_final_message``,
    no generation prompt).

    Raises:
        BadRow: ``prompt_last_role:ROLE`` when the last message is of another role (a system turn).
    """
    role = messages[-1]["role"]
    if role not in PROMPT_LAST_ROLES:
        raise BadRow(
            f"prompt_last_role:{role}",
            f"a prompt ends with a user, tool or assistant message, this one with a {role} message",
        )
    continued = role == "assistant"
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=not continued, continue_final_message=continued
    )


def trl_query(
    row: dict, tokenizer: PreTrainedTokenizerBase, max_query_length: int, truncation: str
) -> tuple[str, list[int], dict]:
    """The query of a row of :func:`normalise_trl_row`, cut to ``max_query_length`` tokens.

    A standard prompt is tokenised as given, with the tokenizer's special tokens (as a TL;DR
    query is: Detail 2); a conversation is rendered by the tokenizer's chat template as TRL
    renders it (:func:`render_prompt`), then tokenised without adding special tokens (the
    template writes its own). A query over the limit keeps its last tokens (``keep_end``, TRL's default), its
    first (``keep_start``), or is dropped (``drop``); the query text is then the kept tokens
    decoded.

    Returns:
        ``(query, query_token, counts)`` as :func:`rlhf_core.data.prepare.truncate_query` returns them:
        ``counts["token_cut"]`` is whether the query was cut.

    Raises:
        BadRow: ``prompt_too_long`` with ``truncation: drop``; ``prompt_last_role:ROLE``
            (:func:`render_prompt`).
        DataError: a conversation with a tokenizer that has no chat template.
    """
    if row["prompt_messages"]:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"conversational rows need a chat template, and the tokenizer {tokenizer.name_or_path!r} has none: "
                "use a chat model's tokenizer (model.tokenizer) or standard-form rows"
            )
        query = render_prompt(json.loads(row["prompt_messages"]), tokenizer)
        ids = tokenizer(query, add_special_tokens=False)["input_ids"]
    else:
        query = row["prompt"]
        ids = tokenizer(query, add_special_tokens=True)["input_ids"]
    if len(ids) <= max_query_length:
        return query, ids, {"paragraphs_removed": 0, "token_cut": False}
    if truncation == "drop":
        raise BadRow("prompt_too_long", f"{len(ids)} tokens > {max_query_length} (data.prompt_truncation: drop)")
    ids = ids[-max_query_length:] if truncation == "keep_end" else ids[:max_query_length]
    return tokenizer.decode(ids), ids, {"paragraphs_removed": 0, "token_cut": True}
