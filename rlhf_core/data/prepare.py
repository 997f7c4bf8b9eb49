"""The TL;DR data pipeline: raw rows to pre-tokenised, padded datasets (Huang et al. 2024, Details 1-6).

Two sets are built, each as a ``datasets.DatasetDict`` saved with ``save_to_disk``:

- ``sft``: the TL;DR SFT set (``id, subreddit, title, post, summary``) as queries and
  reference responses;
- ``preference``: human comparisons (``chosen``/``rejected`` with their policies,
  ``batch``, ``confidence`` and ``split``) for the reward model; ``stats.json`` counts the
  pairs of policies each split compares (Table 2, :func:`policy_pairs`).

Rows come from the Hugging Face hub (:mod:`rlhf_core.data.hub`) or from a local directory of
JSONL files in the same flat format (``RLHF_TLDR_DIR``); both go through the same validation
(:mod:`rlhf_core.data.rows`), and then here the same formatting, truncation, tokenisation and
padding.

Token conventions (Details 2, 3, 5): a query is the formatted text tokenised with the
tokenizer's special tokens (e.g. Llama's BOS), at most ``max_query_length`` tokens,
left-padded with PAD for generation. A response is ``" " + text`` tokenised without
special tokens, followed by EOS. Query+response sequences are the unpadded query tokens
followed by the response tokens, right-padded with PAD. PAD is never EOS.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from ..common.errors import DataError
from ..common.io import atomic_directory, content_digest, write_json_atomic
from ..config.data_settings import DATA_KINDS, RESPONSE_COLUMNS, DataConfig, QueryFormat
from ..config.settings import PipelineConfig
from .files import data_fingerprint
from .hub_subset import ensure_local_rows
from .rows import BadRow, load_split, template_fields
from .trl import DROPPED_BY_SETTING, trl_query

log = logging.getLogger(__name__)


# ------------------------------------------------------------- tokenisation


def format_query(row: dict, fmt: QueryFormat) -> str:
    """``fmt.template`` filled from ``row``: for TL;DR
    ``SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR:``, with no
    trailing space (Huang et al. 2024, Detail 2)."""
    return fmt.template.format(**{name: row.get(name) or "" for name in template_fields(fmt.template)})


def truncate_query(row: dict, tokenizer: PreTrainedTokenizerBase, fmt: QueryFormat) -> tuple[str, list[int], dict]:
    """Format and tokenise a query, shortening ``fmt.truncate_field`` until it fits (Detail 2).

    While the tokenised query (special tokens included) is longer than
    ``fmt.max_query_length``, the post loses its last paragraph: everything from its
    last newline on. Only when no newline remains are the post's trailing tokens cut.

    The fewest paragraphs to drop is found by bisection over the post's newlines, so a post
    of ``n`` paragraphs costs ``O(log n)`` tokenisations instead of up to ``n`` (dropping a
    paragraph never lengthens the tokenised query). The result equals dropping paragraphs one
    at a time, as the paper's code does (checked on the real rows in the tests).

    Returns:
        ``(query, query_token, counts)``: the query text; its token ids, unpadded, at most
        ``max_query_length`` long; ``{"paragraphs_removed": int, "token_cut": bool}``.

    Raises:
        BadRow: ``query_too_long`` when the query exceeds the limit even with an empty post.
    """
    limit, key = fmt.max_query_length, fmt.truncate_field
    text = row.get(key) or ""

    def encode(post: str) -> tuple[str, list[int]]:
        query = format_query({**row, key: post}, fmt)
        return query, tokenizer(query, add_special_tokens=True)["input_ids"]

    query, ids = encode(text)
    if len(ids) <= limit:
        return query, ids, {"paragraphs_removed": 0, "token_cut": False}
    # Dropping the last k paragraphs leaves text[:newlines[-k]]: bisect for the smallest k that fits.
    newlines = [i for i, char in enumerate(text) if char == "\n"]
    low, high, fitted = 1, len(newlines), None
    while low <= high:
        k = (low + high) // 2
        candidate = encode(text[: newlines[-k]])
        if len(candidate[1]) <= limit:
            fitted, high = (k, *candidate), k - 1
        else:
            low = k + 1
    if fitted is not None:
        k, query, ids = fitted
        return query, ids, {"paragraphs_removed": k, "token_cut": False}
    # Every paragraph dropped and still too long: cut the first paragraph's trailing tokens.
    text = text[: newlines[0]] if newlines else text
    query, ids = encode(text)
    token_cut = False
    while len(ids) > limit:
        if not text:
            raise BadRow("query_too_long", f"{len(ids)} tokens > {limit} even with an empty {key}")
        text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        keep = min(len(text_ids) - (len(ids) - limit), len(text_ids) - 1)
        text = tokenizer.decode(text_ids[: max(keep, 0)])
        token_cut = True
        query, ids = encode(text)
    return query, ids, {"paragraphs_removed": len(newlines), "token_cut": token_cut}


def tokenize_response(text: str, tokenizer: PreTrainedTokenizerBase, leading_space: bool = True) -> list[int]:
    """Token ids of a completion: ``" " + text`` without special tokens, then EOS (Detail 3).

    The query ends with ``TL;DR:`` and no space, so the completion brings its own leading
    space. With ``leading_space`` false (``data.format: trl``) the text is taken as given.
    """
    text = " " + text if leading_space else text
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def response_text(text: str, task: str) -> str:
    """A response as it is tokenised: ``" " + text`` for TL;DR and CNN/DM rows (Detail 3), as
    given for a TRL-format row (task ``trl``)."""
    return text if task == "trl" else " " + text


def left_pad(ids: list[int], length: int, pad_id: int) -> list[int]:
    """``ids`` preceded by ``pad_id`` to ``length`` tokens. Raises ValueError if too long."""
    if len(ids) > length:
        raise ValueError(f"sequence of {len(ids)} tokens does not fit in {length}")
    return [pad_id] * (length - len(ids)) + list(ids)


def right_pad(ids: list[int], length: int, pad_id: int) -> list[int]:
    """``ids`` followed by ``pad_id`` to ``length`` tokens. Raises ValueError if too long."""
    if len(ids) > length:
        raise ValueError(f"sequence of {len(ids)} tokens does not fit in {length}")
    return list(ids) + [pad_id] * (length - len(ids))


def _length_summary(values: Iterable[int]) -> dict[str, float]:
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "count": len(values)}


def _map(ds: datasets.Dataset, fn, desc: str) -> datasets.Dataset:
    # In-memory datasets: no cache files; an explicit fingerprint skips hashing the closure.
    return ds.map(fn, desc=desc, load_from_cache_file=False, new_fingerprint=uuid.uuid4().hex)


def _tokenize_split(
    rows: list[dict], kind: str, tokenizer, make_query, task: str, on_bad_row: str, desc: str
) -> tuple[datasets.Dataset, Counter, list[tuple[str, str]]]:
    dropped: Counter = Counter()
    dropped_where: list[tuple[str, str]] = []
    kept = []
    leading_space = task != "trl"
    for row in tqdm(rows, desc=f"{desc}: queries", disable=None, leave=False):
        try:
            query, query_ids, counts = make_query(row)
        except BadRow as bad:
            if on_bad_row == "error" and bad.reason not in DROPPED_BY_SETTING:
                raise DataError(
                    f"{row['source_row']}: bad {kind} row ({bad}); set data.on_bad_row=skip to skip it"
                ) from None
            dropped[bad.reason] += 1
            dropped_where.append((row["source_row"], bad.reason))
            continue
        row = dict(
            row,
            query=query,
            query_token_unpadded=query_ids,
            query_token_len=len(query_ids),
            paragraphs_removed=counts["paragraphs_removed"],
            token_cut=counts["token_cut"],
        )
        kept.append(row)
    ds = datasets.Dataset.from_list(kept)
    if kind == "prompt":  # prompt-only rows: the query is all there is
        return ds, dropped, dropped_where
    if kind == "sft":

        def add_response(x):
            ids = tokenize_response(x["summary"], tokenizer, leading_space)
            return {
                "reference_response": response_text(x["summary"], task),
                "reference_response_token_unpadded": ids,
                "reference_response_token_len": len(ids),
            }
    else:

        def add_response(x):
            chosen = tokenize_response(x["chosen"], tokenizer, leading_space)
            rejected = tokenize_response(x["rejected"], tokenizer, leading_space)
            return {
                "chosen_token_unpadded": chosen,
                "chosen_token_len": len(chosen),
                "rejected_token_unpadded": rejected,
                "rejected_token_len": len(rejected),
            }

    return _map(ds, add_response, desc), dropped, dropped_where


@dataclass
class TokenizedSplits:
    """Every configured split, tokenised but not yet padded (the first step of :func:`prepare_data`).

    ``datasets[kind][name]`` for kind ``sft``, ``preference`` or ``prompt``; ``tasks["kind/name"]`` is
    ``tldr``, ``cnndm`` or ``trl``; ``dropped["kind/name"]`` counts dropped rows by reason and
    ``dropped_examples`` names up to 20 of them per split (file and row); ``repaired`` counts
    what was mended and kept (a UTF-8 byte-order mark); ``forms["kind/name"]`` the form of a
    TRL-format split's rows (:func:`rlhf_core.data.trl.row_form`).
    """

    datasets: dict[str, dict[str, datasets.Dataset]]
    tasks: dict[str, str]
    dropped: dict[str, Counter]
    dropped_examples: list[dict]
    repaired: dict[str, Counter] = field(default_factory=dict)
    forms: dict[str, str] = field(default_factory=dict)


#: The response columns of each kind of split (a prompt-only row has none).
#: Token-length columns of each kind whose response cap (Detail 4) applies.
_RESPONSE_LENGTH_COLUMNS = {
    "sft": ("reference_response_token_len",),
    "preference": ("chosen_token_len", "rejected_token_len"),
}
#: Columns that only the padding step reads; they are not saved.
_UNPADDED_COLUMNS = (
    "query_token_unpadded",
    "reference_response_token_unpadded",
    "chosen_token_unpadded",
    "rejected_token_unpadded",
)


def tokenize_splits(data_cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> TokenizedSplits:
    """Load, validate, format, truncate (Details 1-2) and tokenise every split of ``data_cfg``.

    Raises:
        DataError: a bad row with ``on_bad_row: error`` (naming file and row), or an empty split.
    """
    formats = {"tldr": data_cfg.tldr_format, "cnndm": data_cfg.cnndm_format}
    out = TokenizedSplits({kind: {} for kind in DATA_KINDS}, {}, {}, [])
    for kind in DATA_KINDS:
        for name, spec in data_cfg.splits(kind).items():
            key = f"{kind}/{name}"
            if spec.task == "trl":
                fmt = None

                def make_query(row):
                    limit, cut = data_cfg.trl_max_query_length, data_cfg.prompt_truncation
                    return trl_query(row, tokenizer, limit, cut)
            else:
                fmt = formats[spec.task]

                def make_query(row, fmt=fmt):
                    return truncate_query(row, tokenizer, fmt)

            loaded = load_split(data_cfg, kind, spec, fmt)
            ds, tok_dropped, tok_where = _tokenize_split(
                loaded.rows, kind, tokenizer, make_query, spec.task, data_cfg.on_bad_row, f"tokenising {key}"
            )
            out.dropped[key] = loaded.dropped + tok_dropped
            out.repaired[key] = loaded.repaired
            where = loaded.dropped_where + tok_where
            out.dropped_examples += [{"split": key, "where": w, "reason": r} for w, r in where[:20]]
            out.datasets[kind][name] = ds
            out.tasks[key] = spec.task
            if loaded.form is not None:
                out.forms[key] = loaded.form
    return out


def apply_response_caps(splits: TokenizedSplits, data_cfg: DataConfig) -> None:
    """Drop, in place, the rows whose response exceeds its configured cap (Detail 4), counted as
    ``response_too_long``.

    Raises:
        DataError: a cap leaves a split empty.
    """
    caps = {"sft": data_cfg.max_sft_response_length, "preference": data_cfg.max_rm_response_length}
    for kind, cap in caps.items():
        if cap is None:
            continue
        for name, ds in splits.datasets[kind].items():
            columns = [list(ds[c]) for c in _RESPONSE_LENGTH_COLUMNS[kind]]
            keep = [i for i in range(len(ds)) if all(col[i] <= cap for col in columns)]
            if len(keep) < len(ds):
                splits.dropped[f"{kind}/{name}"]["response_too_long"] += len(ds) - len(keep)
                splits.datasets[kind][name] = ds.select(keep)
            if len(splits.datasets[kind][name]) == 0:
                raise DataError(f"{kind}/{name}: every row is longer than the response cap {cap}")


def holdout_rows(ds: datasets.Dataset, rows: int, seed: int, key: str = "holdout") -> tuple[list[int], list[int]]:
    """Which rows of ``ds`` a holdout of ``rows`` rows drawn with ``seed`` takes, by query.

    The distinct queries (the ``query`` column: one post compared several times, or one pair
    labelled by several workers, is one query) are shuffled with ``seed``
    (``datasets.Dataset.shuffle``); each query's rows are taken in that order while they fit in
    ``rows``, a query whose rows would overshoot being passed over, until exactly ``rows`` are
    taken. So no query is on both sides, and the same seed takes the same rows.

    Returns:
        ``(held_out, kept)``: row indices of ``ds``, each ascending; together every row once.

    Raises:
        DataError: ``rows`` is not less than the rows of ``ds``, or no set of whole queries
            makes exactly ``rows`` rows; naming ``key``.
    """
    if rows >= len(ds):
        raise DataError(f"{key}: {rows} rows held out of {len(ds)}; at least one must stay")
    by_query: dict[str, list[int]] = {}
    for i, query in enumerate(ds["query"]):
        by_query.setdefault(query, []).append(i)
    order = datasets.Dataset.from_dict({"query": list(by_query)}).shuffle(seed=seed)["query"]
    held: list[int] = []
    for query in order:
        if len(held) + len(by_query[query]) <= rows:
            held += by_query[query]
            if len(held) == rows:
                break
    if len(held) != rows:
        raise DataError(
            f"{key}: {rows} rows cannot be held out by whole queries ({len(held)} reached; "
            f"{len(ds)} rows, {len(by_query)} queries); choose another number of rows or seed"
        )
    taken = set(held)
    return sorted(held), [i for i in range(len(ds)) if i not in taken]


def apply_holdouts(splits: TokenizedSplits, data_cfg: DataConfig) -> None:
    """Move, in place, each split's ``holdout`` rows (:class:`rlhf_core.config.settings.HoldoutSpec`) into a
    split of their own, after the filters, validation and response caps, so its row count is
    exact (:func:`holdout_rows`: by query, seeded). The split keeps the other rows in their order;
    the new split has its task, follows it in the split order, and its rows keep theirs.

    Raises:
        DataError: a holdout takes every row of its split, or cannot take exactly its rows by
            whole queries; naming the ``holdout.rows`` key.
    """
    for kind in DATA_KINDS:
        specs = data_cfg.splits(kind)
        named = splits.datasets[kind]
        ordered: dict[str, datasets.Dataset] = {}
        for name, ds in named.items():
            spec = specs.get(name)
            if spec is None or spec.holdout is None:
                ordered[name] = ds
                continue
            new = spec.holdout.split
            key = f"data.{kind}_splits.{name}.holdout.rows"
            held, kept = holdout_rows(ds, spec.holdout.rows, spec.holdout.seed, key)
            ordered[name], ordered[new] = ds.select(kept), ds.select(held)
            splits.tasks[f"{kind}/{new}"] = spec.task
            if f"{kind}/{name}" in splits.forms:
                splits.forms[f"{kind}/{new}"] = splits.forms[f"{kind}/{name}"]
            splits.dropped[f"{kind}/{new}"] = Counter()
            splits.repaired[f"{kind}/{new}"] = Counter()
            log.info("%s/%s: %d of %d rows held out into %s/%s", kind, name, len(held), len(ds), kind, new)
        splits.datasets[kind] = ordered


def padded_lengths(splits: TokenizedSplits, data_cfg: DataConfig) -> dict[str, Any]:
    """The padded lengths of Detail 4: the configured query lengths, and for responses and
    query+response sequences the maxima over all splits of a set and task (a configured response
    cap replaces the response maximum).

    Returns:
        ``{"query": {task: n}, "sft_response": n, "sft_query_response": n,
        "rm_response": {task: n}, "rm_query_response": {task: n}}``, in tokens.
    """

    def longest(kind: str, task: str, columns: tuple[str, ...], extra: str | None = None) -> int:
        best = 0
        for name, ds in splits.datasets[kind].items():
            if splits.tasks[f"{kind}/{name}"] != task:
                continue
            for col in columns:
                lengths = list(ds[col])
                if extra is not None:
                    lengths = [a + b for a, b in zip(lengths, ds[extra])]
                best = max(best, max(lengths))
        return best

    lengths = {"tldr": data_cfg.tldr_format.max_query_length, "cnndm": data_cfg.cnndm_format.max_query_length}
    if data_cfg.format == "trl":
        lengths = {"trl": data_cfg.trl_max_query_length}
    sft_task = "trl" if data_cfg.format == "trl" else "tldr"
    sft_cols, rm_cols = _RESPONSE_LENGTH_COLUMNS["sft"], _RESPONSE_LENGTH_COLUMNS["preference"]
    padded: dict[str, Any] = {"query": lengths}
    padded["sft_response"] = data_cfg.max_sft_response_length or longest("sft", sft_task, sft_cols)
    padded["sft_query_response"] = longest("sft", sft_task, sft_cols, "query_token_len")
    padded["rm_response"], padded["rm_query_response"] = {}, {}
    for task in sorted({t for k, t in splits.tasks.items() if k.startswith("preference/")}):
        padded["rm_response"][task] = data_cfg.max_rm_response_length or longest("preference", task, rm_cols)
        padded["rm_query_response"][task] = longest("preference", task, rm_cols, "query_token_len")
    return padded


def pad_split(
    ds: datasets.Dataset, kind: str, task: str, padded: dict[str, Any], pad_id: int, desc: str = "padding"
) -> datasets.Dataset:
    """Add the padded token columns (Details 3, 4): queries left-padded, responses and
    query+response sequences right-padded with ``pad_id``; the unpadded columns are removed."""
    if kind == "prompt":

        def pad(x):
            return {"query_token": left_pad(x["query_token_unpadded"], padded["query"]["trl"], pad_id)}
    elif kind == "sft":

        def pad(x):
            q, r = x["query_token_unpadded"], x["reference_response_token_unpadded"]
            return {
                "query_token": left_pad(q, padded["query"]["trl" if task == "trl" else "tldr"], pad_id),
                "reference_response_token": right_pad(r, padded["sft_response"], pad_id),
                "query_reference_response_token": right_pad(q + r, padded["sft_query_response"], pad_id),
            }
    else:

        def pad(x):
            q, c, r = x["query_token_unpadded"], x["chosen_token_unpadded"], x["rejected_token_unpadded"]
            resp_len, qr_len = padded["rm_response"][task], padded["rm_query_response"][task]
            return {
                "query_token": left_pad(q, padded["query"][task], pad_id),
                "chosen_token": right_pad(c, resp_len, pad_id),
                "rejected_token": right_pad(r, resp_len, pad_id),
                "query_chosen_token": right_pad(q + c, qr_len, pad_id),
                "query_rejected_token": right_pad(q + r, qr_len, pad_id),
            }

    ds = _map(ds, pad, desc)
    return ds.remove_columns([c for c in _UNPADDED_COLUMNS if c in ds.column_names])


def policy_pairs(chosen: Iterable[str | None], rejected: Iterable[str | None]) -> dict[str, Any] | None:
    """The pairs of policies a preference split compares, and how often (Huang et al. 2024,
    Table 2 and Appendix L, Tables 21-27; Detail 6: the validation split compares far more pairs
    than the train split).

    A pair is unordered: the two policy names sorted and joined by ``", "``, as the paper writes
    them (``"ref, sup4_t0.7"``); a policy compared with itself is a pair too. Each comparison row
    counts once, whichever side was chosen.

    Args:
        chosen, rejected: the ``chosen_policy`` and ``rejected_policy`` of each row, aligned
            (strings; ``None`` or empty where a row names none, e.g. TRL-format rows).

    Returns:
        ``None`` when no row names both policies, else ``{"unique": int, "comparisons": int,
        "without_policies": int, "per_pair": {"min": int, "median": float, "max": int},
        "pairs": [{"policies": str, "count": int}, ...]}``: the number of distinct pairs, the
        rows counted, the rows left out for lacking a policy, the comparisons per pair, and
        every pair, most compared first (ties by name).
    """
    counts: Counter = Counter()
    missing = 0
    for a, b in zip(chosen, rejected):
        if not a or not b:
            missing += 1
            continue
        counts[", ".join(sorted((a, b)))] += 1
    if not counts:
        return None
    per_pair = list(counts.values())
    return {
        "unique": len(counts),
        "comparisons": sum(per_pair),
        "without_policies": missing,
        "per_pair": {"min": min(per_pair), "median": statistics.median(per_pair), "max": max(per_pair)},
        "pairs": [{"policies": p, "count": n} for p, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))],
    }


def split_statistics(ds: datasets.Dataset, kind: str, task: str) -> dict[str, Any]:
    """Rows, token-length summaries, truncation counts (and for comparisons their batches and,
    where the rows name their policies, the policy pairs compared: :func:`policy_pairs`) of one split."""
    lengths = {"query": _length_summary(ds["query_token_len"])}
    for col in RESPONSE_COLUMNS[kind]:
        lengths[col] = _length_summary(ds[f"{col}_token_len"])
    split_stats: dict[str, Any] = {
        "rows": len(ds),
        "task": task,
        "lengths": lengths,
        "truncation": {
            "paragraph": sum(1 for n in ds["paragraphs_removed"] if n > 0),
            "paragraphs_removed": sum(ds["paragraphs_removed"]),
            "token": sum(ds["token_cut"]),
        },
    }
    if kind == "preference":
        split_stats["batches"] = dict(Counter(ds["batch"]))
        if {"chosen_policy", "rejected_policy"} <= set(ds.column_names):
            pairs = policy_pairs(ds["chosen_policy"], ds["rejected_policy"])  # Table 2, Detail 6
            if pairs is not None:
                split_stats["policy_pairs"] = pairs
    return split_stats


def _tokenizer_summary(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    return {
        "name_or_path": tokenizer.name_or_path,
        "size": len(tokenizer),
        "pad_token": tokenizer.pad_token,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token": tokenizer.eos_token,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }


def _content_fingerprint(split_dir: Path) -> None:
    """Set the ``_fingerprint`` of a split saved by ``save_to_disk`` to a digest of its data
    files: ``datasets`` draws a random one for in-memory data, so the same rows would be
    saved as different files and the data stage's artifact digest would differ run to run."""
    state_path = split_dir / "state.json"
    state = json.loads(state_path.read_text())
    state["_fingerprint"] = content_digest(sorted(split_dir.glob("*.arrow")))
    write_json_atomic(state_path, state)


