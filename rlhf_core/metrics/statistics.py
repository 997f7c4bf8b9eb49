"""The measurements' statistics: a judge's win rate with its Wilson score interval (Huang et al.
2024, Figure 1), paired differences with a t interval, the win rate against summary length
(length control, Figure 8), and how often the reward model and the judge agree (Detail 17).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

"""CSS for :func:`token_shift_html` (also embedded in each fragment)."""


NAN = float("nan")


def win_rate(wins: Sequence[bool | float | None], confidence: float = 0.95) -> dict[str, float | int]:
    """Share of wins with a Wilson score interval (Huang et al. 2024, Figure 1).

    Args:
        wins: one judgement per comparison: true (1.0) when the policy's summary won, false
            (0.0) when it lost, 0.5 for a tie (both orders judged and split:
            :attr:`rlhf_core.evaluation.judging.Judgement.outcome`), ``None`` when the judgement is
            missing or could not be parsed. A tie counts as half a win, also in the interval.
        confidence: two-sided coverage of the interval, in (0, 1).

    Returns:
        ``win_rate`` (wins / valid judgements), ``ci_low`` and ``ci_high`` (the Wilson
        score interval, fractions in [0, 1]), ``n_valid`` and ``n_invalid`` (``None``
        entries). With no valid judgement the rate and both bounds are ``nan``: the
        interval is undefined there, and ``nan`` cannot be mistaken for a measurement.

    Raises:
        ValueError: ``confidence`` outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    valid = [_outcome(w) for w in wins if w is not None]
    n = len(valid)
    low, high = wilson_interval(sum(valid), n, confidence)
    return {
        "win_rate": sum(valid) / n if n else NAN,
        "ci_low": low,
        "ci_high": high,
        "n_valid": n,
        "n_invalid": len(wins) - n,
    }


