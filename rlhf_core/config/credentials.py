"""Credentials in settings, detected so that none is stored as a setting or shown in an error.

Settings are stored as Prefect flow-run parameters and MLflow params, so a credential given as
a setting is refused (:func:`check_no_credentials`) and never shown (:func:`format_validation_error`,
:func:`rlhf_core.config.presets.parse_override`). Two rules:

* a value holding a known key shape is refused whatever the setting is called, as is a URL with
  a password (``scheme://user:password@host``) (:func:`holds_key`);
* a setting named like a credential (:func:`credential_name`) also refuses a long random string:
  a run of 20 or more key characters (letters, digits, ``+/=``) holding a letter and a digit. A
  model or data source there (``org/name``, ``org/name@revision``, a path starting with ``/``,
  ``~`` or ``.``, ``pkg:PACKAGE/PATH``, ``configs:PATH``, a URL) is a setting unless a run of 20 or more letters
  and digits between its separators holds a letter and a digit (a 40-hex git revision excepted).
  A relative path of several parts in such a field is judged as a string: write it ``./a/b``.

Hub ids, paths and URLs in the other fields (``model.base``, ``model.tokenizer``,
``eval.judge_model``, ...) are only checked for key shapes.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from ..common.errors import ConfigError

#: The API judge's key given to the stage running in this context (:func:`judge_key_given`).
_GIVEN_JUDGE_KEY: ContextVar[str | None] = ContextVar("rlhf_judge_key", default=None)


@contextmanager
def judge_key_given(key: str | None) -> Iterator[None]:
    """Within the block, :func:`judge_key` returns ``key`` (read from a Prefect Secret block for
    one stage). It is held in this context only, never in the process environment, so that a
    later stage of the same process (a sweep's next cell) never sends it to another server."""
    token = _GIVEN_JUDGE_KEY.set(key)
    try:
        yield
    finally:
        _GIVEN_JUDGE_KEY.reset(token)


def judge_key(variable: str | None) -> str | None:
    """The key the API judge sends: the one given to this stage (:func:`judge_key_given`), else
    the environment variable ``variable`` (:attr:`rlhf_core.config.settings.EvalConfig.judge_key_variable`:
    ``ANTHROPIC_API_KEY``, ``OPENAI_API_KEY`` for the OpenAI API's hosts only,
    ``eval.api_key_variable`` for another server), else ``None`` (no key, or the offline judge)."""
    return _GIVEN_JUDGE_KEY.get() or (os.environ.get(variable) if variable else None) or None


#: API keys by their prefix: Anthropic, OpenAI, Stripe, AWS access key ids, Hugging Face, GitHub, Slack.
_KEY_SHAPE = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"sk-ant-[A-Za-z0-9_\-]{20,}"
    r"|sk-(?:proj-|svcacct-|admin-)?(?P<openai>[A-Za-z0-9_\-]{20,})"
    r"|sk_(?:live|test)_[A-Za-z0-9]{20,}"
    r"|(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])"
    r"|hf_(?P<hf>[A-Za-z0-9]{30,})"
    r"|gh[pousr]_[A-Za-z0-9]{36,}"
    r"|github_pat_[A-Za-z0-9_]{22,}"
    r"|xox[abprs]-[A-Za-z0-9\-]{10,}"
    r")"
)
#: The same shapes inside a longer word (``xsk-ant-...``): never refused, but never shown either.
_KEY_SHAPE_ANYWHERE = re.compile(_KEY_SHAPE.pattern.replace("(?<![A-Za-z0-9])", "", 1))
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^/?#@\s:]*:[^/?#@\s]+@")
_SOURCE_SHAPE = re.compile(
    r"[A-Za-z][A-Za-z0-9+.\-]*://\S*"  # URL: s3://, https://, file://
    r"|pkg:\S+"  # a file shipped in a Python package
    r"|configs:\S+"  # a file in the presets folder
    r"|[/~.]\S*"  # absolute, home or relative path
    r"|[A-Za-z0-9][\w.\-]*/[\w.\-]+(?:@[\w.\-/]+)?"  # hub id, optionally @revision
)
_KEY_RUN = re.compile(r"[A-Za-z0-9+/=]{20,}")
_ALNUM_RUN = re.compile(r"[A-Za-z0-9]{20,}")
_GIT_REVISION = re.compile(r"[0-9a-f]{40}")
_LETTER_AND_DIGIT = re.compile(r"(?=.*[A-Za-z])(?=.*\d)")
#: Whole words of a setting's name that make it credential-like anywhere in the name.
_CREDENTIAL_WORDS = frozenset(
    {"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials", "apikey"}
)
#: ``key`` and ``token`` make a name credential-like after one of these words (``api_key_id``) ...
_CREDENTIAL_QUALIFIERS = frozenset({"api", "access", "auth", "private", "bearer", "refresh", "session"})
#: ... or as the name's last word (``key``, ``hf_token``, ``secret_access_key``), unless the word
#: before says the key or token is no secret: a tokenizer's special token (``pad_token``) or a
#: lookup key (``cache_key``). ``max_tokens``, ``token_budget`` and ``cache_key_prefix`` are not
#: credential-like.
_PLAIN_QUALIFIERS = frozenset(
    {"pad", "eos", "bos", "unk", "sep", "cls", "mask", "special", "stop", "cache", "sort", "group", "column"}
    | {"field", "label", "metric", "partition", "shard", "lookup", "hash", "dict", "join", "primary", "row"}
)


