"""Evaluation of a reward model on preference pairs (Huang et al. 2024, Details 16-18): accuracy
per batch, confidence and split with Wilson intervals, reward statistics (Table 5), and
calibration (Figure 5).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from .config import RewardConfig
from .data import load_data_tokenizer, load_prepared
from .diagnostics import wilson_interval
from .io import write_json_atomic
from .plots import plot_calibration
from .reward import ScalarModel, score_pairs
from .tracking import NullTracker, Tracker
from .training import pick_device

log = logging.getLogger(__name__)


def accuracy_by_group(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, groups: dict[str, list], prefix: str
) -> dict[str, float]:
    """Accuracy overall and within each value of each grouping (Detail 16).

    Args:
        chosen_scores, rejected_scores: ``(n,)`` rewards of the preferred and the other summary.
        groups: ``{"batch": [n labels], "confidence": [...], "split": [...]}``.
        prefix: key prefix, e.g. ``"eval"``.

    Returns:
        ``{f"{prefix}/accuracy": a, f"{prefix}/accuracy_ci_low": lo, f"{prefix}/accuracy_ci_high": hi,
        f"{prefix}/accuracy/{group}/{value}": a_v, f"{prefix}/count/{group}/{value}": n_v, ...}``;
        a pair is correct when ``chosen > rejected``; ``lo``, ``hi`` bound the overall
        accuracy by the 95% Wilson interval (:func:`rlhf_core.diagnostics.wilson_interval`).
    """
    correct = (chosen_scores > rejected_scores).float()
    low, high = wilson_interval(int(correct.sum().item()), len(correct))
    out = {
        f"{prefix}/accuracy": correct.mean().item(),
        f"{prefix}/count": float(len(correct)),
        f"{prefix}/accuracy_ci_low": low,
        f"{prefix}/accuracy_ci_high": high,
    }
    for group, labels in groups.items():
        buckets: dict[str, list[int]] = defaultdict(list)
        for i, label in enumerate(labels):
            buckets[str(label)].append(i)
        for value, idx in sorted(buckets.items()):
            out[f"{prefix}/accuracy/{group}/{value}"] = correct[idx].mean().item()
            out[f"{prefix}/count/{group}/{value}"] = float(len(idx))
    return out


def reward_statistics(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, prefix: str) -> dict[str, float]:
    """max, mean, min and std of the chosen and rejected rewards (Table 5)."""
    out = {}
    for name, s in (("chosen", chosen_scores), ("rejected", rejected_scores)):
        s = s.double()
        out.update(
            {
                f"{prefix}/reward/{name}/max": s.max().item(),
                f"{prefix}/reward/{name}/mean": s.mean().item(),
                f"{prefix}/reward/{name}/min": s.min().item(),
                f"{prefix}/reward/{name}/std": s.std().item() if len(s) > 1 else 0.0,
            }
        )
    return out


def calibration_table(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, bins: int) -> list[dict[str, float]]:
    """Accuracy against the size of the score difference (Detail 18, Figure 5).

    Pairs are binned by ``|r_chosen - r_rejected|`` into ``bins`` equal-width bins from 0
    to the largest difference. A calibrated model's accuracy in a bin centred on ``d``
    is ``1 / (1 + exp(-d))``.

    Returns:
        One row per non-empty bin: ``low``, ``high``, ``center``, ``count``, ``accuracy``,
        ``ideal``.
    """
    delta = (chosen_scores - rejected_scores).double()
    size = delta.abs()
    top = max(size.max().item(), 1e-6)
    edges = torch.linspace(0, top, bins + 1, dtype=torch.float64)
    which = torch.clamp(torch.bucketize(size, edges, right=True) - 1, 0, bins - 1)
    rows = []
    for b in range(bins):
        sel = which == b
        if not sel.any():
            continue
        center = float((edges[b] + edges[b + 1]) / 2)
        rows.append(
            {
                "low": float(edges[b]),
                "high": float(edges[b + 1]),
                "center": center,
                "count": int(sel.sum()),
                "accuracy": float((delta[sel] > 0).double().mean()),
                "ideal": 1.0 / (1.0 + math.exp(-center)),
            }
        )
    return rows


def evaluate_reward_model(
    cfg: RewardConfig,
    data_dir: str | os.PathLike,
    reward_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
) -> dict[str, float]:
    """Accuracy per batch, confidence and split, reward statistics and calibration (Details 16-18)
    of the reward model in ``reward_model_dir``: :func:`evaluate_pairs` with its scores
    (:func:`rlhf_core.reward.score_pairs`)."""
    tokenizer = load_data_tokenizer(data_dir)
    model = ScalarModel.from_pretrained(str(reward_model_dir)).to(pick_device())

    def score(rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return score_pairs(
            model,
            rows["query_chosen_token"],
            rows["query_rejected_token"],
            tokenizer.pad_token_id,
            cfg.micro_batch_size,
            cfg.bf16,
        )

    return evaluate_pairs(score, cfg, data_dir, out_dir, tracker, "reward model")


def evaluate_pairs(
    score: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
    cfg: RewardConfig,
    data_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
    what: str = "reward model",
) -> dict[str, float]:
    """Accuracy per batch, confidence and split, reward statistics and calibration (Details 16-18)
    of rewards given by ``score``: the explicit reward model's, or DPO's implicit ones.

    Evaluates each preference split in ``cfg.eval_splits`` (at most
    ``cfg.eval_max_samples`` rows each). Keys for the ``validation`` split start with
    ``eval/``; other splits with ``eval/{split}/`` (e.g. ``eval/validation_cnndm/accuracy``).
    Writes ``metrics.json``, ``calibration.json`` and ``calibration.png`` to ``out_dir``.

    Args:
        score: the split's rows (``query_chosen_token``, ``query_rejected_token``,
            ``query_token_len``, torch tensors) -> ``(chosen_rewards, rejected_rewards)``,
            each ``(n,)``.

    Returns:
        The flat metrics.

    Raises:
        KeyError: ``cfg.eval_splits`` names a split the data does not have.
    """
    tracker = tracker or NullTracker()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _, pref, _ = load_prepared(data_dir)
    metrics: dict[str, float] = {}
    tables: dict[str, list] = {}
    t0 = time.perf_counter()
    for split in cfg.eval_splits:
        if split not in pref:
            raise KeyError(f"reward.eval_splits names {split!r}, not a preference split ({', '.join(pref)})")
        ds = pref[split]
        ds = ds.select(range(min(len(ds), cfg.eval_max_samples or len(ds))))
        columns = ["query_chosen_token", "query_rejected_token", "query_token_len"]
        chosen, rejected = score(ds.with_format("torch", columns=columns)[:])
        prefix = "eval" if split == "validation" else f"eval/{split}"
        groups = {"batch": list(ds["batch"]), "confidence": list(ds["confidence"]), "split": list(ds["split"])}
        metrics.update(accuracy_by_group(chosen, rejected, groups, prefix))
        metrics.update(reward_statistics(chosen, rejected, prefix))
        tables[split] = calibration_table(chosen, rejected, cfg.calibration_bins)
    metrics["eval/seconds"] = time.perf_counter() - t0
    write_json_atomic(out_dir / "calibration.json", tables)
    plot_calibration(tables, out_dir / "calibration.png")
    write_json_atomic(out_dir / "metrics.json", metrics)
    tracker.log_metrics(metrics)
    tracker.log_artifact(out_dir / "calibration.png")
    log.info("%s accuracy: %s", what, {k: round(v, 4) for k, v in metrics.items() if k.endswith("/accuracy")})
    return metrics
