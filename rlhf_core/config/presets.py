"""Settings as plain mappings: YAML preset files, ``key=value`` overrides, merging, flattening.

Reads a preset with :func:`read_yaml_mapping`, applies each
override (:func:`parse_override`, :func:`set_path`) and validates the result; :func:`flatten`
turns a configuration into the dotted keys under which it is logged and checked.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..common.errors import ConfigError
from ..common.io import PRESET_DIR
from .credentials import check_no_credentials, credential_name, format_validation_error, holds_key, redact
from .settings import PipelineConfig


def available_presets(preset_dir: Path = PRESET_DIR) -> list[str]:
    """Names of the YAML presets in ``preset_dir`` (file names without ``.yaml``)."""
    return sorted(p.stem for p in preset_dir.glob("*.yaml"))


def read_yaml_mapping(name: str | os.PathLike, directory: Path, what: str) -> tuple[Path, dict]:
    """The YAML mapping of ``directory/NAME.yaml``, else of the file at the path ``name``: how a
    preset (``what="preset"``) or a sweep spec (``"sweep"``) is read.

    Returns:
        ``(path, mapping)``; an empty file is an empty mapping.

    Raises:
        ConfigError: neither file exists (listing the names in ``directory``), the file is not
            valid YAML, or its top level is not a mapping; each naming the file.
    """
    path = directory / f"{name}.yaml"
    if not path.is_file() and Path(name).is_file():
        path = Path(name)
    if not path.is_file():
        available = ", ".join(sorted(p.stem for p in directory.glob("*.yaml")))
        raise ConfigError(
            f"unknown {what} {str(name)!r}: neither a {what} name (a file NAME.yaml in {directory}) "
            f"nor an existing YAML file; available: {available}"
        )
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path}: not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{what} {path}: the top level must be a mapping")
    return path, tree


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML parser's error in one line: what is wrong and where (``expected ',' or ']', but got
    '<stream end>' at line 1, column 5``), 1-based as editors count."""
    problem = ": ".join(str(p) for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return (problem or str(exc).splitlines()[0]) + where


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b.c=value"`` into ``(["a", "b", "c"], value)``; the value is parsed as YAML.

    Raises:
        ConfigError: when there is no ``=``, the key is empty or the value is not YAML (a value
            that may be a credential is not shown).
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        shown = "(not shown: it looks like a credential)" if holds_key(text) else redact(repr(text))
        raise ConfigError(f"override {shown} is not of the form key=value (e.g. ppo.kl_coef=0.1)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        if holds_key(raw) or credential_name(key.rsplit(".", 1)[-1]):  # the error quotes the value
            raise ConfigError(f"override {key}: the value (not shown) is not valid YAML") from None
        raise ConfigError(f"override {key}: value {redact(repr(raw))} is not valid YAML: {yaml_problem(exc)}") from None
    return key.split("."), value


def set_path(tree: dict, path: list[str], value: Any) -> None:
    """Set ``tree[path[0]][path[1]]...`` to ``value`` in place, making the missing sections.

    Raises:
        ConfigError: a part of ``path`` before the last is not a section (a mapping).
    """
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
        node = child
    node[path[-1]] = value


def deep_merge(base: dict, update: dict) -> dict:
    """A copy of ``base`` with ``update`` merged in: mappings merged key by key, other values of
    ``update`` (copied) replacing those of ``base``."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def settings_tree(
    preset: str | os.PathLike | None, overrides: list[str] | tuple[str, ...], preset_dir: Path = PRESET_DIR
) -> tuple[dict, str]:
    """The settings of a preset (:func:`read_yaml_mapping`; ``None``: none, the defaults) with each
    ``key=value`` override applied in order (:func:`parse_override`, :func:`set_path`), not yet
    validated.

    Returns:
        ``(tree, origin)``: the nested mapping, and where it comes from for messages (``preset
        smoke.yaml with overrides ppo.kl_coef=...``; override values are never shown).

    Raises:
        ConfigError: from :func:`read_yaml_mapping`, :func:`parse_override` or :func:`set_path`.
    """
    tree: dict = {}
    origin = "defaults"
    if preset is not None:
        path, loaded = read_yaml_mapping(preset, preset_dir, "preset")
        tree = deep_merge(tree, loaded)
        origin = f"preset {path.name}"
    for text in overrides:
        keys, value = parse_override(text)
        set_path(tree, keys, value)
    if overrides:
        origin += " with overrides " + " ".join(o.partition("=")[0] + "=..." for o in overrides)
    return tree, origin


def flatten(cfg: BaseModel | dict, prefix: str = "") -> dict[str, Any]:
    """Flatten a config into ``{"ppo.kl_coef": 0.05, ...}`` (lists and None kept as values)."""
    tree = cfg.model_dump() if isinstance(cfg, BaseModel) else cfg
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def config_from_dict(tree: dict, origin: str = "<dict>") -> PipelineConfig:
    """Validate a nested dict as a :class:`PipelineConfig`.

    Raises:
        ConfigError: naming each bad dotted key (unknown key, wrong type, bad value), or the key
            of a value that looks like a credential (never shown).
    """
    check_no_credentials(flatten(tree), origin)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, origin, PipelineConfig)) from None


def load_config(
    preset: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    preset_dir: Path = PRESET_DIR,
) -> PipelineConfig:
    """Load a preset (a name in ``configs/`` or a YAML path) and apply ``key=value`` overrides.

    Args:
        preset: preset name such as ``"smoke"``, a path to a YAML file, or ``None`` for
            the paper defaults.
        overrides: strings such as ``"ppo.kl_coef=0.1"``; values are parsed as YAML.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: unknown preset, unreadable YAML, unknown key or wrong type (the
            message names the dotted key).
    """
    tree, origin = settings_tree(preset, overrides, preset_dir)
    return config_from_dict(tree, origin)