def _write_prepared(
    out_dir: str | os.PathLike,
    final: dict[str, datasets.DatasetDict],
    tokenizer: PreTrainedTokenizerBase,
    stats: dict[str, Any],
    overwrite: bool,
) -> None:
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        for kind, dd in final.items():
            if not dd:  # no prompt splits: no prompt/ folder
                continue
            dd.save_to_disk(str(tmp / kind))
            for name in dd:
                _content_fingerprint(tmp / kind / name)
        tokenizer.save_pretrained(tmp / "tokenizer")
        write_json_atomic(tmp / "stats.json", stats)


def prepare_data(
    cfg: PipelineConfig,
    out_dir: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase | None = None,
    overwrite: bool = False,
) -> dict:
    """Build the SFT and preference datasets of ``cfg`` and write them to ``out_dir``.

    Writes, atomically: ``sft/{split}``, ``preference/{split}`` and, with ``data.prompt_splits``,
    ``prompt/{split}`` (``save_to_disk``),
    ``tokenizer/`` (with its PAD), ``stats.json`` (token lengths, derived padded lengths,
    truncation counts, rows dropped by reason, and each preference split's policy pairs: Table 2,
    :func:`policy_pairs`). Its token lengths are drawn by whoever shows
    them (:func:`rlhf_core.data.prepared.token_lengths`, :func:`rlhf_core.views.plots.plot_token_lengths`):
    no plotting code runs in the data stage, whose output every stage after it reads.

    Padded lengths (Detail 4) are the maxima seen in the data unless
    ``cfg.data.max_sft_response_length`` / ``max_rm_response_length`` cap them; rows
    over a cap are dropped and counted. A split's ``holdout`` then moves its rows into a split
    of their own (:func:`apply_holdouts`), whose ``stats.json`` entry names the split it was
    held out of (``held_out_of``) and the seed (``holdout_seed``).

    Returns:
        The ``stats.json`` content.

    Raises:
        DataError: bad input (naming file and row), an empty split, or a tokenizer whose PAD
            is missing or equal to EOS (Detail 3).
        FileExistsError: ``out_dir`` exists and ``overwrite`` is false.
    """
    from ..models.tokenizers import load_tokenizer

    data_cfg = cfg.data
    ensure_local_rows(data_cfg)  # the rows of data.hub_subset, fetched into their folder if needed
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    if pad_id is None or pad_id == eos_id:
        raise DataError(f"tokenizer PAD id {pad_id} must exist and differ from EOS id {eos_id} (Detail 3)")

    splits = tokenize_splits(data_cfg, tokenizer)  # Details 1-2: validate, format, truncate, tokenise
    apply_response_caps(splits, data_cfg)  # Detail 4: rows over a response cap are dropped
    apply_holdouts(splits, data_cfg)  # held-out rows leave their split: the same rows, so the same lengths
    padded = padded_lengths(splits, data_cfg)  # Detail 4: padded lengths derived from the data
    final: dict[str, datasets.DatasetDict] = {}
    split_stats: dict[str, dict] = {}
    holdouts = {
        f"{kind}/{spec.holdout.split}": (name, spec.holdout)
        for kind in DATA_KINDS
        for name, spec in data_cfg.splits(kind).items()
        if spec.holdout is not None
    }
    for kind, named in splits.datasets.items():
        out = {}
        for name, ds in named.items():
            key = f"{kind}/{name}"
            split_stats[key] = split_statistics(ds, kind, splits.tasks[key])
            if key in splits.forms:  # TRL-format rows: standard, conversational, language_modeling
                split_stats[key]["form"] = splits.forms[key]
            if key in holdouts:
                parent, spec = holdouts[key]
                split_stats[key] |= {"held_out_of": parent, "holdout_seed": spec.seed}
            out[name] = pad_split(ds, kind, splits.tasks[key], padded, pad_id, f"padding {key}")  # Details 3-4
        final[kind] = datasets.DatasetDict(out)

    source = data_cfg.resolved_source()
    log.info("data read from %s", data_cfg.resolved_local_dir() if source == "local" else "the hub")
    stats: dict[str, Any] = {
        "source": source,
        "fingerprint": data_fingerprint(data_cfg),  # what was read, by content: no absolute path
        "tokenizer": _tokenizer_summary(tokenizer),
        "padded_lengths": padded,
        "splits": split_stats,
        "dropped": {k: dict(v) for k, v in splits.dropped.items() if v},
        "dropped_total": sum(sum(v.values()) for v in splits.dropped.values()),
        "dropped_examples": splits.dropped_examples,
        "repaired": {k: dict(v) for k, v in splits.repaired.items() if v},
    }
    _write_prepared(out_dir, final, tokenizer, stats, overwrite)
    log.info("data written to %s: %s", out_dir, {k: v["rows"] for k, v in split_stats.items()})
    return stats
