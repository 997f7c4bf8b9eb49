"""The ``data`` section of the configuration: where rows come from, their format, splits and queries.

:class:`DataConfig` and its parts (:class:`QueryFormat`, :class:`SplitSpec`,
:class:`HoldoutSpec`), and :class:`StrictModel`, the base of every section: unknown keys and
booleans given for numbers are refused. :mod:`rlhf_core.config.settings` composes them with the other
sections. The subset files ``data.hub_subset`` names (``configs/data/NAME.json``): where one is,
what it holds, and the cache folder its rows are fetched into (:func:`load_subset`,
:func:`subset_dir`); read here without loading ``datasets`` or the data stage.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from ..common.errors import DataError
from ..common.io import cache_root

#: The form of TRL's language-modelling rows (``text`` alone): no prompt, the whole text trained.
LANGUAGE_MODELING = "language_modeling"
#: The response columns of each kind of split, beside ``query``; each has a ``{column}_token_len``.
RESPONSE_COLUMNS = {"sft": ("reference_response",), "preference": ("chosen", "rejected"), "prompt": ()}
TLDR_QUERY_TEMPLATE = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
CNNDM_QUERY_TEMPLATE = "Article:\n{post}\n\nTL;DR:\n"
CNNDM_BATCHES = ["batch0_cnndm", "cnndm0", "cnndm2"]
#: The preference split of comparisons held out of ``train`` (``SplitSpec.holdout``): the reward
#: model's (and DPO's) in-distribution accuracy. Reports name it in distribution, and ``validation``
#: out of distribution (its policies differ from train's: Huang et al. 2024, Detail 6).
IN_DISTRIBUTION_SPLIT = "validation_in_dist"


class StrictModel(BaseModel):
    """A settings section: unknown keys, assignments that do not validate and booleans given for
    numbers are refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1 for an int field: `sft.batch_size=true` would train with 1
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            kinds = typing.get_args(annotation) or (annotation,)
            if bool not in kinds and any(k in (int, float) for k in kinds):
                raise ValueError(f"a number is needed, not the boolean {str(value).lower()}")
        return value


# --------------------------------------------------------------------------- data


#: The fields of a TL;DR row (``data.format: tldr``) that a query template may name: the post's,
#: not its summaries' (``site`` is the news site of a CNN/DM article).
QUERY_FIELDS = ("id", "subreddit", "title", "post", "site")


class QueryFormat(StrictModel):
    """How a row becomes a query (Huang et al. 2024, Detail 2).

    ``template`` is a ``str.format`` template over the row's fields (:data:`QUERY_FIELDS`);
    ``truncate_field`` is the field shortened, paragraph by paragraph, until the tokenised query
    has at most ``max_query_length`` tokens (special tokens included). A placeholder or
    ``truncate_field`` that names no field is refused when the configuration is read.
    """

    template: str = TLDR_QUERY_TEMPLATE
    truncate_field: str = "post"
    max_query_length: int = Field(512, gt=0)

    @field_validator("template")
    @classmethod
    def _fields_exist(cls, template: str) -> str:
        try:
            parsed = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
        except ValueError as exc:  # "Single '}' encountered in format string"
            raise ValueError(f"not a str.format template ({exc}); write a literal brace as {{{{ or }}}}") from None
        for name in parsed:
            if name not in QUERY_FIELDS:
                raise ValueError(
                    f"the placeholder {{{name}}} names no field of a row; the fields are "
                    + ", ".join(f"{{{f}}}" for f in QUERY_FIELDS)
                )
        return template

    @field_validator("truncate_field")
    @classmethod
    def _a_query_field(cls, name: str) -> str:
        if name not in QUERY_FIELDS:
            raise ValueError(f"{name!r} names no field of a row; one of {', '.join(QUERY_FIELDS)}")
        return name


