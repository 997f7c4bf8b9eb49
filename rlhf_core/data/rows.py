"""Raw rows in: a split's rows read from local JSONL files or the hub, validated and normalised.

Local files (``data.source: local``, :func:`iter_jsonl`) and hub splits
(:func:`rlhf_core.data.hub.iter_hub_split`) go through the same filters and checks
(:func:`load_split`): a hub comparison is flattened to the local format
(:func:`rlhf_core.data.hub.flatten_comparison`), and every row is checked and normalised
(:func:`normalise_row`; Huang et al. 2024, Details 1 and 5). A row that fails is a :class:`BadRow`, an error or, with
``data.on_bad_row: skip``, dropped and counted. :mod:`rlhf_core.data.prepare` tokenises what comes out.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import string
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.errors import BadRow, DataError
from ..config.data_settings import QUERY_FIELDS, DataConfig, QueryFormat, SplitSpec
from .files import local_split_files
from .hub import flatten_comparison, iter_hub_split
from .trl import normalise_trl_row

log = logging.getLogger(__name__)

#: Fields a SFT row needs besides those its query template uses.
SFT_RESPONSE_FIELDS = ("summary",)
#: Fields a comparison needs besides those its query template uses.
PREFERENCE_FIELDS = ("chosen", "rejected", "chosen_policy", "rejected_policy", "batch", "split")
#: Text fields that must not be empty (after stripping whitespace).
NON_EMPTY_FIELDS = ("post", "summary", "chosen", "rejected")


def iter_jsonl(path: Path, repaired: Counter | None = None) -> Iterator[tuple[str, dict | BadRow]]:
    """Yield ``(where, record)`` for each non-blank line of a JSONL file.

    ``where`` is ``"FILE:LINE"``; ``record`` is the parsed object, or a :class:`BadRow`
    when the line is not UTF-8 (each line is decoded on its own, so one bad byte costs one
    row and is named by its line) or not a JSON object. A UTF-8 byte-order mark at the start
    of the file is removed and counted in ``repaired["utf8_bom_stripped"]``.
    """
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
                log.warning("%s: a UTF-8 byte-order mark at the start of the file was removed", path)
                if repaired is not None:
                    repaired["utf8_bom_stripped"] += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadRow("not_utf8", f"byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line")
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, BadRow("invalid_json", f"{exc.msg} at column {exc.colno}; is the file JSONL?")
                continue
            if not isinstance(obj, dict):
                yield where, BadRow("not_an_object", f"a JSON {type(obj).__name__}, not an object")
                continue
            yield where, obj


def iter_parquet(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield ``(where, record)`` for each row of a Parquet file; ``where`` is ``"FILE:row N"``
    (counted from 1)."""
    import pyarrow.parquet as pq

    for i, rec in enumerate(pq.read_table(path).to_pylist(), 1):
        yield f"{path}:row {i}", rec


def iter_rows(path: Path, repaired: Counter | None = None) -> Iterator[tuple[str, dict | BadRow]]:
    """The rows of a local split file: :func:`iter_parquet` for ``.parquet``, else :func:`iter_jsonl`."""
    return iter_parquet(path) if path.suffix == ".parquet" else iter_jsonl(path, repaired)


