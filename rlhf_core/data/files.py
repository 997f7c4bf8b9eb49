"""Which files a data split reads, and their fingerprint: the local splits' files by name
(``{kind}_{split}.jsonl`` and its parts) and what the data stage's cache key covers of them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..common.errors import DataError
from ..common.io import content_digest
from ..config.data_settings import DATA_KINDS, DataConfig
from .hub_subset import ensure_local_rows


def local_split_files(local_dir: str | os.PathLike, kind: str, split: str, one_file: bool = False) -> list[Path]:
    """The files of one local split: ``{kind}_{split}.jsonl`` and ``{kind}_{split}_*.jsonl``, then
    the same names in ``.parquet``.

    The second form lets one source split span several files, as the offline data's
    ``preference_validation_cnndm.jsonl`` belongs to the hub's ``validation`` split. With
    ``one_file`` (``data.format: trl``, where ``preference_validation_cnndm`` may be a split of
    its own) only the first form is read.

    Raises:
        DataError: no such file.
    """
    root = Path(local_dir)
    if not root.is_dir():
        raise DataError(f"local data directory {root} does not exist (set RLHF_TLDR_DIR or data.local_dir)")
    files = [
        path
        for suffix in ("jsonl", "parquet")
        for pattern in (f"{kind}_{split}.{suffix}",) + (() if one_file else (f"{kind}_{split}_*.{suffix}",))
        for path in sorted(root.glob(pattern))
    ]
    if not files:
        present = ", ".join(sorted(p.name for p in root.glob(f"{kind}_*") if p.suffix in (".jsonl", ".parquet")))
        raise DataError(
            f"no file {kind}_{split}.jsonl in {root} for {kind} split {split!r} "
            f"(nor .parquet; present: {present or 'none'})"
        )
    return files


def data_fingerprint(data_cfg: DataConfig) -> dict[str, Any]:
    """What the data stage reads beside its settings, for its cache key
    (:func:`rlhf_core.run.pipeline.stage_key`): for a local source, a digest of the contents of
    every JSONL file its splits read (:func:`local_split_files`), named relative to the
    directory, so the same files elsewhere give the same key and one edited row another; for
    the hub, each dataset's id and ``data.revision``, or a digest of its files when the id is
    a local directory in the hub layout.

    The rows of ``data.hub_subset``, when they are what is read, are fetched first if they are
    not in their cache folder yet (:func:`rlhf_core.data.hub_subset.ensure_local_rows`).

    Raises:
        DataError: the local directory is unset or missing, a split has no file, or the subset's
            rows can be neither found nor fetched.
    """
    ensure_local_rows(data_cfg)
    source = data_cfg.resolved_source()
    if source == "local":
        local_dir = data_cfg.resolved_local_dir()
        if not local_dir:
            raise DataError("data.source is local but neither data.local_dir nor RLHF_TLDR_DIR is set")
        files = {
            path
            for kind in DATA_KINDS
            for spec in data_cfg.splits(kind).values()
            for path in local_split_files(local_dir, kind, spec.source, data_cfg.format == "trl")
        }
        return {"source": "local", "files": content_digest(sorted(files), root=local_dir)}
    hub: dict[str, Any] = {"source": "hub", "revision": data_cfg.revision}
    for name in [data_cfg.dataset(kind) for kind in DATA_KINDS if kind != "prompt" or data_cfg.splits(kind)]:
        path = Path(name).expanduser()
        hub[name] = content_digest([path]) if path.is_dir() else None
    return hub
