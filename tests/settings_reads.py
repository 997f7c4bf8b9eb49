"""Which settings a stage's code reads: every attribute read of a settings section's field while
the stage runs, recorded as ``section.field`` (a nested model's or a dict of models' reads as
the field holding them), so that a test can hold the stage keys against what the code reads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel

from rlhf_core.config.data_settings import StrictModel
from rlhf_core.config.settings import PipelineConfig


def _owners(cfg: PipelineConfig) -> dict[int, str]:
    """``id(model) -> prefix`` of every settings model in ``cfg``: ``""`` for the pipeline's,
    ``"ppo."`` for a section's, and ``"data.tldr_format"`` (no dot: the field itself) for a
    model held by a section's field, directly or in a dict or list."""
    owners: dict[int, str] = {id(cfg): ""}

    def held(value: Any, field: str) -> None:
        if isinstance(value, BaseModel):
            owners[id(value)] = field
            for name in type(value).model_fields:
                held(object.__getattribute__(value, name), field)
        elif isinstance(value, dict):
            for item in value.values():
                held(item, field)
        elif isinstance(value, list | tuple):
            for item in value:
                held(item, field)

    for section in type(cfg).model_fields:
        value = object.__getattribute__(cfg, section)
        if isinstance(value, BaseModel):
            owners[id(value)] = f"{section}."
            for name in type(value).model_fields:
                held(object.__getattribute__(value, name), f"{section}.{name}")
    return owners


@contextmanager
def recorded_reads(cfg: PipelineConfig) -> Iterator[set[str]]:
    """Within the block, every read of a field of ``cfg``'s settings models (by attribute, the
    properties' own reads included; ``model_dump`` reads nothing here) is added to the set
    yielded, as ``section.field`` (top-level fields by name, e.g. ``name``)."""
    owners = _owners(cfg)
    reads: set[str] = set()

    def getattribute(self: BaseModel, name: str) -> Any:
        value = object.__getattribute__(self, name)
        owner = owners.get(id(self))
        section = owner == "" and isinstance(value, BaseModel)  # cfg.ppo itself: its fields' reads count
        if owner is not None and not section and not name.startswith("_") and name in type(self).model_fields:
            reads.add(owner + name if owner == "" or owner.endswith(".") else owner)
        return value

    StrictModel.__getattribute__ = getattribute  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        del StrictModel.__getattribute__
