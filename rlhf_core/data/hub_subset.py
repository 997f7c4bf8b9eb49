"""A committed subset of the hub's TL;DR rows, named row by row, fetched into a local data folder.

The offline presets (``cpu-demo``, ``smoke``) read a folder of flat JSONL files
(``RLHF_TLDR_DIR``; :mod:`rlhf_core.data.prepare`). Its rows are a fixed subset of two hub datasets:
the TL;DR SFT set (``vwxyzjn/summarize_from_feedback_tldr_3_filtered``) and OpenAI's human
comparisons (``openai/summarize_from_feedback``, config ``comparisons``). A subset file
(``configs/data/NAME.json``, named by ``data.hub_subset``) lists, for each file of that folder,
the identity of every row (:func:`row_identity`), the digest of its content
(:func:`content_digest`) and the hub dataset, revision and split it comes from. With ``data.source: auto`` and no local folder, :func:`ensure_local_rows` loads those
splits through ``datasets``, selects the rows and writes the same files into a cache folder
(:func:`rlhf_core.config.data_settings.subset_dir`), read from then on exactly as a local folder.

Importing this module loads neither ``datasets`` nor ``huggingface_hub``: the cache folder's
path is known without them (``rlhf config`` stays free of network and heavy imports).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..common.errors import DataError, HubUnreachable
from ..config.data_settings import HubSubset, SubsetFile, load_subset, subset_dir

log = logging.getLogger(__name__)

#: The record a fetched folder holds beside its JSONL files: what was read, at which commits,
#: which rows were missing and what replaced them. Written last: a folder without it is unfinished.
FETCH_RECORD = "SOURCE.json"
#: The kinds of file a subset names, and the fields of their rows in the local folder's order.
SFT_FIELDS = ("id", "subreddit", "title", "post", "summary")
PREFERENCE_FIELDS = (
    "id",
    "subreddit",
    "title",
    "post",
    "chosen",
    "rejected",
    "chosen_policy",
    "rejected_policy",
    "batch",
    "confidence",
    "split",
    "orig_split",
    "worker",
    "choice",
    "chosen_note",
    "rejected_note",
)


# ------------------------------------------------------------------------- identities


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()[:16]


def row_identities(kind: str, row: dict) -> list[str]:
    """Every identity under which a flat row (the local folder's format) can be named, the
    preferred one first (:func:`row_identity`).

    - ``sft``: the post's ``id`` when it has one, then ``t:`` + a digest of its subreddit and
      title (rows whose source gave no id are named so);
    - ``preference``: ``c:BATCH:`` + a digest of the batch, the worker, the post (its ``id``, or
      its title when it has no id), and the chosen and rejected texts stripped of surrounding
      whitespace; a row with an id is also named by the form with its title.

    Raises:
        ValueError: ``kind`` is neither ``sft`` nor ``preference``.
    """
    if kind == "sft":
        named = [row["id"]] if row.get("id") else []
        return named + ["t:" + _digest(row.get("subreddit"), row.get("title"))]
    if kind == "preference":
        texts = [(row.get(k) or "").strip() for k in ("chosen", "rejected")]
        posts = [row["id"]] if row.get("id") else []
        batch = row.get("batch")
        return [f"c:{batch}:" + _digest(batch, row.get("worker"), post, *texts) for post in [*posts, row.get("title")]]
    raise ValueError(f"row kind {kind!r}: expected 'sft' or 'preference'")


def row_identity(kind: str, row: dict) -> str:
    """The identity a subset file names a flat row by (the first of :func:`row_identities`)."""
    return row_identities(kind, row)[0]


#: The fields of a flat row the stages read: what a row's content digest covers.
CONTENT_FIELDS = {
    "sft": ("subreddit", "title", "post", "summary"),
    "preference": (
        "subreddit",
        "title",
        "post",
        "chosen",
        "rejected",
        "chosen_policy",
        "rejected_policy",
        "confidence",
    ),
}


def content_digest(kind: str, row: dict) -> str:
    """A digest of the fields of a flat row the stages read (:data:`CONTENT_FIELDS`): a row the hub
    changed under the same identity has another digest.

    Raises:
        KeyError: ``kind`` is neither ``sft`` nor ``preference``.
    """
    return _digest(kind, *(row.get(field) for field in CONTENT_FIELDS[kind]))


def _subreddit(name: Any) -> Any:
    return name[2:] if isinstance(name, str) and name.startswith("r/") else name


def offline_row(kind: str, hub_row: dict, split: str) -> dict:
    """A hub row in the local folder's flat format, its fields in that format's order.

    An SFT row keeps ``id, subreddit, title, post, summary``. A comparison of
    ``openai/summarize_from_feedback`` (``info``, two ``summaries``, ``choice``; flattened by
    :func:`rlhf_core.data.hub.flatten_comparison`) gets ``chosen``/``rejected`` with their
    policies and notes, ``split`` the hub split it was read from and ``orig_split`` OpenAI's own
    name (``valid1``/``valid2``); a news article (CNN/DM) is its ``post``, with ``site``. Summaries
    are stripped of surrounding whitespace and a leading ``r/`` is dropped from a subreddit, as
    in the local folder. A row already flat is put in the same form.

    Raises:
        rlhf_core.data.rows.BadRow: a comparison whose ``choice`` or ``summaries`` are malformed.
    """
    if kind == "sft":
        row = {field: hub_row.get(field) for field in SFT_FIELDS}
        row["subreddit"] = _subreddit(row["subreddit"])
        row["summary"] = row["summary"].strip() if isinstance(row["summary"], str) else row["summary"]
        return row
    from .hub import flatten_comparison

    info = hub_row.get("info")
    flat = flatten_comparison(hub_row)
    if info is not None:  # a hub comparison: notes and the two split names from the nested row
        choice = flat["choice"]
        summaries = hub_row["summaries"]
        flat |= {
            "split": split,
            "orig_split": hub_row.get("split"),
            "chosen_note": summaries[choice].get("note"),
            "rejected_note": summaries[1 - choice].get("note"),
        }
        if (info or {}).get("article") is not None:
            flat["site"] = info.get("site")
    row = {field: flat.get(field) for field in PREFERENCE_FIELDS}
    if "site" in flat:
        row["site"] = flat["site"]
    row["subreddit"] = _subreddit(row["subreddit"])
    for field in ("chosen", "rejected"):
        if isinstance(row[field], str):
            row[field] = row[field].strip()
    return row


# ----------------------------------------------------------------------------- fetch


def _select(
    subset_file: SubsetFile, rows: list[dict]
) -> tuple[list[dict], list[str], list[str], list[tuple[str, str | None]]]:
    """The rows of ``subset_file`` from the flat hub rows ``rows`` (in hub order), in the
    subset's order. A row found under its identity whose content digest (:func:`content_digest`)
    is not the one the subset names is refused. A row the hub split lacks or that was refused is
    replaced by the nearest equivalent one: for SFT, the first unused row of the split; for a
    comparison, the first unused comparison of its batch (named in its identity: the same
    policies compared, by the same rules). A refused row is never a replacement.

    Returns:
        ``(rows, missing, changed, replaced)``: the selected rows; the identities not found; the
        identities refused for their content; each ``(missing or changed identity, identity of its
        replacement, or None when none was left)``.
    """
    kind = subset_file.kind
    index: dict[str, int] = {}
    for i, row in enumerate(rows):
        for ident in row_identities(kind, row):
            index.setdefault(ident, i)
    chosen = [index.get(ident) for ident in subset_file.rows]
    changed: list[str] = []
    refused: set[int] = set()
    for pos, (ident, digest) in enumerate(zip(subset_file.rows, subset_file.digests)):
        i = chosen[pos]
        if i is not None and content_digest(kind, rows[i]) != digest:
            changed.append(ident)
            refused.add(i)
            chosen[pos] = None
    used = {i for i in chosen if i is not None} | refused
    missing = [ident for ident, i in zip(subset_file.rows, chosen) if i is None and ident not in changed]
    replaced: list[tuple[str, str | None]] = []
    pools: dict[str | None, Iterator[int]] = {}  # unused rows by batch (comparisons), in hub order

    for pos, ident in enumerate(subset_file.rows):
        if chosen[pos] is not None:
            continue
        batch = ident.split(":")[1] if kind == "preference" else None
        if batch not in pools:
            pools[batch] = iter([i for i, row in enumerate(rows) if batch is None or row.get("batch") == batch])
        near = next((i for i in pools[batch] if i not in used), None)
        if near is not None:
            used.add(near)
            chosen[pos] = near
        replaced.append((ident, None if near is None else row_identity(kind, rows[near])))
    return [rows[i] for i in chosen if i is not None], missing, changed, replaced


def _hub_unreachable(subset: HubSubset, reason: str) -> DataError:
    return DataError(
        f"no TL;DR rows to read: data.local_dir and RLHF_TLDR_DIR are unset, and the rows of data.hub_subset "
        f"{subset.name!r} cannot be fetched from the Hugging Face hub ({' '.join(reason.split())}); set "
        "RLHF_TLDR_DIR to a folder of the TL;DR JSONL files, or give this machine a network to reach the hub"
    )


def fetch_subset(name: str, dest: str | os.PathLike | None = None) -> Path:
    """Load the hub splits subset ``name`` reads (:func:`rlhf_core.data.hub.load_hub_split`), select its
    rows (:func:`_select`) and write its files, one flat JSON row per line, into ``dest``
    (default :func:`subset_dir`), atomically, with :data:`FETCH_RECORD` naming the commits read,
    the rows missing from the hub, those refused for a changed content and what replaced them (each also logged as a warning, naming
    where the local file's rows came from).

    Returns:
        ``dest``.

    Raises:
        DataError: the hub cannot be reached and does not hold the splits in its local cache, or
            a dataset, revision or split does not exist.
    """
    from ..common.io import atomic_directory, write_json_atomic
    from .hub import load_hub_split

    subset = load_subset(name)
    dest = Path(dest) if dest is not None else subset_dir(name)
    loaded: dict[tuple[str, str], tuple[list[dict], str]] = {}
    record: dict[str, Any] = {
        "subset": subset.name,
        "subset_digest": subset.digest,
        "fetched": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "datasets": {},
        "files": {},
    }
    with atomic_directory(dest, overwrite=True) as tmp:
        for f in subset.files:
            hub = subset.datasets[f.kind]
            if (f.kind, f.split) not in loaded:
                try:
                    ds, commit = load_hub_split(hub.id, hub.config, f.split, hub.revision)
                except HubUnreachable as exc:
                    raise _hub_unreachable(subset, str(exc)) from None
                rows = [offline_row(f.kind, r, f.split) for r in ds]
                loaded[(f.kind, f.split)] = (rows, commit)
                entry = {"id": hub.id, "config": hub.config, "revision": hub.revision, "commits": {}}
                record["datasets"].setdefault(f.kind, entry)["commits"][f.split] = commit
            rows, commit = loaded[(f.kind, f.split)]
            selected, missing, changed, replaced = _select(f, rows)
            with open(tmp / f.name, "w", encoding="utf-8") as fh:
                for row in selected:
                    fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            record["files"][f.name] = {
                "rows": len(selected),
                "hub": f"{hub.id}[{f.split}]@{commit}",
                "missing": missing,
                "changed": changed,
                "replaced_by": dict(replaced),
            }
            if missing:
                log.warning(
                    "%s: %d of its %d rows are not in %s[%s] at %s (the local file's rows came from %s); "
                    "%d replaced by the nearest rows of the same split%s; every one is listed in %s",
                    f.name,
                    len(missing),
                    len(f.rows),
                    hub.id,
                    f.split,
                    commit,
                    f.source or "elsewhere",
                    sum(r is not None for _, r in replaced),
                    " and batch" if f.kind == "preference" else "",
                    dest / FETCH_RECORD,
                )
            if changed:
                log.warning(
                    "%s: %d of its %d rows differ in %s[%s] at %s from the rows the subset names (their "
                    "content digests differ: %s%s); refused, and replaced by the nearest rows of the same split%s; "
                    "every one is listed in %s",
                    f.name,
                    len(changed),
                    len(f.rows),
                    hub.id,
                    f.split,
                    commit,
                    ", ".join(changed[:5]),
                    f" and {len(changed) - 5} more" if len(changed) > 5 else "",
                    " and batch" if f.kind == "preference" else "",
                    dest / FETCH_RECORD,
                )
            log.info("%s: %d rows from %s[%s]@%s", f.name, len(selected), hub.id, f.split, commit)
        write_json_atomic(tmp / FETCH_RECORD, record)
    return dest


def ensure_local_rows(data_cfg: Any) -> Path | None:
    """The folder subset rows are read from when ``data_cfg`` (a
    :class:`rlhf_core.config.settings.DataConfig`) reads a subset, fetched first if it is not there yet
    (:func:`fetch_subset`; one process at a time, the others wait and take its folder); ``None``
    when it reads a local folder of its own or the hub.

    Raises:
        DataError: the rows are neither cached nor fetchable, in one line naming both ways out.
    """
    if data_cfg.subset_in_use() is None:
        return None
    folder = subset_dir(data_cfg.hub_subset)
    if (folder / FETCH_RECORD).is_file():
        return folder
    from ..common.io import exclusive_lock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder.parent / f".{folder.name}.lock", what=f"the rows of data.hub_subset in {folder}"):
        if not (folder / FETCH_RECORD).is_file():
            log.info("data.hub_subset %s: fetching its rows from the hub into %s", data_cfg.hub_subset, folder)
            fetch_subset(data_cfg.hub_subset, folder)
    return folder


def subset_document(
    folder: str | os.PathLike, files: dict[str, tuple[str, str, str]], hub_datasets: dict[str, dict]
) -> dict:
    """A subset file's content naming every row of the flat JSONL ``files`` of ``folder``, with
    its content digest (:func:`content_digest`),
    (``{file name: (kind, hub split, where its rows came from)}``) in order, read from the hub
    datasets ``hub_datasets`` (``{kind: {"id", "config", "revision"}}``).

    Raises:
        DataError: a file is missing, or two of its rows have the same identity.
    """
    doc: dict[str, Any] = {"datasets": hub_datasets, "files": {}}
    for name, (kind, split, source) in files.items():
        path = Path(folder) / name
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        with open(path, encoding="utf-8") as fh:
            flat = [json.loads(line) for line in fh if line.strip()]
        rows = [row_identity(kind, row) for row in flat]
        if len(set(rows)) != len(rows):
            raise DataError(f"{path}: two rows have the same identity")
        digests = [content_digest(kind, row) for row in flat]
        doc["files"][name] = {"kind": kind, "split": split, "source": source, "rows": rows, "digests": digests}
    return doc
