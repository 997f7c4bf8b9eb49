"""Plots written as PNG artifacts (matplotlib, headless)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_token_lengths(lengths: dict[str, dict[str, list[int]]], path: str | os.PathLike) -> Path:
    """Histogram token lengths per split and column (Huang et al. 2024, Figures 9-10).

    Args:
        lengths: ``{"sft/train": {"query": [...], "reference_response": [...]}, ...}``,
            token counts (integers, unpadded, EOS included for responses).
        path: the PNG to write.

    Returns:
        ``path``.
    """
    rows = list(lengths)
    ncols = max(len(cols) for cols in lengths.values())
    fig, axes = plt.subplots(len(rows), ncols, figsize=(4.2 * ncols, 2.6 * len(rows)), squeeze=False)
    for r, split in enumerate(rows):
        for c in range(ncols):
            ax = axes[r][c]
            cols = list(lengths[split])
            if c >= len(cols):
                ax.axis("off")
                continue
            values = lengths[split][cols[c]]
            ax.hist(values, bins=min(50, max(5, len(set(values)))), color="#4C72B0")
            ax.axvline(max(values), color="#C44E52", linestyle="--", linewidth=1)
            ax.set_title(f"{split}: {cols[c]}\nmax={max(values)} n={len(values)}", fontsize=9)
            ax.set_xlabel("tokens", fontsize=8)
            ax.tick_params(labelsize=7)
    fig.suptitle("Token lengths (queries after truncation; responses with EOS)", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_calibration(tables: dict[str, list[dict[str, float]]], path: str | os.PathLike) -> Path:
    """Reward-model calibration (Huang et al. 2024, Detail 18, Figure 5).

    Args:
        tables: ``{split: rows}`` with rows from :func:`rlhf_core.reward_eval.calibration_table`
            (``center``, ``accuracy``, ``count``).
        path: the PNG to write.

    Returns:
        ``path``. The dashed curve is a calibrated model, ``1 / (1 + e^-delta)``.
    """
    import math

    fig, ax = plt.subplots(figsize=(5.5, 4))
    top = max([r["high"] for rows in tables.values() for r in rows] or [1.0])
    xs = [top * i / 100 for i in range(101)]
    ax.plot(xs, [1 / (1 + math.exp(-x)) for x in xs], "--", color="gray", label="calibrated: 1/(1+e^-Δ)")
    for split, rows in tables.items():
        if rows:
            ax.plot(
                [r["center"] for r in rows],
                [r["accuracy"] for r in rows],
                "o-",
                label=f"{split} (n={sum(r['count'] for r in rows)})",
            )
    ax.set_xlabel("|reward(chosen) − reward(rejected)|")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title("Reward model calibration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