class HoldoutSpec(StrictModel):
    """Rows moved out of a split into a split of their own (:class:`SplitSpec` ``holdout``).

    ``split`` names the new split; ``rows`` is its exact row count; ``seed`` draws them
    (``datasets.Dataset.shuffle``). Rows are held out by query: every row of a drawn query
    (one post compared several times, or one pair labelled by several workers) goes to the
    new split, so that no query of it is in the split it came from
    (:func:`rlhf_core.data.prepare.apply_holdouts`).
    """

    split: str = Field(min_length=1)
    rows: int = Field(gt=0)
    seed: int = 0


class SplitSpec(StrictModel):
    """One output split, taken from one source split.

    ``source`` names the hub split (or the local ``{set}_{source}.jsonl`` file);
    ``batches`` keeps only those comparison batches, ``exclude_batches`` drops them;
    ``max_rows`` keeps the first N valid rows; ``task`` picks the query format
    (``tldr`` or ``cnndm``; ``trl`` is the task of every split under ``data.format: trl``). ``holdout`` (:class:`HoldoutSpec`) moves ``holdout.rows`` of
    this split's rows (after the filters above, validation and the response caps) into the
    split ``holdout.split``, and this split keeps the rest, in their order: for example
    ``train: {source: validation, batches: [batch13], holdout: {split: validation_in_dist,
    rows: 200, seed: 1}}``. Unset, it is left out of the dumped settings and of the data stage's key.
    """

    source: str
    batches: list[str] | None = None
    exclude_batches: list[str] = Field(default_factory=list)
    max_rows: int | None = Field(None, gt=0)
    task: Literal["tldr", "cnndm", "trl"] = "tldr"
    holdout: HoldoutSpec | None = None

    @model_serializer(mode="wrap")
    def _no_unset_holdout(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped = handler(self)
        if self.holdout is None:
            dumped.pop("holdout", None)
        return dumped


def _default_sft_splits() -> dict[str, SplitSpec]:
    return {name: SplitSpec(source=name) for name in ("train", "validation", "test")}


def _default_preference_splits() -> dict[str, SplitSpec]:
    return {
        "train": SplitSpec(source="train"),
        "validation": SplitSpec(source="validation", exclude_batches=list(CNNDM_BATCHES)),
        "validation_cnndm": SplitSpec(source="validation", batches=list(CNNDM_BATCHES), task="cnndm"),
    }


#: TRL's column names (its ``dataset_formats`` page) that ``data.columns`` may map a user's columns onto.
TRL_COLUMNS = ("prompt", "completion", "messages", "chosen", "rejected", "text")
#: The kinds of split the data stage writes: SFT rows, preference pairs, and (``data.format:
#: trl`` only, when ``data.prompt_splits`` names them) prompt-only rows for PPO.
DATA_KINDS = ("sft", "preference", "prompt")
#: The splits read under ``data.format: trl``, each from the file or hub split of its name;
#: ``prompt`` splits only as ``data.prompt_splits`` names them.
TRL_SPLITS = {"sft": ("train", "validation", "test"), "preference": ("train", "validation"), "prompt": ("train",)}


class DataConfig(StrictModel):
    """Where the TL;DR data comes from and how it is tokenised (Details 1-6).

    ``format``: ``tldr`` (the default) reads TL;DR rows (``id, subreddit, title, post`` and a
    ``summary``, or comparisons with their policies and batches), formatted by ``tldr_format`` /
    ``cnndm_format`` (Details 1-6). ``trl`` reads rows in TRL's dataset formats
    (:mod:`rlhf_core.data.trl`): ``prompt``/``completion`` or ``messages`` for SFT,
    ``prompt``/``chosen``/``rejected`` (or ``chosen``/``rejected`` alone, sharing a prompt) for
    preferences, each as strings (standard) or message lists (conversational, through the
    tokenizer's chat template), and ``prompt`` alone (TRL's prompt-only rows, a string or a
    message list) in the splits of ``prompt_splits`` (``{train: {}}``: PPO samples its queries
    from ``prompt/train`` instead of the SFT split's; read from ``prompt_train.jsonl`` or the hub
    dataset ``prompt_dataset``). ``columns`` maps those names onto the data's own
    (``{prompt: question}``). Under ``trl`` the splits are the data's own (:data:`TRL_SPLITS`,
    :meth:`splits`): the configured splits give way, keeping only their ``max_rows`` and
    ``holdout``; prompts longer than ``max_query_length`` (unset: ``tldr_format``'s) tokens
    are cut keeping their end or start, or dropped (``prompt_truncation``). Left at their
    defaults ``format``, ``columns``, ``prompt_truncation``, ``max_query_length``,
    ``prompt_splits`` and ``prompt_dataset`` are left out of the dumped settings and of the data stage's key.

    ``source``: ``hub`` loads ``sft_dataset`` and ``preference_dataset`` from the hub
    (:func:`rlhf_core.data.hub.load_hub_split`); ``local`` reads JSONL files from ``local_dir``
    (default: the ``RLHF_TLDR_DIR`` environment variable); ``auto`` is ``local`` when a local
    directory is known, else the rows of ``hub_subset`` when it is set, else ``hub``.
    ``hub_subset`` names a subset file (``configs/data/NAME.json`` or a path): the identities
    of the rows of a local folder and the hub datasets they come from. With ``auto`` and no
    local directory, those rows are fetched once from the hub into a cache folder
    (:func:`rlhf_core.data.hub_subset.ensure_local_rows`) and read from it as a local folder.
    ``max_*_response_length`` of ``None`` derive the padded lengths from the data (Detail 4); a
    number caps them and drops longer rows, counted in ``stats.json``. ``on_bad_row`` is
    ``error`` (stop, naming file and row) or ``skip`` (drop and count). ``revision`` pins the
    hub datasets to a branch, tag or commit.
    """

    source: Literal["auto", "hub", "local"] = "auto"
    local_dir: str | None = None
    hub_subset: str | None = None
    sft_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered"
    preference_dataset: str = "openai/summarize_from_feedback"
    preference_config: str | None = "comparisons"
    revision: str | None = None
    sft_splits: dict[str, SplitSpec] = Field(default_factory=_default_sft_splits)
    preference_splits: dict[str, SplitSpec] = Field(default_factory=_default_preference_splits)
    prompt_splits: dict[str, SplitSpec] = Field(default_factory=dict)
    prompt_dataset: str | None = None
    tldr_format: QueryFormat = Field(default_factory=QueryFormat)
    cnndm_format: QueryFormat = Field(
        default_factory=lambda: QueryFormat(template=CNNDM_QUERY_TEMPLATE, max_query_length=2047 - 128)
    )
    max_sft_response_length: int | None = Field(None, gt=0)
    max_rm_response_length: int | None = Field(None, gt=0)
    on_bad_row: Literal["error", "skip"] = "error"
    format: Literal["tldr", "trl"] = "tldr"
    columns: dict[str, str] = Field(default_factory=dict)
    prompt_truncation: Literal["keep_end", "keep_start", "drop"] = "keep_end"
    max_query_length: int | None = Field(None, gt=0)

    @model_serializer(mode="wrap")
    def _no_trl_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped = handler(self)
        defaults = {
            "format": "tldr",
            "columns": {},
            "prompt_truncation": "keep_end",
            "max_query_length": None,
            "prompt_splits": {},
            "prompt_dataset": None,
        }
        for key, default in defaults.items():
            if dumped.get(key) == default:
                dumped.pop(key, None)
        return dumped

    @field_validator("columns")
    @classmethod
    def _trl_names(cls, columns: dict[str, str]) -> dict[str, str]:
        for name, column in columns.items():
            if name not in TRL_COLUMNS:
                raise ValueError(f"data.columns.{name}: not one of TRL's columns ({', '.join(TRL_COLUMNS)})")
            if not column:
                raise ValueError(f"data.columns.{name}: an empty column name")
        named: dict[str, str] = {}
        for name, column in columns.items():
            if column in named:
                raise ValueError(
                    f"data.columns.{named[column]} and data.columns.{name} both read column {column!r}; "
                    "one column becomes one of TRL's columns"
                )
            named[column] = name
        return columns

    def splits(self, kind: Literal["sft", "preference", "prompt"]) -> dict[str, SplitSpec]:
        """The splits of ``kind`` the data stage reads: ``{kind}_splits`` under ``format: tldr``;
        under ``trl`` the data's own (:data:`TRL_SPLITS`), each read from the file or hub split of
        its name, with the ``max_rows`` and ``holdout`` of the configured split of that name
        (``prompt`` splits only where ``prompt_splits`` names them)."""
        configured: dict[str, SplitSpec] = getattr(self, f"{kind}_splits")
        if self.format == "tldr":
            return configured
        out = {}
        for name in TRL_SPLITS[kind]:
            spec = configured.get(name)
            if kind == "prompt" and spec is None:
                continue
            out[name] = SplitSpec(
                source=name,
                task="trl",
                max_rows=spec.max_rows if spec else None,
                holdout=spec.holdout if spec else None,
            )
        return out

    def dataset(self, kind: str) -> str:
        """The hub dataset (or local directory in the hub layout) the splits of ``kind`` come from.

        Raises:
            DataError: ``prompt`` splits from the hub without ``data.prompt_dataset``.
        """
        if kind == "prompt":
            if self.prompt_dataset is None:
                raise DataError("data.prompt_splits from the hub need data.prompt_dataset (a prompt-only dataset)")
            return self.prompt_dataset
        return self.sft_dataset if kind == "sft" else self.preference_dataset

    @property
    def trl_max_query_length(self) -> int:
        """The prompt length limit under ``format: trl``, in tokens: ``max_query_length``, else
        ``tldr_format.max_query_length``."""
        return self.max_query_length or self.tldr_format.max_query_length

    @field_validator("hub_subset")
    @classmethod
    def _check_subset(cls, name: str | None) -> str | None:
        if name is not None:
            subset_path(name)  # a missing file is named now, not when the rows are first read
        return name

    @field_validator("prompt_splits", mode="before")
    @classmethod
    def _prompt_split_sources(cls, splits: Any) -> Any:
        """``{train: {}}`` reads the split of its name: the source may be left out."""
        if isinstance(splits, dict):
            return {name: {"source": name, **spec} if isinstance(spec, dict) else spec for name, spec in splits.items()}
        return splits

    @model_validator(mode="after")
    def _check_prompt_splits(self) -> DataConfig:
        if self.prompt_splits and self.format != "trl":
            raise ValueError("data.prompt_splits: prompt-only rows are read under data.format: trl")
        for name in self.prompt_splits:
            if name not in TRL_SPLITS["prompt"]:
                raise ValueError(f"data.prompt_splits.{name}: PPO's prompts are the split 'train'; name it train")
        return self

    @model_validator(mode="after")
    def _check_holdouts(self) -> DataConfig:
        for kind in DATA_KINDS:
            splits: dict[str, SplitSpec] = getattr(self, f"{kind}_splits")
            taken: dict[str, str] = {}  # held-out split -> the split it is held out of
            for name, spec in splits.items():
                if spec.holdout is None:
                    continue
                key, new = f"data.{kind}_splits.{name}.holdout.split", spec.holdout.split
                if new in splits:
                    raise ValueError(f"{key}: {new!r} is already a split of data.{kind}_splits; name a new split")
                if new in taken:
                    raise ValueError(f"{key}: {new!r} is also held out of {taken[new]!r}; name another split")
                taken[new] = name
            if kind != "preference":
                continue
            if IN_DISTRIBUTION_SPLIT in splits:
                raise ValueError(
                    f"data.preference_splits.{IN_DISTRIBUTION_SPLIT}: the in-distribution split is held out of "
                    f"train, not read from a source: set data.preference_splits.train.holdout: "
                    f"{{split: {IN_DISTRIBUTION_SPLIT}, rows: N, seed: S}}"
                )
            if taken.get(IN_DISTRIBUTION_SPLIT, "train") != "train":
                raise ValueError(
                    f"data.preference_splits.{taken[IN_DISTRIBUTION_SPLIT]}.holdout.split: "
                    f"{IN_DISTRIBUTION_SPLIT!r} names the comparisons held out of train (the reward model's "
                    "in-distribution accuracy); hold it out of train or name the split otherwise"
                )
        return self

    def resolved_source(self) -> Literal["hub", "local"]:
        """``hub`` or ``local``, resolving ``auto`` from ``local_dir``/``RLHF_TLDR_DIR``, then
        ``hub_subset`` (its rows are read as a local folder)."""
        if self.source != "auto":
            return self.source
        return "local" if self.resolved_local_dir() else "hub"

    def subset_in_use(self) -> str | None:
        """``hub_subset`` when its rows are what is read: ``source`` is ``auto`` and neither
        ``local_dir`` nor ``$RLHF_TLDR_DIR`` is set, and the format is ``tldr`` (the subset's
        rows are TL;DR rows); else ``None``."""
        if self.format != "tldr":
            return None
        explicit = self.local_dir or os.environ.get("RLHF_TLDR_DIR")
        return self.hub_subset if self.source == "auto" and not explicit else None

    def resolved_local_dir(self) -> str | None:
        """``local_dir``, else ``$RLHF_TLDR_DIR``, else the cache folder of ``hub_subset`` under
        ``auto`` (:func:`subset_dir`; there or not yet), else ``None``.
        Under ``format: trl`` only ``local_dir``: the other two hold TL;DR rows."""
        if self.format == "trl":
            return self.local_dir or None
        if self.subset_in_use():
            return str(subset_dir(self.hub_subset))  # type: ignore[arg-type]
        return self.local_dir or os.environ.get("RLHF_TLDR_DIR") or None


# ------------------------------------------------------------- subset files
# The subset files of the hub's TL;DR rows (``configs/data/NAME.json``, named by
# ``data.hub_subset``): where one is, what it holds, and the cache folder its rows are fetched
# into. A subset file lists, for each file of a local data folder, the identity of every row and
# the hub dataset, revision and split it comes from (:mod:`rlhf_core.data.hub_subset` fetches them).


#: Where ``data.hub_subset`` names are looked up: ``configs/data/NAME.json``.
SUBSET_DIR = Path(__file__).resolve().parents[2] / "configs" / "data"


@dataclass(frozen=True)
class HubDataset:
    """One hub dataset a subset reads: its id, config (``None`` for none) and revision."""

    id: str
    config: str | None
    revision: str


@dataclass(frozen=True)
class SubsetFile:
    """One file of the local folder: its rows' kind, the hub split they come from, where the
    local file's rows came from (``source``, for messages), their identities in order and each
    one's content digest (:func:`rlhf_core.data.hub_subset.content_digest`)."""

    name: str
    kind: str
    split: str
    source: str
    rows: tuple[str, ...]
    digests: tuple[str, ...]


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
            SubsetFile(fname, f["kind"], f["split"], f.get("source", ""), tuple(f["rows"]), tuple(f["digests"]))
            for fname, f in doc["files"].items()
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{path}: not a subset file ({type(exc).__name__}: {exc})") from None
    for f in files:
        if f.kind not in sets:
            raise DataError(f"{path}: files.{f.name}.kind {f.kind!r} names no entry of datasets ({', '.join(sets)})")
        if len(set(f.rows)) != len(f.rows):
            raise DataError(f"{path}: files.{f.name}.rows names a row twice")
        if len(f.digests) != len(f.rows):
            raise DataError(
                f"{path}: files.{f.name}.digests has {len(f.digests)} entries for its {len(f.rows)} rows "
                "(one content digest per row; infra/tldr_subset.py writes them)"
            )
    return HubSubset(path, hashlib.sha256(raw).hexdigest()[:12], sets, files)


def subset_dir(name: str) -> Path:
    """The cache folder of subset ``name``: ``rows/<name>@<revisions>-<digest>`` under
    :func:`rlhf_core.common.io.cache_root` (``$RLHF_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlhf``, else
    ``~/.cache/rlhf``), named with the hub revisions it reads and the digest of the subset file,
    so an edited subset or another revision is fetched into a folder of its own.

    Raises:
        DataError: the subset file is missing or invalid.
    """
    subset = load_subset(name)
    revisions = "+".join(d.revision.replace("/", "_")[:12] for d in subset.datasets.values())
    return cache_root() / "rows" / f"{subset.name}@{revisions}-{subset.digest}"
