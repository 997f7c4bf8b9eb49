"""Tokenizers from their sources: hub ids, local directories and GGUF files shipped in packages
(converted once, their special tokens checked against the file's metadata), each with a PAD token
that is not EOS (Huang et al. 2024, Detail 3) and an EOS that agrees with the model's.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import transformers
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from ..common.errors import ModelSourceError
from ..common.io import atomic_directory, write_json_atomic
from ..config.settings import ModelConfig
from .sources import Source, gguf_cache_dir, resolve_source

log = logging.getLogger(__name__)


#: The GGUF metadata key of each special token's id, by tokenizer role.
GGUF_SPECIAL_TOKEN_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
}


_GGUF_SPECIAL_TOKENS: dict[str, dict[str, dict]] = {}  # by the GGUF file's SHA-256, per process


def gguf_special_tokens(source: Source) -> dict[str, dict]:
    """The special tokens the GGUF metadata of ``source`` names, as ``{role: {"id", "token"}}``
    for the roles ``bos``, ``eos``, ``unk`` and ``pad`` that it has (keys
    :data:`GGUF_SPECIAL_TOKEN_KEYS`, tokens from ``tokenizer.ggml.tokens``).

    Read with ``gguf.GGUFReader`` (seconds for a 100 MB file) once per file, then from
    ``special_tokens.json`` in :func:`gguf_cache_dir` (keyed by the file's SHA-256) and a
    per-process memo.

    Raises:
        ModelSourceError: an id is not an index of ``tokenizer.ggml.tokens``.
    """
    cached = gguf_cache_dir(source) / "special_tokens.json"
    key = cached.parent.name
    if key not in _GGUF_SPECIAL_TOKENS:
        if cached.is_file():
            _GGUF_SPECIAL_TOKENS[key] = json.loads(cached.read_text())
        else:
            from gguf import GGUFReader

            reader = GGUFReader(source.gguf_path)
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            special: dict[str, dict] = {}
            for role, name in GGUF_SPECIAL_TOKEN_KEYS.items():
                field = reader.fields.get(name)
                if field is None:
                    continue
                token_id = int(field.contents())
                if tokens is None or not 0 <= token_id < len(tokens.data):
                    raise ModelSourceError(
                        f"{source.gguf_path}: {name} = {token_id} is not an index of tokenizer.ggml.tokens"
                    )
                special[role] = {"id": token_id, "token": tokens.contents(token_id)}
            write_json_atomic(cached, special)
            _GGUF_SPECIAL_TOKENS[key] = special
    return _GGUF_SPECIAL_TOKENS[key]


def _special_token_disagreements(tokenizer: PreTrainedTokenizerBase, special: dict[str, dict]) -> dict[str, str]:
    """``{role: description}`` of the roles whose id in ``tokenizer`` is not the one of
    ``special`` (:func:`gguf_special_tokens`)."""
    wrong = {}
    for role, want in special.items():
        got_id = getattr(tokenizer, f"{role}_token_id")
        if got_id != want["id"]:
            wrong[role] = (
                f"{role.upper()} is {getattr(tokenizer, f'{role}_token')!r} (id {got_id}) where the GGUF metadata "
                f"({GGUF_SPECIAL_TOKEN_KEYS[role]}) names {want['token']!r} (id {want['id']})"
            )
    return wrong


def _token_at(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str | None:
    try:
        return tokenizer.convert_ids_to_tokens(token_id)
    except (IndexError, OverflowError, TypeError):
        return None


def _convert_gguf_tokenizer(source: Source, special: dict[str, dict]) -> PreTrainedTokenizerBase:
    """The tokenizer ``transformers`` converts from the GGUF file, its BOS, EOS, UNK and PAD
    set to those of the GGUF metadata where they differ (transformers 5.17 gives a Llama-type
    GGUF's BOS as its EOS too).

    Raises:
        ModelSourceError: a role cannot be set to the metadata's token (the converted
            vocabulary has another token at that id); the message names both tokens and ids
            and the installed transformers version.
    """
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    wrong = _special_token_disagreements(tokenizer, special)
    if wrong:
        log.warning(
            "%s: transformers %s converts a tokenizer whose %s; set from the GGUF metadata",
            source.gguf_path,
            transformers.__version__,
            "; ".join(wrong.values()),
        )
    for role in wrong:
        if _token_at(tokenizer, special[role]["id"]) == special[role]["token"]:
            setattr(tokenizer, f"{role}_token", special[role]["token"])
    wrong = [
        f"{line}, and the converted vocabulary has {_token_at(tokenizer, special[role]['id'])!r} at that id"
        for role, line in _special_token_disagreements(tokenizer, special).items()
    ]
    if wrong:
        raise ModelSourceError(
            f"{source.gguf_path}: the tokenizer transformers {transformers.__version__} converts cannot be made "
            f"to agree with the GGUF metadata: its {'; its '.join(wrong)}"
        )
    return tokenizer


def _gguf_tokenizer(source: Source) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file, converted once and cached in ``gguf_cache_dir(source) /
    "tokenizer"``; a cached one is checked against the GGUF metadata on every load and
    converted again (with a warning) where its special tokens differ.

    Raises:
        ModelSourceError: see :func:`_convert_gguf_tokenizer`, or the saved tokenizer does
            not load back with the metadata's special tokens.
    """
    special = gguf_special_tokens(source)
    target = gguf_cache_dir(source) / "tokenizer"
    stale = False
    if (target / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(target, clean_up_tokenization_spaces=False)
        wrong = _special_token_disagreements(tokenizer, special)
        if not wrong:
            return tokenizer
        log.warning(
            "cached tokenizer %s: its %s; converting %s again", target, "; ".join(wrong.values()), source.gguf_path
        )
        stale = True
    else:
        log.info("converting the tokenizer of %s (once; cached in %s)", source.gguf_path, target)
    converted = _convert_gguf_tokenizer(source, special)
    with contextlib.suppress(FileExistsError), atomic_directory(target, overwrite=stale) as tmp:
        converted.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(target, clean_up_tokenization_spaces=False)
    wrong = _special_token_disagreements(tokenizer, special)
    if wrong:
        raise ModelSourceError(
            f"{target}: the tokenizer converted from {source.gguf_path} by transformers {transformers.__version__} "
            f"loads back with its {'; its '.join(wrong.values())}"
        )
    return tokenizer


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase, pad_token: str = "[PAD]") -> bool:
    """Give ``tokenizer`` a PAD token distinct from EOS, adding ``pad_token`` when needed.

    Huang et al. 2024, Detail 3: padding with EOS would mask the EOS out of the SFT loss
    and the model would never learn to stop.

    Returns:
        ``True`` when a token was added (the model's embeddings must then grow).

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token")
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return False
    tokenizer.add_special_tokens({"pad_token": pad_token})
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(f"PAD token {pad_token!r} maps to the EOS id {tokenizer.eos_token_id}")
    return True


#: The files of a hub or local source whose ``eos_token_id`` the tokenizer's EOS must be among.
EOS_FILES = ("generation_config.json", "config.json")


def _source_file(source: Source, name: str, revision: str | None) -> tuple[Path | None, str]:
    """File ``name`` of a hub or local source (``None`` where it has none) and how to name it:
    a hub file is fetched with ``huggingface_hub.hf_hub_download`` (from the local cache when
    offline; ``None`` where neither the repository nor the cache has it)."""
    if source.kind == "local":
        path = Path(source.location) / name
        return (path if path.is_file() else None), str(path)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    where = f"{source.location}/{name}" + (f" (revision {revision})" if revision else "")
    try:
        return Path(hf_hub_download(source.location, name, revision=revision)), where
    except EntryNotFoundError:  # not in the repository, or offline and not in the cache
        return None, where


def check_source_eos(tokenizer: PreTrainedTokenizerBase, source: Source, revision: str | None = None) -> None:
    """Check that the EOS id of ``tokenizer`` is among the ``eos_token_id`` (an int or a list)
    that each of :data:`EOS_FILES` of a hub or local ``source`` names, where it names one.
    GGUF sources are checked against their metadata instead (:func:`gguf_special_tokens`).

    Raises:
        ModelSourceError: a file names other ids; the message names the file, both ids and
            their tokens. Also an unreadable file.
    """
    eos_id = tokenizer.eos_token_id
    if source.kind not in ("hub", "local") or eos_id is None:  # no EOS: ensure_pad_token says so
        return
    for name in EOS_FILES:
        path, where = _source_file(source, name, revision)
        if path is None:
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as err:
            raise ModelSourceError(f"{where}: cannot read eos_token_id: {err}") from err
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if eos_id not in ids:
            named = ", ".join(f"{_token_at(tokenizer, i)!r} (id {i})" for i in ids)
            raise ModelSourceError(
                f"{where}: eos_token_id names {named}, but the tokenizer's EOS is {tokenizer.eos_token!r} "
                f"(id {eos_id}); a model trained with this tokenizer would end its text with another token"
            )


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """Load the tokenizer of ``cfg`` (hub, local or GGUF) with a PAD distinct from EOS.

    Padding side is ``right``; data processing pads queries on the left itself. A GGUF
    tokenizer's BOS, EOS, UNK and PAD are those of the GGUF metadata (:func:`_gguf_tokenizer`;
    PAD then replaced by :func:`ensure_pad_token` where it is EOS); a hub or local
    tokenizer's EOS must be one its source's ``generation_config.json`` and ``config.json``
    name (:func:`check_source_eos`).

    Raises:
        ModelSourceError: the source cannot be resolved, or its tokenizer's special tokens
            disagree with the GGUF metadata or the source's config files.
    """
    source = resolve_source(cfg.tokenizer_source)
    if source.kind == "gguf":
        tokenizer = _gguf_tokenizer(source)
    else:
        revision = cfg.revision if source.kind == "hub" else None
        tokenizer = AutoTokenizer.from_pretrained(
            source.location, revision=revision, clean_up_tokenization_spaces=False
        )
        check_source_eos(tokenizer, source, revision)
    tokenizer.padding_side = "right"
    ensure_pad_token(tokenizer, cfg.pad_token)
    return tokenizer
