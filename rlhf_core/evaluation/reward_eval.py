"""Evaluation of a reward model on preference pairs (Huang et al. 2024, Details 16-18).

Accuracy per batch, confidence and split with Wilson intervals, reward statistics (Table 5),
calibration (Figure 5), and the accuracy of two baselines that learn no preference on the same
pairs (:func:`baseline_accuracies`): "longer wins", and "the policy the training split's
labellers preferred more often wins". A reward model that does no better than these learned a
style or which policy wrote a summary, not what the labellers preferred.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..common.io import METRICS_FILE, write_json_atomic
from ..common.tracking import NullTracker, Tracker
from ..config.settings import RewardConfig
from ..data.prepared import load_data_tokenizer, load_prepared
from ..metrics.statistics import wilson_interval
from ..metrics.text import words
from ..train.external_reward import ExternalRewardModel
from ..train.reward import (
    TOKEN_TABLE_RESPONSES,
    ScalarModel,
    load_reward_model,
    response_reward_logits,
    score_pairs,
    score_responses,
    token_table,
)
from ..train.training import pick_device
from ..views.plots import plot_calibration, plot_reward_logits

log = logging.getLogger(__name__)

#: The calibration plot (Figure 5) and the file stem of the reward logits' JSON and plot
#: (Detail 13) in the reward model's evaluation output.
CALIBRATION_PLOT = "calibration.png"
REWARD_LOGITS = "reward_logits"


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
        accuracy by the 95% Wilson interval (:func:`rlhf_core.metrics.statistics.wilson_interval`).
        A grouping whose labels are all ``None`` (rows without that metadata) has no entries.
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
        if all(label is None for label in labels):  # TRL-format rows without this metadata
            log.info("%s: the rows have no %s labels, so there is no accuracy per %s", prefix, group, group)
            continue
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


#: The baselines of :func:`baseline_accuracies` as the report names them, by metric name
#: (``{prefix}/baseline/{name}/accuracy``).
BASELINES = {"longer_wins": "longer wins", "policy_prior": "the preferred policy wins"}


def longer_wins(chosen: Sequence[str], rejected: Sequence[str]) -> list[float]:
    """The "longer wins" baseline per pair: 1.0 where the chosen summary has more words than the
    rejected one (:func:`rlhf_core.metrics.text.words`), 0.0 where it has fewer, 0.5 (a coin)
    where they have as many."""
    return [
        0.5 if len(words(c)) == len(words(r)) else float(len(words(c)) > len(words(r)))
        for c, r in zip(chosen, rejected)
    ]


def policy_win_rates(
    chosen_policies: Sequence[str | None], rejected_policies: Sequence[str | None]
) -> dict[str, float]:
    """The share of its comparisons each policy won, over pairs of two different known policies
    (a training split's ``chosen_policy``/``rejected_policy``): ``{policy: wins / comparisons}``."""
    wins: dict[str, int] = defaultdict(int)
    seen: dict[str, int] = defaultdict(int)
    for c, r in zip(chosen_policies, rejected_policies):
        if c is None or r is None or c == r:
            continue
        wins[c] += 1
        seen[c] += 1
        seen[r] += 1
    return {policy: wins[policy] / n for policy, n in seen.items()}


def policy_prior_wins(
    rates: dict[str, float], chosen_policies: Sequence[str | None], rejected_policies: Sequence[str | None]
) -> list[float] | None:
    """The "preferred policy wins" baseline per pair: 1.0 where the chosen summary's policy won a
    larger share of its training comparisons (``rates``, :func:`policy_win_rates`) than the
    rejected one's, 0.0 where a smaller, 0.5 (a coin) where as large or where either policy is
    unknown to ``rates``. None when no pair has two policies known to ``rates``: then there is
    no such baseline."""
    out, known = [], False
    for c, r in zip(chosen_policies, rejected_policies):
        if c in rates and r in rates:
            known = True
            out.append(0.5 if rates[c] == rates[r] else float(rates[c] > rates[r]))
        else:
            out.append(0.5)
    return out if known else None


def baseline_accuracies(
    split_rows: dict[str, list], train_rows: dict[str, list] | None, prefix: str
) -> dict[str, float]:
    """The accuracy of the :data:`BASELINES` on one split's pairs, with 95% Wilson intervals as
    the model's (a tie counts half a success).

    Args:
        split_rows: the split's ``chosen``, ``rejected``, ``chosen_policy`` and
            ``rejected_policy`` columns; train_rows: the training split's policy columns, which
            the policy prior is learned from (None: no training split, no policy prior).
        prefix: key prefix, e.g. ``"eval"``.

    Returns:
        ``{f"{prefix}/baseline/{name}/accuracy": a, ..._ci_low, ..._ci_high}`` for
        ``longer_wins`` and, where the split has pairs of two policies the training split knows,
        ``policy_prior``.
    """
    predictions = {"longer_wins": longer_wins(split_rows["chosen"], split_rows["rejected"])}
    if train_rows is not None:
        rates = policy_win_rates(train_rows["chosen_policy"], train_rows["rejected_policy"])
        prior = policy_prior_wins(rates, split_rows["chosen_policy"], split_rows["rejected_policy"])
        if prior is not None:
            predictions["policy_prior"] = prior
    out = {}
    for name, correct in predictions.items():
        low, high = wilson_interval(sum(correct), len(correct))
        key = f"{prefix}/baseline/{name}/accuracy"
        out |= {key: sum(correct) / len(correct), f"{key}_ci_low": low, f"{key}_ci_high": high}
    return out


def evaluate_reward_model(
    cfg: RewardConfig,
    data_dir: str | os.PathLike,
    reward_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
) -> dict[str, float]:
    """Accuracy per batch, confidence and split, reward statistics and calibration (Details 16-18)
    of the reward model in ``reward_model_dir``: :func:`evaluate_pairs` with its scores
    (:func:`rlhf_core.train.reward.score_pairs`); then the reward logits at every token of a few
    validation responses (Detail 13, :func:`write_reward_logits`).

    An existing reward model (``ppo.reward: model:SOURCE``, :class:`rlhf_core.train.external_reward.ExternalRewardModel`)
    scores each pair's query with the chosen and with the rejected response through its own
    tokenizer (:func:`rlhf_core.train.reward.score_responses`); it has no per-token logits on the
    policy's tokens, so no ``reward_logits`` are written."""
    tokenizer = load_data_tokenizer(data_dir)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    model = load_reward_model(reward_model_dir, tokenizer, data_dir).to(pick_device())

    def score(rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(model, ExternalRewardModel):
            queries, size, bf16 = rows["query_token"], cfg.micro_batch_size, cfg.bf16
            chosen = score_responses(model, queries, rows["chosen_token"], pad, eos, None, size, bf16)
            rejected = score_responses(model, queries, rows["rejected_token"], pad, eos, None, size, bf16)
            return chosen.raw_scores, rejected.raw_scores
        return score_pairs(
            model,
            rows["query_chosen_token"],
            rows["query_rejected_token"],
            tokenizer.pad_token_id,
            cfg.micro_batch_size,
            cfg.bf16,
        )

    metrics = evaluate_pairs(score, cfg, data_dir, out_dir, tracker, "reward model")
    if isinstance(model, ScalarModel):
        write_reward_logits(model, cfg, data_dir, out_dir, tracker)
    return metrics


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
    ``eval/``; other splits with ``eval/{split}/`` (e.g. ``eval/validation_cnndm/accuracy``,
    and ``eval/validation_in_dist/accuracy`` for the comparisons held out of ``train``, in
    distribution: :data:`rlhf_core.config.settings.IN_DISTRIBUTION_SPLIT`). Each split's accuracy comes
    with its pair count and 95% Wilson interval (``.../count``, ``.../accuracy_ci_low``,
    ``.../accuracy_ci_high``: :func:`accuracy_by_group`), and beside it the baselines' on the
    same pairs (``.../baseline/longer_wins/accuracy``, ``.../baseline/policy_prior/accuracy``,
    the policy prior learned on the ``train`` split: :func:`baseline_accuracies`).
    Writes ``metrics.json``, ``calibration.json`` and ``calibration.png`` to ``out_dir``.

    Args:
        score: the split's rows (``query_chosen_token``, ``query_rejected_token``,
            ``query_token_len``, ``query_token``, ``chosen_token``, ``rejected_token``, torch
            tensors) -> ``(chosen_rewards, rejected_rewards)``, each ``(n,)``.

    Returns:
        The flat metrics.

    Raises:
        KeyError: ``cfg.eval_splits`` names a split the data does not have.
    """
    tracker = tracker or NullTracker()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _, pref, _ = load_prepared(data_dir)
    train_rows = pref["train"].select_columns(["chosen_policy", "rejected_policy"])[:] if "train" in pref else None
    metrics: dict[str, float] = {}
    tables: dict[str, list] = {}
    t0 = time.perf_counter()
    for split in cfg.eval_splits:
        if split not in pref:
            raise KeyError(f"reward.eval_splits names {split!r}, not a preference split ({', '.join(pref)})")
        ds = pref[split]
        ds = ds.select(range(min(len(ds), cfg.eval_max_samples or len(ds))))
        columns = ["query_chosen_token", "query_rejected_token", "query_token_len"]
        columns += ["query_token", "chosen_token", "rejected_token"]
        chosen, rejected = score(ds.with_format("torch", columns=columns)[:])
        prefix = "eval" if split == "validation" else f"eval/{split}"
        groups = {"batch": list(ds["batch"]), "confidence": list(ds["confidence"]), "split": list(ds["split"])}
        metrics.update(accuracy_by_group(chosen, rejected, groups, prefix))
        columns = ["chosen", "rejected", "chosen_policy", "rejected_policy"]
        metrics.update(baseline_accuracies(ds.select_columns(columns)[:], train_rows, prefix))
        metrics.update(reward_statistics(chosen, rejected, prefix))
        tables[split] = calibration_table(chosen, rejected, cfg.calibration_bins)
    metrics["eval/seconds"] = time.perf_counter() - t0
    write_json_atomic(out_dir / "calibration.json", tables)
    plot_calibration(tables, out_dir / CALIBRATION_PLOT)
    write_json_atomic(out_dir / METRICS_FILE, metrics)
    tracker.log_metrics(metrics)
    tracker.log_artifact(out_dir / CALIBRATION_PLOT)
    log.info("%s accuracy: %s", what, {k: round(v, 4) for k, v in metrics.items() if k.endswith("/accuracy")})
    return metrics


def non_eos_negative_share(rows: list[dict[str, Any]], key: str = "reward_logits") -> float:
    """Share of the per-token outputs ``key`` of :func:`token_table` rows that are negative,
    over every token but the one the score is read at (Detail 13: almost all, in the paper's
    reward models); NaN when there is no such token."""
    values = [v for row in rows for t, v in enumerate(row[key]) if t != row["eos_index"]]
    return sum(v < 0 for v in values) / len(values) if values else float("nan")


def write_reward_logits(
    model: ScalarModel,
    cfg: RewardConfig,
    data_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tracker: Tracker | None = None,
    n: int = TOKEN_TABLE_RESPONSES,
) -> dict[str, Any] | None:
    """The reward logits at every token of a few validation responses (Huang et al. 2024,
    Detail 13, Figure 3): only the logit at the EOS is the reward; the others are not trained
    (mostly negative for the paper's models; their sign varies with the model).

    Takes the chosen and the rejected response of the first ``n // 2`` pairs of the
    ``validation`` split (or, when ``cfg.eval_splits`` does not name it, of its first split),
    scores them in one forward pass
    (:func:`rlhf_core.train.reward.response_reward_logits`) and writes ``reward_logits.json`` and
    ``reward_logits.png`` (:func:`rlhf_core.views.plots.plot_reward_logits`) to ``out_dir``.

    ``reward_logits.json``: ``{"split", "non_eos_negative_share", "responses": [{"pair",
    "response" ("chosen" or "rejected"), "token_ids", "tokens", "reward_logits", "eos_index",
    "ends_with_eos", "score"}, ...]}`` (:func:`token_table`, :func:`non_eos_negative_share`).

    Returns:
        The JSON's content, or None (nothing written) when the split has no pairs.

    Raises:
        KeyError: the split is not a preference split of the data.
    """
    tracker = tracker or NullTracker()
    out_dir = Path(out_dir)
    if not cfg.eval_splits:
        return None
    split = "validation" if "validation" in cfg.eval_splits else cfg.eval_splits[0]
    _, pref, _ = load_prepared(data_dir)
    if split not in pref:
        raise KeyError(f"reward.eval_splits names {split!r}, not a preference split ({', '.join(pref)})")
    tokenizer = load_data_tokenizer(data_dir)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    pairs = pref[split].select(range(min(len(pref[split]), max(1, n // 2))))
    if not len(pairs):
        return None
    rows = pairs.with_format("torch", columns=["query_token", "chosen_token", "rejected_token"])[:]
    queries = rows["query_token"].repeat_interleave(2, dim=0)  # pair 0 chosen, pair 0 rejected, pair 1 ...
    responses = torch.stack([rows["chosen_token"], rows["rejected_token"]], dim=1).flatten(0, 1)
    logits, scores, indices = response_reward_logits(model, queries, responses, pad, cfg.bf16)
    table = token_table(tokenizer, responses, scores, indices, eos, pad, {"reward_logits": logits})
    table = [{"pair": i // 2, "response": ("chosen", "rejected")[i % 2], **row} for i, row in enumerate(table)]
    out = {"split": split, "non_eos_negative_share": non_eos_negative_share(table), "responses": table}
    write_json_atomic(out_dir / f"{REWARD_LOGITS}.json", out)
    plot_reward_logits(table, out_dir / f"{REWARD_LOGITS}.png", [f"pair {r['pair']}, {r['response']}" for r in table])
    tracker.log_artifact(out_dir / f"{REWARD_LOGITS}.png")
    return out