def _outcome(value: bool | float) -> float:
    """A judgement as a number: 1.0 a win, 0.0 a loss, 0.5 a tie.

    Raises:
        ValueError: not one of those.
    """
    number = float(value)
    if number not in (0.0, 0.5, 1.0):
        raise ValueError(f"a judgement is a win (1), a loss (0) or a tie (0.5), got {value!r}")
    return number


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``successes / n``.

    ``(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with ``z`` the standard normal
    quantile at ``(1 + confidence) / 2`` (1.96 for 95%). E.g. 8 of 10 gives (0.490, 0.943).
    ``successes`` may be fractional (a tie counted as half a win) and is read as ``p = successes / n``.

    Returns:
        ``(low, high)`` in [0, 1] (``low`` is exactly 0 at 0 successes, ``high`` exactly 1 at
        ``n``); ``(nan, nan)`` when ``n`` is 0.

    Raises:
        ValueError: ``successes`` outside ``[0, n]`` or ``confidence`` outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return NAN, NAN
    z = NormalDist().inv_cdf((1.0 + confidence) / 2.0)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at 0 or n successes the bound is exactly 0 or 1; avoid rounding residue there
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def mean_ignoring_missing(values: Iterable[float | None]) -> float:
    """Mean of the values that are neither ``None`` nor NaN (a measurement missing for a row,
    e.g. an unreadable judgement); NaN when none is left. Infinities are kept.
    """
    present = [v for v in values if v is not None and not math.isnan(v)]
    return sum(present) / len(present) if present else NAN


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict[str, float | int]:
    """Mean of the paired differences ``a[i] - b[i]`` with Student's t interval.

    ``mean ± t * sd / sqrt(n)`` with ``sd`` the Bessel-corrected standard deviation of the
    differences and ``t`` Student's t quantile at ``(1 + confidence) / 2`` with ``n - 1``
    degrees of freedom (``scipy.stats.t``): at 8 prompts the normal quantile would make a 95%
    interval 17% too narrow. Used for two policies scored on the same prompts (e.g. PPO's and
    SFT's reward-model scores), where pairing removes the prompt-to-prompt spread.

    Args:
        a, b: equally long sequences of numbers, one pair per prompt.

    Returns:
        ``mean``, ``ci_low``, ``ci_high``, ``std`` (of the differences) and ``n``; the interval
        is ``nan`` for fewer than two pairs.

    Raises:
        ValueError: ``a`` and ``b`` differ in length, or ``confidence`` is outside (0, 1).
    """
    if len(a) != len(b):
        raise ValueError(f"paired_difference: {len(a)} values against {len(b)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = len(d)
    if n == 0:
        return {"mean": NAN, "ci_low": NAN, "ci_high": NAN, "std": NAN, "n": 0}
    mean = float(d.mean())
    if n < 2:
        return {"mean": mean, "ci_low": NAN, "ci_high": NAN, "std": NAN, "n": n}
    from scipy import stats  # imported here: the command line starts without it

    std = float(d.std(ddof=1))
    half = float(stats.t.ppf((1.0 + confidence) / 2.0, n - 1)) * std / math.sqrt(n)
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "std": std, "n": n}


def length_log_ratio(
    summaries: Sequence[str],
    references: Sequence[str],
    tokenize: Callable[[str], Sequence[Any]] | None = None,
) -> list[float]:
    """``log(len(summary) / len(reference))`` per pair (Huang et al. 2024, Figure 8's x axis).

    Args:
        summaries, references: texts, paired by position.
        tokenize: maps a text to its tokens, e.g.
            ``lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]``; lengths are
            ``len(tokenize(text))``. By default lengths are whitespace-separated words
            (``str.split``).

    Returns:
        Natural-log ratios, one float per pair: 0 for equal lengths, ``log 2 ≈ 0.693`` for a
        summary twice as long. A pair where either side has no tokens gives ``nan`` (the
        ratio is 0 or infinite); :func:`length_control` leaves such pairs out.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(summaries) != len(references):
        raise ValueError(f"{len(summaries)} summaries but {len(references)} references")
    count = (lambda s: len(s.split())) if tokenize is None else (lambda s: len(tokenize(s)))
    out = []
    for summary, reference in zip(summaries, references):
        n_s, n_r = count(summary), count(reference)
        out.append(math.log(n_s / n_r) if n_s > 0 and n_r > 0 else NAN)
    return out


def bin_edges(values: np.ndarray, bins: int | Sequence[float]) -> np.ndarray:
    if isinstance(bins, (int, np.integer)):
        if bins < 1:
            raise ValueError(f"bins must be at least 1, got {bins}")
        if values.size == 0:
            raise ValueError("no finite log ratio to derive bin edges from")
        return np.histogram_bin_edges(values, bins=int(bins))
    edges = np.asarray(bins, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or not np.all(np.isfinite(edges)) or np.any(np.diff(edges) <= 0):
        raise ValueError(f"bin edges must be at least two finite, strictly increasing numbers, got {list(bins)}")
    return edges


def length_control(
    log_ratios: Sequence[float],
    wins: Sequence[bool | None],
    bins: int | Sequence[float] = 6,
    confidence: float = 0.95,
) -> list[dict[str, float | int]]:
    """Win rate per bin of summary-to-reference length ratio (Huang et al. 2024, Figure 8, right).

    Args:
        log_ratios: from :func:`length_log_ratio`; non-finite entries are left out.
        wins: the judgements of the same pairs (see :func:`win_rate`).
        bins: a number of equal-width bins spanning the finite log ratios, or the bin edges
            (at least two, strictly increasing). Bins are half-open ``[low, high)`` except
            the last, which includes ``high`` (as :func:`numpy.histogram`); ratios outside
            the edges are left out.
        confidence: coverage of each bin's Wilson interval.

    Returns:
        One row per bin, empty bins included, in order: ``low``, ``high``, ``center``,
        ``n`` (valid judgements in the bin), ``n_invalid`` (``None`` judgements in the
        bin), ``win_rate``, ``ci_low``, ``ci_high`` (``nan`` when ``n`` is 0).

    Raises:
        ValueError: the sequences differ in length, or ``bins`` is not a positive count or
            valid edges, or ``bins`` is a count and no ratio is finite.
    """
    if len(log_ratios) != len(wins):
        raise ValueError(f"{len(log_ratios)} log ratios but {len(wins)} judgements")
    x = np.asarray(log_ratios, dtype=np.float64)
    finite = np.isfinite(x)
    edges = bin_edges(x[finite], bins)
    nbins = edges.size - 1
    which = np.searchsorted(edges, x, side="right") - 1
    which[x == edges[-1]] = nbins - 1
    which[~finite] = -1
    rows = []
    for b in range(nbins):
        members = np.flatnonzero(which == b)
        stats = win_rate([wins[i] for i in members], confidence)
        rows.append(
            {
                "low": float(edges[b]),
                "high": float(edges[b + 1]),
                "center": float((edges[b] + edges[b + 1]) / 2),
                "n": stats["n_valid"],
                "n_invalid": stats["n_invalid"],
                "win_rate": stats["win_rate"],
                "ci_low": stats["ci_low"],
                "ci_high": stats["ci_high"],
            }
        )
    return rows


def agreement(
    reward_prefers_response: Sequence[bool], judge_prefers_response: Sequence[bool | float | None]
) -> dict[str, float | int]:
    """Preference consistency between the reward model and a judge (Huang et al. 2024, Detail 17).

    Args:
        reward_prefers_response: per pair, whether the reward model scores the response
            above the other one (e.g. the policy's summary above the reference).
        judge_prefers_response: the judge's verdict on the same pairs (1.0/true the response,
            0.0/false the other, 0.5 a tie, which agrees by half); ``None`` when missing.

    Returns:
        ``agreement`` (share of pairs with a verdict where both prefer the same side;
        ``nan`` when there is none), ``n`` (pairs with a verdict), ``n_invalid``.

    Raises:
        ValueError: the sequences differ in length.
    """
    if len(reward_prefers_response) != len(judge_prefers_response):
        raise ValueError(
            f"{len(reward_prefers_response)} reward preferences but {len(judge_prefers_response)} judgements"
        )
    same = [
        _outcome(j) if r else 1.0 - _outcome(j)
        for r, j in zip(reward_prefers_response, judge_prefers_response)
        if j is not None
    ]
    n = len(same)
    return {"agreement": sum(same) / n if n else NAN, "n": n, "n_invalid": len(judge_prefers_response) - n}


def judge_label_agreement(judgements: Sequence[Any], orders: str, confidence: float = 0.95) -> dict[str, Any]:
    """How a judge decides human-labelled comparisons: agreement with the label, position bias and
    order consistency (Zheng et al. 2023, arXiv 2306.05685, Section 3.3).

    Args:
        judgements: :class:`rlhf_core.evaluation.judging.Judgement` records of comparisons whose
            response is the human's chosen summary and whose reference the rejected one.
        orders: ``"one"``: the verdict of the seeded order alone (its ``response_wins``);
            ``"both"``: :attr:`~rlhf_core.evaluation.judging.Judgement.outcome` of the two orders (needs
            ``swapped`` judgements).
        confidence: coverage of the Wilson interval.

    Returns:
        ``n`` (comparisons with a valid verdict), ``agreement`` (share agreeing with the human
        label, a tie counting half) with ``agreement_ci`` ``[low, high]``, ``a_share`` (share
        of verdicts for the summary shown as "A" in the seeded order, a tie counting half:
        0.5 for a judge without position bias), ``order_consistency`` (share of comparisons
        judged validly in both orders whose two verdicts pick the same summary; ``None``
        when no comparison was judged in both orders), ``n_invalid``.

    Raises:
        ValueError: ``orders`` is neither ``"one"`` nor ``"both"``, or ``"both"`` without
            swapped judgements.
    """
    if orders not in ("one", "both"):
        raise ValueError(f"orders must be 'one' or 'both', got {orders!r}")
    verdicts: list[tuple[float, bool]] = []  # (agreement with the label, the chosen summary shown as A)
    for j in judgements:
        if orders == "both" and j.swapped is None:
            raise ValueError(f"comparison {j.id}: orders='both' needs the swapped judgement")
        outcome = j.outcome if orders == "both" else (None if j.response_wins is None else float(j.response_wins))
        if outcome is not None:
            verdicts.append((outcome, j.response_is_a))
    n = len(verdicts)
    agree = sum(o for o, _ in verdicts)
    low, high = wilson_interval(agree, n, confidence)
    a_share = sum(o if chosen_is_a else 1.0 - o for o, chosen_is_a in verdicts)
    consistent = [j.orders_agree for j in judgements if j.orders_agree is not None]
    return {
        "n": n,
        "agreement": agree / n if n else NAN,
        "agreement_ci": [low, high],
        "a_share": a_share / n if n else NAN,
        "order_consistency": sum(consistent) / len(consistent) if consistent else None,
        "n_invalid": len(judgements) - n,
    }
