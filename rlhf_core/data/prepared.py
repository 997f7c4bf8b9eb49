"""The data stage's output read back: the prepared splits and their statistics, its tokenizer,
the prompts PPO samples from, the check that a split has prompts, and the policy pairs each
preference split compares (Table 2). What every stage after the data stage reads of it, apart
from how the data was prepared (:mod:`rlhf_core.data.prepare`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from ..common.errors import DataError
from ..config.data_settings import LANGUAGE_MODELING, RESPONSE_COLUMNS


def token_lengths(data_dir: str | os.PathLike) -> dict[str, dict[str, list[int]]]:
    """The token lengths of every prepared split, unpadded (EOS included for responses), as
    :func:`rlhf_core.views.plots.plot_token_lengths` draws them (Huang et al. 2024, Figures 9-10):
    ``{"sft/train": {"query": [...], "reference_response": [...]}, ...}``.

    Raises:
        DataError: ``data_dir`` is not a complete data directory.
    """
    sft, preference, stats = load_prepared(data_dir)
    prompts = load_prompts(data_dir)
    sets = {"sft": sft, "preference": preference, "prompt": prompts}
    lengths = {}
    for key in stats["splits"]:
        kind, name = key.split("/", 1)
        columns = ("query", *RESPONSE_COLUMNS[kind])
        lengths[key] = {col: list(sets[kind][name][f"{col}_token_len"]) for col in columns}  # type: ignore[index]
    return lengths


def policy_pair_figures(stats: dict) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The policy pairs each preference split compares (Huang et al. 2024, Table 2, Appendix L),
    from the data stage's ``stats.json`` (:func:`rlhf_core.data.prepare.policy_pairs`), as logged
    beside the stage (``tasks``) and shown in the report.

    Args:
        stats: the data stage's ``stats.json`` (:func:`load_prepared`).

    Returns:
        ``(metrics, rows)``: per preference split ``preference/NAME`` whose rows name their
        policies, the metrics ``data/preference/NAME/policy_pairs`` (distinct pairs) and
        ``data/preference/NAME/comparisons_per_pair_min``, ``_median`` and ``_max``
        (comparison rows per pair); and one row per split and pair, most compared first,
        ``{"split": "preference/NAME", "policies": "a, b", "comparisons": n}``. Both empty
        when no split names its policies (TRL-format rows) or for a ``stats.json`` written
        before policy pairs were counted.
    """
    metrics: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    for key, split in stats["splits"].items():
        pairs = split.get("policy_pairs")
        if pairs is None:
            continue
        metrics[f"data/{key}/policy_pairs"] = float(pairs["unique"])
        for name, value in pairs["per_pair"].items():
            metrics[f"data/{key}/comparisons_per_pair_{name}"] = float(value)
        rows += [{"split": key, "policies": p["policies"], "comparisons": p["count"]} for p in pairs["pairs"]]
    return metrics, rows


def require_prompts(stats: dict, split: str, key: str) -> None:
    """Check that the SFT split ``split``, whose prompts the setting ``key`` samples from, has
    prompts: TRL's language-modelling rows (``text`` alone, :data:`rlhf_core.config.data_settings.LANGUAGE_MODELING`)
    train SFT and hold none.

    Args:
        stats: the data stage's ``stats.json`` (:func:`load_prepared`).

    Raises:
        DataError: naming ``key``, the split and what to do.
    """
    if stats["splits"].get(f"sft/{split}", {}).get("form") == LANGUAGE_MODELING:
        raise DataError(
            f"{key}: the SFT split {split!r} holds TRL language-modelling rows (text alone), with no prompt to "
            "sample from; name a split of prompt/completion or messages rows"
            + (", or give PPO prompt-only rows (data.prompt_splits)" if key.startswith("ppo") else "")
        )


def load_data_tokenizer(data_dir: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer saved by :func:`rlhf_core.data.prepare.prepare_data` (with its PAD token)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(data_dir) / "tokenizer")


def load_prepared(data_dir: str | os.PathLike) -> tuple[datasets.DatasetDict, datasets.DatasetDict, dict]:
    """Load ``(sft, preference, stats)`` written by :func:`rlhf_core.data.prepare.prepare_data`.

    Raises:
        DataError: ``data_dir`` is not a complete data directory.
    """
    root = Path(data_dir)
    if not (root / "stats.json").is_file():
        raise DataError(f"{root} is not a prepared data directory (no stats.json); run `rlhf data` first")
    stats = json.loads((root / "stats.json").read_text())
    return datasets.load_from_disk(str(root / "sft")), datasets.load_from_disk(str(root / "preference")), stats


def load_prompts(data_dir: str | os.PathLike) -> datasets.DatasetDict | None:
    """The prompt-only splits written by :func:`rlhf_core.data.prepare.prepare_data` (``data.prompt_splits``), each with
    ``query`` and ``query_token`` (left-padded), or ``None`` when the data has none."""
    root = Path(data_dir) / "prompt"
    return datasets.load_from_disk(str(root)) if root.is_dir() else None


def ppo_query_tokens(data_dir: str | os.PathLike, sft: datasets.DatasetDict, stats: dict) -> list[list[int]]:
    """The queries PPO samples from, left-padded token ids (``query_token``): the prompt-only split
    ``prompt/train`` of ``data.prompt_splits`` when the data has one (:func:`load_prompts`), else
    the SFT split ``train`` (Detail 21).

    Raises:
        DataError: the SFT split ``train`` (read for prompts) or ``validation`` (PPO's evaluation
            prompts) holds TRL language-modelling rows (:func:`require_prompts`).
    """
    prompt_only = load_prompts(data_dir)
    if prompt_only is None:
        require_prompts(stats, "train", "ppo (its prompts, the SFT split 'train')")
    require_prompts(stats, "validation", "ppo (its evaluation prompts, the SFT split 'validation')")
    return list((sft if prompt_only is None else prompt_only)["train"]["query_token"])