def template_fields(template: str) -> list[str]:
    """Field names used by a ``str.format`` template, in order."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def _text(rec: dict, name: str, required: bool) -> str:
    if name not in rec:
        if required:
            raise BadRow(f"missing_field:{name}")
        return ""
    value = rec[name]
    if value is None:
        if required:
            raise BadRow(f"null_field:{name}")
        return ""
    if not isinstance(value, str):
        raise BadRow(f"non_string_field:{name}", f"got {type(value).__name__}")
    if name in NON_EMPTY_FIELDS and required and not value.strip():
        raise BadRow(f"empty_field:{name}")
    return value


def normalise_row(rec: dict, kind: str, fmt: QueryFormat) -> dict:
    """Validate one raw row and return it in the flat normalised form.

    ``kind`` is ``sft`` or ``preference``. Fields used by ``fmt.template`` and the
    response fields are required strings (``post``, ``summary``, ``chosen``,
    ``rejected`` also non-empty); ``id`` is a string or null; ``confidence`` an integer or
    null. Responses are stripped; the post is kept as is.

    Raises:
        BadRow: with a reason such as ``not_an_object``, ``missing_field:summary``, ``null_field:post``,
            ``non_string_field:title``, ``empty_field:post`` or ``invalid_unicode:post``
            (a lone surrogate, which no tokenizer or file can hold).
    """
    if not isinstance(rec, dict):
        raise BadRow("not_an_object", f"a JSON {type(rec).__name__}, not an object")
    if kind == "preference":
        rec = flatten_comparison(rec)
    query_fields = set(template_fields(fmt.template)) | {fmt.truncate_field}
    out: dict[str, Any] = {}
    rid = rec.get("id")
    if rid is not None and not isinstance(rid, str):
        raise BadRow("non_string_field:id", f"got {type(rid).__name__}")
    out["id"] = rid or ""
    for name in QUERY_FIELDS[1:]:  # every field a query template may name reaches it
        out[name] = _text(rec, name, required=name in query_fields)
    response_fields = SFT_RESPONSE_FIELDS if kind == "sft" else PREFERENCE_FIELDS
    for name in response_fields:
        out[name] = _text(rec, name, required=True)
    for name in ("summary", "chosen", "rejected"):
        if name in out:
            out[name] = out[name].strip()
    if kind == "preference":
        # Flat local files keep OpenAI's split name (valid1/valid2) in ``orig_split``.
        if isinstance(rec.get("orig_split"), str) and rec["orig_split"]:
            out["split"] = rec["orig_split"]
        confidence = rec.get("confidence")
        if confidence is not None and (isinstance(confidence, bool) or not isinstance(confidence, int)):
            raise BadRow("non_integer_field:confidence", f"got {confidence!r}")
        out["confidence"] = confidence
        worker = rec.get("worker")  # who labelled it: one pair labelled twice is two rows
        out["worker"] = worker if isinstance(worker, str) else None
    for name, value in out.items():
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:  # "\ud800" in JSON: a lone surrogate, no character
                raise BadRow(
                    f"invalid_unicode:{name}", f"lone surrogate U+{ord(value[exc.start]):04X} at character {exc.start}"
                ) from None
    return out


def content_id(row: dict, taken: Counter) -> str:
    """An id for a normalised row that has none (TRL's datasets carry no ``id`` column): the
    first 16 hex digits of the SHA-256 of its fields (``source_row`` aside), so the same rows
    get the same ids in every run; the n-th row with the same fields in a split gets ``-n``
    (n >= 2) after them, so a repeated prompt or pair keeps an id of its own.

    ``taken`` counts the digests given so far in the split and is updated.
    """
    fields = {k: v for k, v in row.items() if k not in ("id", "source_row")}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    taken[digest] += 1
    return digest if taken[digest] == 1 else f"{digest}-{taken[digest]}"


@dataclass
class SplitLoad:
    """Rows of one output split after validation, with what was dropped and why, and (TRL-format
    rows) the split's form (:func:`rlhf_core.data.trl.row_form`)."""

    rows: list[dict] = field(default_factory=list)
    form: str | None = None
    dropped: Counter = field(default_factory=Counter)
    dropped_where: list[tuple[str, str]] = field(default_factory=list)
    repaired: Counter = field(default_factory=Counter)


def load_split(data_cfg: DataConfig, kind: str, spec: SplitSpec, fmt: QueryFormat | None) -> SplitLoad:
    """Load, filter and validate the rows of one output split (hub or local, one code path).

    Rows are TL;DR rows checked by :func:`normalise_row` against ``fmt``, or under
    ``data.format: trl`` rows in TRL's formats (:func:`rlhf_core.data.trl.normalise_trl_row`;
    ``fmt`` is ``None``), every row of a split in the same form.

    Batch filters (``spec.batches``/``spec.exclude_batches``) apply before validation, so
    bad rows of batches that are not used do not count. A second SFT row with an id seen
    before (``duplicate_id``) or a second identical comparison (``duplicate_row``) is a bad
    row, naming the first copy; a TRL-format row repeated verbatim is kept, as TRL reads it (one
    pair labelled alike by several annotators). A row without an id gets one from its content
    (:func:`content_id`). ``spec.max_rows`` keeps the first N valid rows.

    Raises:
        DataError: a bad row when ``data_cfg.on_bad_row == "error"`` (naming the file or
            dataset and the row), a missing file, a split left with no rows, or a TRL-format row
            whose form (standard or conversational) differs from the split's first row's.
    """
    result = SplitLoad()
    source = data_cfg.resolved_source()
    if source == "local":
        local_dir = data_cfg.resolved_local_dir()
        if not local_dir:
            raise DataError("data.source is local but neither data.local_dir nor RLHF_TLDR_DIR is set")
        raw: Iterable[tuple[str, dict | BadRow]] = (
            item
            for path in local_split_files(local_dir, kind, spec.source, data_cfg.format == "trl")
            for item in iter_rows(path, result.repaired)
        )
    else:
        config = data_cfg.preference_config if kind == "preference" else None
        raw = iter_hub_split(data_cfg.dataset(kind), config, spec.source, data_cfg.revision)

    seen: dict[str, str] = {}  # duplicate key -> where its first copy is
    taken: Counter = Counter()  # content ids given so far (content_id)
    repeats: list[tuple[str, str]] = []  # TRL rows repeated verbatim: (where, where the first is)
    first_form: tuple[str, str] | None = None  # (form, where) of the split's first TRL-format row
    for where, rec in raw:
        try:
            if isinstance(rec, BadRow):
                raise rec
            if data_cfg.format == "trl":
                form, row = normalise_trl_row(rec, kind, data_cfg.columns)
                if first_form is None:
                    first_form = (form, where)
                elif form != first_form[0]:
                    raise DataError(
                        f"{where}: a {form} {kind} row in a split of {first_form[0]} rows (the first at "
                        f"{first_form[1]}); one split holds one form"
                    )
                dup = json.dumps(rec, sort_keys=True, default=str)  # a whole row given twice: kept
                if dup in seen:
                    repeats.append((where, seen[dup]))
                else:
                    seen[dup] = where
                row["id"] = row["id"] or content_id(row, taken)
                row["source_row"] = where
                result.rows.append(row)
                if spec.max_rows is not None and len(result.rows) >= spec.max_rows:
                    break
                continue
            if kind == "preference" and (spec.batches is not None or spec.exclude_batches):
                batch = rec.get("batch")
                if not isinstance(batch, str):
                    raise BadRow("missing_field:batch" if batch is None else "non_string_field:batch")
                if (spec.batches is not None and batch not in spec.batches) or batch in spec.exclude_batches:
                    continue
            row = normalise_row(rec, kind, fmt)
            # an SFT post is its id (when it has one); a comparison is its whole row, since one
            # post is compared many times and one pair labelled by several workers
            dup = row["id"] if kind == "sft" else json.dumps(rec, sort_keys=True, default=str)
            if dup and dup in seen:
                reason = "duplicate_id" if kind == "sft" else "duplicate_row"
                raise BadRow(reason, f"the same {'id' if kind == 'sft' else 'row'} as {seen[dup]}")
            if dup:
                seen[dup] = where
            row["id"] = row["id"] or content_id(row, taken)
        except BadRow as bad:
            if data_cfg.on_bad_row == "error":
                raise DataError(
                    f"{where}: bad {kind} row ({bad}); fix the row or set data.on_bad_row=skip to skip and count it"
                ) from None
            result.dropped[bad.reason] += 1
            result.dropped_where.append((where, bad.reason))
            continue
        row["source_row"] = where
        result.rows.append(row)
        if spec.max_rows is not None and len(result.rows) >= spec.max_rows:
            break
    if not result.rows:
        raise DataError(f"{kind} split from source {spec.source!r} ({source}) has no valid rows after filtering")
    result.form = first_form[0] if first_form else None
    _log_repeats(kind, spec.source, repeats)
    return result


def _log_repeats(kind: str, source: str, repeats: list[tuple[str, str]]) -> None:
    """Log how many rows of a TRL-format split repeat an earlier row verbatim (kept), and the first."""
    if repeats:
        log.info(
            "%s split %r: %d row(s) repeat an earlier row verbatim and are kept, as TRL reads them (%s repeats %s)",
            kind,
            source,
            len(repeats),
            *repeats[0],
        )
