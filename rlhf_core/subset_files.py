"""The subset files of the hub's TL;DR rows (``configs/data/NAME.json``, named by
``data.hub_subset``): where one is, what it holds, and the cache folder its rows are fetched into.

A subset file lists, for each file of a local data folder, the identity of every row and the hub
dataset, revision and split it comes from (:mod:`rlhf_core.hub_subset` fetches them). This
module reads only the file: the config checks a ``data.hub_subset`` setting with it, without
loading ``datasets`` or the data stage.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import DataError
from .io import cache_root

#: Where ``data.hub_subset`` names are looked up: ``configs/data/NAME.json``.
SUBSET_DIR = Path(__file__).resolve().parent.parent / "configs" / "data"


@dataclass(frozen=True)
class HubDataset:
    """One hub dataset a subset reads: its id, config (``None`` for none) and revision."""

    id: str
    config: str | None
    revision: str


@dataclass(frozen=True)
class SubsetFile:
    """One file of the local folder: its rows' kind, the hub split they come from, where the
    local file's rows came from (``source``, for messages) and their identities in order."""

    name: str
    kind: str
    split: str
    source: str
    rows: tuple[str, ...]


@dataclass(frozen=True)
class HubSubset:
    """A subset file (:func:`load_subset`): its path, the bytes' digest, the hub dataset of each
    kind of row and the files."""

    path: Path
    digest: str
    datasets: dict[str, HubDataset]
    files: tuple[SubsetFile, ...]

    @property
    def name(self) -> str:
        return self.path.stem


def subset_path(name: str) -> Path:
    """The file a ``data.hub_subset`` setting names: ``configs/data/NAME.json``, or a path.

    Raises:
        DataError: no such file.
    """
    path = Path(name).expanduser()
    if path.suffix != ".json" or not path.is_file():
        path = SUBSET_DIR / f"{name}.json"
    if not path.is_file():
        present = ", ".join(sorted(p.stem for p in SUBSET_DIR.glob("*.json"))) or "none"
        raise DataError(f"data.hub_subset {name!r}: no file {name} nor {path} (in configs/data/: {present})")
    return path


def load_subset(name: str) -> HubSubset:
    """Read and check the subset file ``name`` (:func:`subset_path`).

    Raises:
        DataError: the file is missing or is not a valid subset file, naming the file and the key.
    """
    path = subset_path(name)
    raw = path.read_bytes()
    try:
        doc = json.loads(raw)
        sets = {
            kind: HubDataset(str(d["id"]), d.get("config"), str(d.get("revision") or "main"))
            for kind, d in doc["datasets"].items()
        }
        files = tuple(
            SubsetFile(fname, f["kind"], f["split"], f.get("source", ""), tuple(f["rows"]))
            for fname, f in doc["files"].items()
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{path}: not a subset file ({type(exc).__name__}: {exc})") from None
    for f in files:
        if f.kind not in sets:
            raise DataError(f"{path}: files.{f.name}.kind {f.kind!r} names no entry of datasets ({', '.join(sets)})")
        if len(set(f.rows)) != len(f.rows):
            raise DataError(f"{path}: files.{f.name}.rows names a row twice")
    return HubSubset(path, hashlib.sha256(raw).hexdigest()[:12], sets, files)


def subset_dir(name: str) -> Path:
    """The cache folder of subset ``name``: ``rows/<name>@<revisions>-<digest>`` under
    :func:`rlhf_core.io.cache_root` (``$RLHF_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlhf``, else
    ``~/.cache/rlhf``), named with the hub revisions it reads and the digest of the subset file,
    so an edited subset or another revision is fetched into a folder of its own.

    Raises:
        DataError: the subset file is missing or invalid.
    """
    subset = load_subset(name)
    revisions = "+".join(d.revision.replace("/", "_")[:12] for d in subset.datasets.values())
    return cache_root() / "rows" / f"{subset.name}@{revisions}-{subset.digest}"