def credential_name(name: str) -> bool:
    """Whether a setting's name (its last dotted part) is credential-like; snake, kebab or camel case."""
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()) if w]
    if _CREDENTIAL_WORDS.intersection(words):
        return True
    for i, word in enumerate(words):
        if word in ("key", "token"):
            before = words[i - 1] if i else ""
            if before in _CREDENTIAL_QUALIFIERS or (i == len(words) - 1 and before not in _PLAIN_QUALIFIERS):
                return True
    return False


def holds_key(value: str) -> bool:
    """Whether ``value`` holds a known API key shape, or is a URL with a password."""
    if _URL_PASSWORD.match(value):
        return True
    for match in _KEY_SHAPE.finditer(value):
        body = match["openai"] or match["hf"]
        if body is None:
            return True
        if match["openai"] and any(_LETTER_AND_DIGIT.match(r) for r in _ALNUM_RUN.findall(body)):
            return True  # sk-<random>: not a name such as sk-learn-models-2024
        if match["hf"] and body != body.lower() and body != body.upper():
            return True  # hf_<mixed case letters>
    return False


def _looks_random(value: str) -> bool:
    """Whether ``value`` holds a long random string (the module's rules)."""
    if _SOURCE_SHAPE.fullmatch(value):
        runs = [r for r in _ALNUM_RUN.findall(value) if not _GIT_REVISION.fullmatch(r)]
    else:
        runs = _KEY_RUN.findall(value)
    return any(_LETTER_AND_DIGIT.match(r) for r in runs)


