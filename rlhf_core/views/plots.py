"""Plots written as PNG artifacts (matplotlib on its file-only backend, imported on first use),
each written atomically: the report's and the evaluation stages'; no training stage imports this
module, so that an edit here re-runs none of them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..common.io import atomic_file
from ..metrics.statistics import bin_edges, length_control, win_rate


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, imported on first use: the stages
    that draw nothing do not pay for its import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def savefig_atomic(fig: Any, path: str | os.PathLike, dpi: int = 90) -> Path:
    """Save a matplotlib figure as PNG through a temporary sibling file and a rename, then close it.

    A reader never sees a half-written image under ``path``; on an error nothing is left.
    """
    try:
        with atomic_file(path, "wb") as fh:
            fig.savefig(fh, format="png", dpi=dpi)
    finally:
        pyplot().close(fig)
    return Path(path)


def plot_length_control(
    curves: dict[str, tuple[Sequence[float], Sequence[bool | None]]],
    path: str | os.PathLike,
    bins: int | Sequence[float] = 6,
    confidence: float = 0.95,
) -> Path:
    """Win rate against ``log(summary length / reference length)``, one curve per policy
    (Huang et al. 2024, Figure 8, right), written atomically as a PNG.

    Args:
        curves: ``{policy name: (log ratios, judgements)}``, as for :func:`length_control`.
        path: the PNG to write.
        bins: a count of equal-width bins spanning the finite ratios of *all* policies
            (so every curve shares the same bins), or explicit edges.
        confidence: coverage of the shaded Wilson interval around each curve.

    Returns:
        ``path``. Points are bin centres with at least one valid judgement; the dashed line
        is a 50% win rate and the dotted line equal lengths.

    Raises:
        ValueError: as :func:`length_control`.
    """
    pooled = np.asarray([r for ratios, _ in curves.values() for r in ratios], dtype=np.float64)
    edges = bin_edges(pooled[np.isfinite(pooled)], bins)
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for name, (ratios, wins) in curves.items():
        rows = [r for r in length_control(ratios, wins, edges, confidence) if r["n"] > 0]
        xs = [r["center"] for r in rows]
        total = win_rate(wins, confidence)
        (line,) = ax.plot(
            xs,
            [r["win_rate"] for r in rows],
            "o-",
            label=f"{name}: {100 * total['win_rate']:.1f}% overall (n={total['n_valid']})",
        )
        ax.fill_between(
            xs,
            [r["ci_low"] for r in rows],
            [r["ci_high"] for r in rows],
            color=line.get_color(),
            alpha=0.15,
            linewidth=0,
        )
    ax.axhline(0.5, color="gray", linestyle="--", linewidth=1)
    ax.axvline(0.0, color="gray", linestyle=":", linewidth=1)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(0, 1)
    ax.set_xlabel("log(summary length / reference length)")
    ax.set_ylabel("win rate against the reference")
    ax.set_title(f"Win rate by summary length ({round(100 * confidence)}% Wilson interval shaded)", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return savefig_atomic(fig, path)


#: The file stem of the win rate against mean summary length (:func:`plot_win_rate_by_length`).
WIN_RATE_BY_LENGTH = "win_rate_by_length"


def plot_win_rate_by_length(
    points: dict[str, tuple[float, dict[str, float]]],
    path: str | os.PathLike,
    reference_tokens: float | None = None,
    groups: dict[str, str] | None = None,
) -> Path:
    """Each policy's win rate against the reference summaries by its mean summary length in
    tokens, one point with its interval per policy (Huang et al. 2024, Figure 7 right and
    Figure 8 left: longer summaries win more often, so a win rate is read beside its length),
    written atomically as a PNG.

    Args:
        points: ``{policy name: (mean summary length in tokens, win_rate result)}``, the
            result as :func:`rlhf_core.metrics.statistics.win_rate` returns it (``win_rate``,
            ``ci_low``, ``ci_high``); a point whose length or win rate is not finite is left out.
        path: the PNG to write.
        reference_tokens: the references' mean length in tokens, drawn as a dotted line.
        groups: ``{policy name: group}``: policies of one group share a colour and a legend
            entry (for example the cells of a sweep with and without reward whitening); by
            default every policy is its own group.

    Returns:
        ``path``. The dashed line is a 50% win rate.
    """
    groups = groups or {name: name for name in points}
    fig, ax = pyplot().subplots(figsize=(6, 4))
    colours: dict[str, Any] = {}
    for name, (tokens, result) in points.items():
        rate = result["win_rate"]
        if not (np.isfinite(tokens) and np.isfinite(rate)):
            continue
        group = groups.get(name, name)
        low, high = result.get("ci_low", np.nan), result.get("ci_high", np.nan)
        err = [[rate - low], [high - rate]] if np.isfinite(low) and np.isfinite(high) else None
        bars = ax.errorbar(
            [tokens],
            [rate],
            yerr=err,
            fmt="o",
            capsize=3,
            color=colours.get(group),
            label=None if group in colours else group,
        )
        colours.setdefault(group, bars.lines[0].get_color())
    ax.axhline(0.5, color="gray", linestyle="--", linewidth=1)
    if reference_tokens is not None and np.isfinite(reference_tokens):
        ax.axvline(reference_tokens, color="gray", linestyle=":", linewidth=1, label="reference mean length")
    ax.set_ylim(0, 1)
    ax.set_xlabel("mean summary length (tokens)")
    ax.set_ylabel("win rate against the reference")
    ax.set_title("Win rate by mean summary length (95% Wilson intervals)", fontsize=10)
    if colours:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return savefig_atomic(fig, path)


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
    fig, axes = pyplot().subplots(len(rows), ncols, figsize=(4.2 * ncols, 2.6 * len(rows)), squeeze=False)
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
    pyplot().close(fig)
    return path


def plot_calibration(tables: dict[str, list[dict[str, float]]], path: str | os.PathLike) -> Path:
    """Reward-model calibration (Huang et al. 2024, Detail 18, Figure 5).

    Args:
        tables: ``{split: rows}`` with rows from :func:`rlhf_core.evaluation.reward_eval.calibration_table`
            (``center``, ``accuracy``, ``count``).
        path: the PNG to write.

    Returns:
        ``path``. The dashed curve is a calibrated model, ``1 / (1 + e^-delta)``.
    """
    import math

    fig, ax = pyplot().subplots(figsize=(5.5, 4))
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
    pyplot().close(fig)
    return path


def _token_labels(tokens: Sequence[str], n: int) -> list[str]:
    """Tick labels of ``n`` positions: each token escaped (newlines shown as \\n, "$" not read as
    mathtext), and "(after EOS)" for a position past the last token."""
    labels = [repr(t)[1:-1].replace("$", r"\$") for t in tokens[:n]]
    return labels + ["(after EOS)"] * (n - len(labels))


def _logits_panel(ax: Any, row: dict[str, Any], label: str, lines: Sequence[tuple[str, str]]) -> None:
    """Bars of ``row``'s ``reward_logits`` per token, the bar of the token the score is read at
    (``eos_index``) in another colour and labelled with its value, and a line for each
    ``(key, legend)`` of ``lines``."""
    xs = list(range(len(row["tokens"])))
    eos = row["eos_index"]
    colours = [
        "#DD8452" if x == eos else ("#4C72B0" if v >= 0 else "#8C8C8C") for x, v in zip(xs, row["reward_logits"])
    ]
    ax.bar(xs, row["reward_logits"], color=colours, width=0.8, label="reward logit")
    for key, legend in lines:
        ax.plot(xs, row[key], "o-", color="#55A868", markersize=2.5, linewidth=1.2, label=legend)
    ax.axhline(0, color="black", linewidth=0.6)
    if 0 <= eos < len(xs):
        end = "EOS" if row["ends_with_eos"] else "last token, no EOS"
        _mark(ax, eos, row["reward_logits"][eos], f"{end}: {row['reward_logits'][eos]:.2f}")
    _token_axis(ax, row["tokens"], len(xs))
    ax.set_title(f"{label} (score {row['score']:.3f})", fontsize=9)
    if lines:
        ax.legend(fontsize=7, loc="best")


def _rewards_panel(ax: Any, row: dict[str, Any], label: str) -> None:
    """Huang et al. 2024, Figure 11: bars of ``row``'s per-token ``rewards`` (the KL penalty, and
    at ``score_index`` the score added, orange and labelled), PPO's ``ppo_values`` as a line, on
    a symmetric-log axis linear up to the largest KL penalty, so that penalties of a few
    thousandths show beside a score of a few units."""
    rewards, s = row["rewards"], row["score_index"]
    xs = list(range(len(rewards)))
    colours = ["#DD8452" if x == s else ("#4C72B0" if v >= 0 else "#8C8C8C") for x, v in zip(xs, rewards)]
    ax.bar(xs, rewards, color=colours, width=0.8, label="reward: KL penalty (+ score at orange)")
    ax.plot(xs, row["ppo_values"], "o-", color="#55A868", markersize=2.5, linewidth=1.2, label="value (before token)")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_yscale("symlog", linthresh=max([1e-4] + [abs(v) for v in row["kl_penalty"]]))
    if 0 <= s < len(xs):
        _mark(ax, s, rewards[s], f"score {row['ppo_score']:.2f}")
    _token_axis(ax, row["tokens"], len(xs))
    ax.set_title(f"{label}: rewards and values as PPO reads them", fontsize=9)
    ax.legend(fontsize=7, loc="best")


def _mark(ax: Any, x: int, y: float, text: str) -> None:
    ax.annotate(
        text,
        (x, y),
        textcoords="offset points",
        xytext=(-4, 6),
        ha="right",
        fontsize=7,
        color="#DD8452",
        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
    )


def _token_axis(ax: Any, tokens: Sequence[str], n: int) -> None:
    ax.set_xticks(list(range(n)))
    ax.set_xticklabels(_token_labels(tokens, n), rotation=90, fontsize=5.5)
    ax.set_xlim(-0.7, max(n, 1) - 0.3)
    ax.tick_params(axis="y", labelsize=7)


def _plot_per_token(
    rows: Sequence[dict[str, Any]],
    path: str | os.PathLike,
    labels: Sequence[str],
    lines: Sequence[tuple[str, str]],
    title: str,
    rewards: bool = False,
) -> Path:
    """One row of panels per response, tokens on the x axis: :func:`_logits_panel` (its reward
    logits with the ``lines``), and with ``rewards`` beside it :func:`_rewards_panel` (Figure 11)."""
    longest = max([len(r.get("rewards", r["tokens"])) for r in rows] or [1])
    ncols = 2 if rewards else 1
    width = min(12.0 if rewards else 18.0, 3.0 + 0.16 * longest)
    fig, axes = pyplot().subplots(
        max(1, len(rows)), ncols, figsize=(width * ncols, 2.5 * max(1, len(rows))), squeeze=False
    )
    for i, (row, label) in enumerate(zip(rows, labels)):
        _logits_panel(axes[i, 0], row, label, lines)
        if rewards:
            _rewards_panel(axes[i, 1], row, label)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return savefig_atomic(fig, path)


def plot_reward_logits(rows: Sequence[dict[str, Any]], path: str | os.PathLike, labels: Sequence[str]) -> Path:
    """The reward model's output at every token of a few responses (Huang et al. 2024, Detail 13,
    Figure 3), written atomically as a PNG.

    Args:
        rows: :func:`rlhf_core.train.reward.token_table` rows with ``reward_logits``.
        path: the PNG to write.
        labels: one panel title per row.

    Returns:
        ``path``. The orange bar is the score (the logit at the EOS, Detail 12); grey bars are
        negative logits, blue ones positive.
    """
    return _plot_per_token(
        rows, path, labels, [], "Reward logits per token: only the one at the EOS (orange) is a reward"
    )


def plot_value_vs_reward(rows: Sequence[dict[str, Any]], path: str | os.PathLike, labels: Sequence[str]) -> Path:
    """The trained value model read as a per-token reward model (Huang et al. 2024, Detail 22):
    its value at every token of a few responses (line) over the reward model's logits (bars),
    and, where the rows carry PPO's rewards (:func:`rlhf_core.ppo.eval.ppo_rewards_and_values`), beside
    it in the same row the rewards and values of the same response as PPO reads them (Figure 11:
    the per-token KL penalty, the score added at the EOS, the value of each token), written
    atomically as a PNG.

    Args:
        rows: :func:`rlhf_core.train.reward.token_table` rows with ``reward_logits`` and ``values``
            (and ``rewards``, ``kl_penalty``, ``ppo_values``, ``score_index``, ``ppo_score``).
        path: the PNG to write.
        labels: one row title per response.

    Returns:
        ``path``.
    """
    rewards = bool(rows) and all("rewards" in r for r in rows)
    title = "Value model (line) against reward-model logits (bars) per token; orange: the score at the EOS"
    if rewards:
        title += "; right: PPO's per-token rewards (bars, symmetric-log axis) and values (line), Figure 11"
    return _plot_per_token(rows, path, labels, [("values", "value")], title, rewards=rewards)
