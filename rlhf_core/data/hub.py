"""Reading one split of a hub dataset: its data files fetched into the hub cache, read by ``datasets``.

:func:`load_hub_split` is how :func:`rlhf_core.data.rows.load_split` reads the hub's TL;DR sets
(``data.source: hub``) and how :func:`rlhf_core.data.hub_subset.ensure_local_rows` fetches a subset;
offline (``HF_HUB_OFFLINE``) or without a network it reads the hub cache alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import datasets

from ..common.errors import BadRow, DataError, HubUnreachable

log = logging.getLogger(__name__)


def iter_hub_split(
    dataset: str, config: str | None, split: str, revision: str | None = None
) -> Iterator[tuple[str, dict]]:
    """Yield ``(where, row)`` for the rows of one split of a hub dataset (:func:`load_hub_split`).

    ``dataset`` may be a hub id or a local dataset directory in the hub layout.
    """
    ds, _ = load_hub_split(dataset, config, split, revision)
    for i, row in enumerate(ds):
        yield f"{dataset}[{split}] row {i}", row


#: The ``datasets`` builder that reads each kind of data file a hub split may be stored as.
HUB_DATA_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
#: The branch of the hub's Parquet export of a dataset (its dataset viewer's conversion, made for
#: datasets built by a loading script too).
PARQUET_EXPORT = "refs/convert/parquet"


def load_hub_split(
    dataset: str, config: str | None, split: str, revision: str | None = None
) -> tuple[datasets.Dataset, str]:
    """One split of a dataset, and the commit it was read at (``"local"`` for a directory).

    A local directory in the hub layout is read by ``datasets.load_dataset(dir, config,
    split=split)``. For a hub id, the split's data files (under the folder named ``config``, if
    any; named ``{split}-*``, ``{split}.*`` or inside a folder ``{split}/``) are fetched at
    ``revision`` (default ``main``) into the hub cache with ``huggingface_hub.snapshot_download``,
    which offline (``HF_HUB_OFFLINE``) or without a network reads that cache alone, then read by
    the ``datasets`` builder of their file type. A dataset whose revision holds a loading script
    and no data files (``datasets`` no longer runs scripts) is read from the hub's Parquet export
    (:data:`PARQUET_EXPORT`).

    Raises:
        HubUnreachable: the hub cannot be reached and its cache lacks the files.
        DataError: the dataset or revision does not exist, access is refused, or the revision holds
            no data file for the split; naming the dataset, revision and split.
    """
    path = Path(dataset).expanduser()
    if path.is_dir():
        return datasets.load_dataset(str(path), config, split=split), "local"
    revision = revision or "main"
    files, commit, script = _hub_split_files(dataset, config, split, revision)
    if not files and script:
        log.info(
            "%s at %s is made by a loading script (%s), which datasets no longer runs: reading its Parquet export %s",
            dataset,
            revision,
            script,
            PARQUET_EXPORT,
        )
        revision = PARQUET_EXPORT
        files, commit, _ = _hub_split_files(dataset, config, split, revision)
    if not files:
        raise DataError(
            f"{dataset}@{revision} (commit {commit}) has no data file for split {split!r}"
            + (f" of config {config!r}" if config else "")
        )
    builders = {HUB_DATA_BUILDERS[f.suffix] for f in files}
    if len(builders) != 1:
        raise DataError(f"{dataset}@{revision}: split {split!r} mixes file types ({', '.join(f.name for f in files)})")
    ds = datasets.load_dataset(builders.pop(), data_files={split: [str(f) for f in files]}, split=split)
    return ds, commit


def _hub_split_files(dataset: str, config: str | None, split: str, revision: str) -> tuple[list[Path], str, str | None]:
    """The data files of one split of a hub dataset at ``revision`` (fetched into the hub cache,
    or found there), the commit, and the name of a loading script at its top, if any."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    prefix = f"{config}/" if config else ""
    patterns = [f"{prefix}*{split}-*", f"{prefix}*{split}.*", f"{prefix}*{split}/*", "*.py", "README.md"]
    where = f"{dataset}@{revision}"
    try:
        root = Path(snapshot_download(dataset, repo_type="dataset", revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else str(exc).splitlines()[0].removeprefix("Got: ")
        raise HubUnreachable(f"{where} is not in the local hub cache and the hub cannot be reached: {why}") from None
    except GatedRepoError:
        raise DataError(f"{where}: the hub refused access (a gated dataset: log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise DataError(f"{where}: no such revision of the dataset on the hub") from None
    except RepositoryNotFoundError:
        raise DataError(f"{dataset}: no such dataset on the hub (or it is private)") from None
    base = root / config if config and (root / config).is_dir() else root
    files = sorted(
        f
        for f in base.rglob("*")
        if f.is_file()
        and f.suffix in HUB_DATA_BUILDERS
        and (f.stem == split or f.stem.startswith(f"{split}-") or f.parent.name == split)
    )
    script = next((f.name for f in sorted(root.glob("*.py"))), None)
    return files, root.name, script


def flatten_comparison(row: dict) -> dict:
    """Map a hub ``openai/summarize_from_feedback`` comparison to the flat local format.

    Hub rows hold ``info`` (post or CNN/DM article), two ``summaries`` and the labeler's
    ``choice``; flat rows hold ``chosen``/``rejected`` texts and policies directly.
    Flat rows are returned unchanged.

    Raises:
        BadRow: ``choice`` or ``summaries`` are malformed, or ``info`` or ``extra`` is no object.
    """
    if "info" not in row and "summaries" not in row:
        return row
    info = row.get("info") or {}
    summaries = row.get("summaries")
    choice = row.get("choice")
    extra = row.get("extra") or {}
    for name, value in (("info", info), ("extra", extra)):
        if not isinstance(value, dict):
            raise BadRow(f"bad_{name}", f"a JSON {type(value).__name__}, not an object")
    if not isinstance(summaries, list) or len(summaries) != 2 or not all(isinstance(s, dict) for s in summaries):
        raise BadRow("bad_summaries", "expected two summaries")
    if isinstance(choice, bool) or choice not in (0, 1):
        raise BadRow("bad_choice", f"choice={choice!r}")
    post = info.get("post") if info.get("post") is not None else info.get("article")
    return {
        "id": info.get("id"),
        "subreddit": info.get("subreddit"),
        "title": info.get("title"),
        "post": post,
        **({"site": info["site"]} if info.get("site") is not None else {}),  # a CNN/DM article's news site
        "chosen": summaries[choice].get("text"),
        "rejected": summaries[1 - choice].get("text"),
        "chosen_policy": summaries[choice].get("policy"),
        "rejected_policy": summaries[1 - choice].get("policy"),
        "batch": row.get("batch"),
        "confidence": extra.get("confidence"),
        "split": row.get("split"),
        "worker": row.get("worker"),
        "choice": choice,
    }
