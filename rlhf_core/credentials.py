"""Credentials in settings, detected so that none is stored as a setting or shown in an error.

Settings are stored as Prefect flow-run parameters and MLflow params, so a credential given as
a setting is refused (:func:`check_no_credentials`) and never shown (:func:`format_validation_error`,
:func:`rlhf_core.presets.parse_override`). Two rules:

* a value holding a known key shape is refused whatever the setting is called, as is a URL with
  a password (``scheme://user:password@host``) (:func:`holds_key`);
* a setting named like a credential (:func:`credential_name`) also refuses a long random string:
  a run of 20 or more key characters (letters, digits, ``+/=``) holding a letter and a digit. A
  model or data source there (``org/name``, ``org/name@revision``, a path starting with ``/``,
  ``~`` or ``.``, ``pkg:PACKAGE/PATH``, a URL) is a setting unless a run of 20 or more letters
  and digits between its separators holds a letter and a digit (a 40-hex git revision excepted).
  A relative path of several parts in such a field is judged as a string: write it ``./a/b``.

Hub ids, paths and URLs in the other fields (``model.base``, ``model.tokenizer``,
``eval.judge_model``, ...) are only checked for key shapes.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from .errors import ConfigError

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
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^/?#@\s:]*:[^/?#@\s]+@")
_SOURCE_SHAPE = re.compile(
    r"[A-Za-z][A-Za-z0-9+.\-]*://\S*"  # URL: s3://, https://, file://
    r"|pkg:\S+"  # a file shipped in a Python package
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
        settings: dotted keys to values (:func:`rlhf_core.presets.flatten`).
        origin: where the settings come from, for the message (``preset smoke.yaml``).

    Raises:
        ConfigError: naming the dotted key of the first such setting.
    """
    for key, value in settings.items():
        if holds_credential(value, key.rsplit(".", 1)[-1]):
            raise ConfigError(
                f"{key} ({origin}): the value looks like a credential, and settings are stored in the "
                "Prefect database and MLflow; give a key through the environment (ANTHROPIC_API_KEY for "
                "the judge) or a Prefect Secret block named by eval.api_key_secret, never as a setting"
            )


def format_validation_error(exc: ValidationError, origin: str) -> str:
    """``invalid configuration (ORIGIN):`` and one line per error of ``exc``, naming its dotted key;
    the value is shown unless it may be a credential (:func:`holds_credential`, or a field named
    like one), whose value is replaced by ``<not shown>`` even where pydantic's message quotes it."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        name = next((str(p) for p in reversed(err["loc"]) if not isinstance(p, int)), "")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif err["type"] == "missing":  # its input is the mapping that lacks the key
            lines.append(f"  {key}: required")
        elif not err["loc"] or isinstance(err.get("input"), dict):  # a rule across keys: it names them
            lines.append(f"  {msg}")
        elif holds_credential(err.get("input"), name) or credential_name(name):
            if isinstance(err.get("input"), str) and err["input"]:
                msg = msg.replace(err["input"], "<not shown>")
            lines.append(f"  {key}: {msg}")  # the value may be a credential: never echoed
        else:
            lines.append(f"  {key}: {msg} (got {err.get('input')!r})")
    return f"invalid configuration ({origin}):\n" + "\n".join(lines)