def holds_credential(value: Any, name: str) -> bool:
    """Whether a setting named ``name`` (its last dotted part) holds a credential in ``value``
    (a string, or lists and mappings of them)."""
    if isinstance(value, dict):
        return any(holds_credential(v, str(k)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(holds_credential(v, name) for v in value)
    if not isinstance(value, str):
        return False
    return holds_key(value) or (credential_name(name) and _looks_random(value))


def check_no_credentials(settings: dict[str, Any], origin: str) -> None:
    """Refuse a setting whose value looks like a credential (the module's rules): settings are
    stored as Prefect flow-run parameters and MLflow params. The value is never shown.

    Args:
        settings: dotted keys to values (:func:`rlhf_core.config.presets.flatten`).
        origin: where the settings come from, for the message (``preset smoke.yaml``).

    Raises:
        ConfigError: naming the dotted key of the first such setting.
    """
    for key, value in settings.items():
        if holds_credential(value, key.rsplit(".", 1)[-1]):
            raise ConfigError(
                f"{key} ({origin}): the value looks like a credential, and settings are stored in the "
                "Prefect database and MLflow; give a key through the environment (ANTHROPIC_API_KEY or "
                "OPENAI_API_KEY for the judge) or a Prefect Secret block named by eval.api_key_secret, never as a setting"
            )


_ASSIGNMENT = re.compile(r"(?P<key>[A-Za-z_][\w.\-]*)=(?P<value>\S+)")
#: A command-line option and the value after it, space-separated (``--api-key VALUE``).
_OPTION_VALUE = re.compile(r"(?<!\S)(?P<option>--?[A-Za-z][\w.\-]*)(?P<space>\s+)(?P<value>[^\s\-]\S*)")


def redact(text: str) -> str:
    """``text`` with every credential it holds replaced by ``<not shown>``: a known key shape
    (:func:`holds_key`), even inside a longer word, or a URL's password, and the value of a
    ``key=value``, or of an option given as ``--name VALUE``, whose value is a credential for its
    key or option name (:func:`holds_credential`: ``--api-key`` and ``--token`` are
    credential-like names). For messages made of what a user typed, such as argparse's
    "unrecognized arguments"."""

    def assignment(match: re.Match) -> str:
        key, value = match["key"], match["value"]
        return f"{key}=<not shown>" if holds_credential(value, key.rsplit(".", 1)[-1]) else match[0]

    def option(match: re.Match) -> str:
        name, value = match["option"].lstrip("-"), match["value"]
        shown = not holds_credential(value, name.rsplit(".", 1)[-1])
        return match[0] if shown else f"{match['option']}{match['space']}<not shown>"

    text = _ASSIGNMENT.sub(assignment, text)
    text = _OPTION_VALUE.sub(option, text)
    text = _URL_PASSWORD.sub(lambda m: m[0].split("://")[0] + "://<not shown>@", text)
    return _KEY_SHAPE_ANYWHERE.sub(lambda m: "<not shown>" if holds_key(m[0]) else m[0], text)


def _walk(model: type[BaseModel] | None, loc: tuple) -> tuple[list[str], type[BaseModel] | None, Any, bool]:
    """Follow an error's ``loc`` through ``model``'s fields: ``(key parts, the model whose field the
    last part names, the annotation reached, whether a union member's tag was dropped)``. pydantic
    puts a union member's name in ``loc`` (``sft.bf16.bool``); it is no key."""
    parts: list[str] = []
    parent, annotation, tagged = None, model, False
    for part in loc:
        while get_origin(annotation) in (Annotated, Union, UnionType):  # X | None is no union here
            args = [a for a in get_args(annotation) if a is not type(None)]
            if get_origin(annotation) is not Annotated and len(args) > 1:
                break
            annotation = args[0]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            parent = annotation
            field = annotation.model_fields.get(part) if isinstance(part, str) else None
            annotation = field.annotation if field is not None else None
        elif get_origin(annotation) in (Union, UnionType) and isinstance(part, str):
            members = [m for m in get_args(annotation) if m is not type(None)]
            annotation = next((m for m in members if getattr(m, "__name__", None) == part), None)
            tagged = True
            continue
        else:
            args = get_args(annotation)
            annotation = args[-1] if get_origin(annotation) in (list, dict) and args else None
        parts.append(str(part))
    return parts, parent, annotation, tagged


def _qualify(message: str, section: list[str], model: Any) -> str:
    """A rule's ``message`` with the bare keys of ``model`` (the section ``section``) it names
    written as dotted keys: ``lora.r`` in ``sft`` is ``sft.lora.r``."""
    if not section or not (isinstance(model, type) and issubclass(model, BaseModel)):
        return message
    prefix = ".".join(section)
    if f"{prefix}." in message:
        return message
    names = "|".join(sorted(map(re.escape, model.model_fields), key=len, reverse=True))
    return re.sub(rf"(?<![\w.'\"])({names})(?![\w'\"])", rf"{prefix}.\1", message)


def _suggestion(name: str, parent: type[BaseModel] | None, key: str, model: type[BaseModel] | None) -> str:
    """``; did you mean ...?`` naming the known keys nearest an unknown one (:mod:`difflib`): the
    section's own, else any dotted key of ``model``."""
    near = difflib.get_close_matches(name, list(parent.model_fields), n=3, cutoff=0.6) if parent else []
    if near:
        head = key.rpartition(".")[0]
        near = [f"{head}.{n}" if head else n for n in near]
    elif model is not None:
        near = difflib.get_close_matches(key, list(_dotted_keys(model)), n=3, cutoff=0.7)
    return f"; did you mean {' or '.join(near)}?" if near else ""


def _dotted_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _dotted_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def format_validation_error(exc: ValidationError, origin: str, model: type[BaseModel] | None = None) -> str:
    """``invalid configuration (ORIGIN):`` and one line per bad key of ``exc``, naming its dotted
    key: an unknown key with the known keys nearest it (``did you mean``); the alternatives of a
    union (``sft.bf16``: a boolean or ``'auto'``) on one line; a section given where a value is
    expected (``ppo.kl_coef.x=1``) as such; a rule across keys with the keys it names dotted from
    the root. ``model`` is the validated class (:class:`rlhf_core.config.settings.PipelineConfig`), for the
    names; without it the keys are as pydantic gives them. The value is shown unless it may be a
    credential (:func:`holds_credential`, or a field named like one), whose value is replaced by
    ``<not shown>`` even where pydantic's message quotes it."""
    lines: dict[str, list[str]] = {}  # key -> messages (a union's members: several)
    shown: dict[str, str] = {}
    unions: set[str] = set()  # keys whose messages are a union's alternatives
    for err in exc.errors():
        parts, parent, annotation, tagged = _walk(model, tuple(err["loc"]))
        key = ".".join(parts) or "<root>"
        if tagged:
            unions.add(key)
        name = next((p for p in reversed(parts) if not p.isdigit()), "")
        value = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.setdefault(key, []).append("unknown key" + _suggestion(parts[-1], parent, key, model))
        elif err["type"] == "missing":  # its input is the mapping that lacks the key
            lines.setdefault(key, []).append("required")
        elif not err["loc"] or (isinstance(value, dict) and err["type"] == "value_error"):
            # a rule across keys: it names them
            lines.setdefault(f"<rule {len(lines)}>", []).append(_qualify(msg, parts, annotation))
        elif isinstance(value, dict):  # a value was expected: an override made a section of it
            given = ", ".join(f"{key}.{k}" for k in list(value)[:3])
            lines.setdefault(key, []).append(f"{msg}, not a section ({given} given)")
        elif holds_credential(value, name) or credential_name(name):
            if isinstance(value, str) and value:
                msg = msg.replace(value, "<not shown>")
            lines.setdefault(key, []).append(msg)  # the value may be a credential: never echoed
        else:
            lines.setdefault(key, []).append(msg)
            shown[key] = f" (got {redact(repr(value))})"
    out = []
    for key, messages in lines.items():
        first, *rest = dict.fromkeys(messages)  # in order, once each
        if key in unions:  # the alternatives: "Input should be a valid boolean, ..., or 'auto'"
            text = first + "".join(f", or {m.removeprefix('Input should be ')}" for m in rest)
        else:
            text = "; ".join([first, *rest])
        out.append(f"  {text}" if key.startswith("<rule") else f"  {key}: {text}{shown.get(key, '')}")
    return f"invalid configuration ({origin}):\n" + "\n".join(out)
