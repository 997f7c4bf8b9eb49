"""Evaluation diagnostics beyond one win rate: uncertainty, length control, copying, diversity.

* :func:`rouge_l` — ROUGE-L F1 of summaries against references (SFT and evaluation).
* :func:`win_rate` — a judge's win rate with a Wilson score interval (Huang et al. 2024, Figure 1).
* :func:`mean_ignoring_missing` — a mean over the rows that have the measurement.
* :func:`length_log_ratio`, :func:`length_control`, :func:`plot_length_control` — win rate
  against ``log(summary length / reference length)`` (Huang et al. 2024, Figure 8).
* :func:`title_coverage`, :func:`title_copy_rate` — how much of the post's title a summary
  repeats, a cheap shortcut a policy can learn instead of summarising.
* :func:`normalized_edit_distance`, :func:`diversity` — how different the samples for one
  prompt are from each other (a collapsed policy writes the same summary every time).
* :func:`agreement` — how often the reward model and the judge prefer the same response
  (Huang et al. 2024, Detail 17).
* :func:`token_ranks`, :func:`token_shift_html` — which response tokens the pre-trained
  model would also have picked (Huang et al. 2024, Table 8).

Words, wherever this module counts or compares them (except :func:`length_log_ratio`,
which counts whitespace-separated words), come from :func:`words`: ``rouge-score``'s
tokenizer without stemming — lower-cased, every run of characters other than ``a-z`` and
``0-9`` is a separator (so punctuation disappears and ``"boyfriend's"`` is
``["boyfriend", "s"]``; non-ASCII letters are separators too).
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import torch
from rouge_score import tokenize as _rouge_tokenize

from .io import atomic_file

NAN = float("nan")


# --------------------------------------------------------------------------- win rate


def rouge_l(predictions: list[str], references: list[str]) -> list[float]:
    """ROUGE-L F1 of each prediction against its reference (``rouge-score``, Porter stemming)."""
    from rouge_score import rouge_scorer  # imports NLTK (and scikit-learn): only where ROUGE is computed

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references)]


def win_rate(wins: Sequence[bool | float | None], confidence: float = 0.95) -> dict[str, float | int]:
    """Share of wins with a Wilson score interval (Huang et al. 2024, Figure 1).

    Args:
        wins: one judgement per comparison: true (1.0) when the policy's summary won, false
            (0.0) when it lost, 0.5 for a tie (both orders judged and split:
            :attr:`rlhf_core.judging.Judgement.outcome`), ``None`` when the judgement is
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


# --------------------------------------------------------------------------- length control


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


def _bin_edges(values: np.ndarray, bins: int | Sequence[float]) -> np.ndarray:
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
    edges = _bin_edges(x[finite], bins)
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
    edges = _bin_edges(pooled[np.isfinite(pooled)], bins)
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


# --------------------------------------------------------------------------- copying and diversity


def words(text: str) -> list[str]:
    """The words this module compares: ``rouge-score``'s tokenizer without stemming.

    Lower-cased; every run of characters other than ``a-z0-9`` separates words, so
    punctuation is dropped (``"My [24F] dog's!"`` -> ``["my", "24f", "dog", "s"]``).
    """
    return _rouge_tokenize.tokenize(text, None)


def repetition_loop(text: str, min_span: int = 6) -> tuple[str, ...] | None:
    """The first block of words that the text repeats back to back over at least ``min_span`` words, or ``None``.

    A degenerate policy loops ("I'm not sure if I should eat it. I'm not sure if I should eat
    it. ...") until the token limit cuts it; a loop is a run of words (:func:`words`, so
    punctuation and case are ignored) immediately followed by itself at least once, the
    repeats together covering ``min_span`` words or more. With the default of 6, "I love you, I
    love you" and "we met, we met, we met" are loops; "very very good" and "the the the" are not.

    Returns:
        The repeated block, or ``None`` when the text has no such loop.

    Raises:
        ValueError: ``min_span`` < 2.
    """
    if min_span < 2:
        raise ValueError(f"min_span must be >= 2, got {min_span}")
    w = words(text)
    for start in range(len(w)):
        for length in range(1, (len(w) - start) // 2 + 1):
            block = w[start : start + length]
            repeats = 1
            while w[start + repeats * length : start + (repeats + 1) * length] == block:
                repeats += 1
            if repeats >= 2 and repeats * length >= min_span:
                return tuple(block)
    return None


def repetition_rate(texts: Sequence[str], min_span: int = 6, confidence: float = 0.95) -> dict[str, float | int]:
    """Share of texts with a :func:`repetition_loop`, with its Wilson interval.

    Returns:
        ``rate``, ``ci_low``, ``ci_high`` (``nan`` for no texts) and ``n``.
    """
    hits = sum(repetition_loop(t, min_span) is not None for t in texts)
    low, high = wilson_interval(hits, len(texts), confidence)
    return {"rate": hits / len(texts) if texts else NAN, "ci_low": low, "ci_high": high, "n": len(texts)}


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def title_coverage(summary: str, title: str) -> float:
    """Share of the title's words that the summary repeats in order.

    The length of the longest common subsequence of the two word lists (see
    :func:`words`) divided by the number of title words: 1.0 when the summary contains the
    whole title in order (an exact copy), 0.0 when it shares no word with it.

    Returns:
        A float in [0, 1].

    Raises:
        ValueError: the title has no words.
    """
    t = words(title)
    if not t:
        raise ValueError(f"title {title!r} has no words")
    return _lcs_length(words(summary), t) / len(t)


def title_copy_rate(summaries: Sequence[str], titles: Sequence[str], threshold: float = 0.8) -> dict[str, Any]:
    """Share of summaries that copy their post's title (coverage ≥ ``threshold``).

    Args:
        summaries, titles: texts, paired by position.
        threshold: the :func:`title_coverage` from which a summary counts as a copy.

    Returns:
        ``rate`` (copies / ``n``; ``nan`` when ``n`` is 0), ``n`` (pairs with a title),
        ``n_copied``, ``n_no_title`` (pairs left out because the title has no words),
        ``mean_coverage`` (``nan`` when ``n`` is 0) and ``copied_indices`` (positions of
        the copies in the input).

    Raises:
        ValueError: the sequences differ in length.
    """
    if len(summaries) != len(titles):
        raise ValueError(f"{len(summaries)} summaries but {len(titles)} titles")
    coverages, copied, no_title = [], [], 0
    for i, (summary, title) in enumerate(zip(summaries, titles)):
        if not words(title or ""):
            no_title += 1
            continue
        c = title_coverage(summary, title)
        coverages.append(c)
        if c >= threshold:
            copied.append(i)
    n = len(coverages)
    return {
        "rate": len(copied) / n if n else NAN,
        "n": n,
        "n_copied": len(copied),
        "n_no_title": no_title,
        "mean_coverage": sum(coverages) / n if n else NAN,
        "copied_indices": copied,
    }


def normalized_edit_distance(a: str, b: str) -> float:
    """Word-level Levenshtein distance divided by the longer text's word count.

    Words come from :func:`words`; insertions, deletions and substitutions cost 1 each.

    Returns:
        A float in [0, 1]: 0 for texts with the same words, 1 for texts of equal length
        that share no word at any aligned position; 0 when both have no words.
    """
    from nltk.metrics.distance import edit_distance  # heavy import, needed only here

    wa, wb = words(a), words(b)
    longest = max(len(wa), len(wb))
    return edit_distance(wa, wb) / longest if longest else 0.0


def diversity(samples_per_prompt: Sequence[Sequence[str]]) -> dict[str, float | int]:
    """Mean pairwise :func:`normalized_edit_distance` among the samples of each prompt.

    For each prompt with at least two samples, the distance is averaged over all
    unordered pairs of its samples; those per-prompt means are averaged over prompts.

    Returns:
        ``mean`` (in [0, 1]: 0 when every prompt's samples are identical; ``nan`` when no
        prompt has two samples), ``n_prompts`` (prompts used) and ``n_skipped`` (prompts
        with fewer than two samples).
    """
    means, skipped = [], 0
    for samples in samples_per_prompt:
        if len(samples) < 2:
            skipped += 1
            continue
        d = [
            normalized_edit_distance(samples[i], samples[j])
            for i in range(len(samples))
            for j in range(i + 1, len(samples))
        ]
        means.append(sum(d) / len(d))
    return {"mean": sum(means) / len(means) if means else NAN, "n_prompts": len(means), "n_skipped": skipped}


# --------------------------------------------------------------------------- reward model vs judge


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
        judgements: :class:`rlhf_core.judging.Judgement` records of comparisons whose
            response is the human's chosen summary and whose reference the rejected one.
        orders: ``"one"``: the verdict of the seeded order alone (its ``response_wins``);
            ``"both"``: :attr:`~rlhf_core.judging.Judgement.outcome` of the two orders (needs
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


# --------------------------------------------------------------------------- token shift


def token_ranks(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Rank of each actual token among a model's predictions (Huang et al. 2024, Table 8).

    For the token-shift view, ``logits`` are the *pre-trained* model's next-token logits
    at the positions that predict an aligned model's response tokens (position ``t``
    already shifted to predict ``token_ids[t]``).

    Args:
        logits: float ``[T, V]`` (any leading dimensions ``[..., V]`` work alike).
        token_ids: long ``[T]`` (``logits.shape[:-1]``), values in ``[0, V)``.

    Returns:
        Long tensor shaped like ``token_ids``: 1 + the number of vocabulary entries with a
        strictly larger logit, so 1 is the argmax. Ties resolve in the token's favour: a
        token tied with the maximum has rank 1, and tied tokens share the best rank.

    Raises:
        ValueError: the shapes do not match or an id is outside ``[0, V)``.
    """
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not predict token_ids {tuple(token_ids.shape)}")
    ids = token_ids.long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= logits.shape[-1]):
        raise ValueError(f"token ids must lie in [0, {logits.shape[-1]})")
    actual = logits.gather(-1, ids.unsqueeze(-1))
    return (logits > actual).sum(-1).long() + 1


_BUCKETS = (  # class, background colour, legend label
    ("tok-top1", "#bcd4f6", "top-1: the pre-trained model's greedy choice (unshifted)"),
    ("tok-top3", "#f8e49a", "rank 2-3: marginal"),
    ("tok-shifted", "#f4b0ab", "rank > 3: shifted"),
)

TOKEN_SHIFT_CSS = (
    ".token-shift{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:0.9em;line-height:1.7}"
    ".token-shift .tokens{white-space:pre-wrap;word-break:break-word}"
    ".token-shift .legend span{margin-right:1em;padding:0 0.3em}"
    + "".join(f".token-shift .{cls}{{background:{colour}}}" for cls, colour, _ in _BUCKETS)
)
"""CSS for :func:`token_shift_html` (also embedded in each fragment)."""


def rank_bucket(rank: int) -> str:
    """The CSS class of a token rank: ``tok-top1`` (1), ``tok-top3`` (2-3), ``tok-shifted`` (> 3).

    Raises:
        ValueError: ``rank`` below 1.
    """
    if rank < 1:
        raise ValueError(f"ranks start at 1, got {rank}")
    return _BUCKETS[0][0] if rank == 1 else _BUCKETS[1][0] if rank <= 3 else _BUCKETS[2][0]


def token_shift_html(tokens: Sequence[str], ranks: Sequence[int]) -> str:
    """An HTML fragment colouring each token by its rank under the pre-trained model
    (Huang et al. 2024, Table 8): blue top-1 (unshifted), yellow rank 2-3 (marginal),
    red rank > 3 (shifted).

    Args:
        tokens: the response's tokens as display strings, each decoded on its own so that
            spaces and newlines are kept (``tokenizer.decode([id])``).
        ranks: from :func:`token_ranks`, one per token.

    Returns:
        A ``<div class="token-shift">`` with its own ``<style>``, a legend counting the
        tokens per bucket, and one ``<span class="tok-…" title="rank r">`` per token, the
        token text HTML-escaped. No script and no external reference.

    Raises:
        ValueError: the sequences differ in length or a rank is below 1.
    """
    if len(tokens) != len(ranks):
        raise ValueError(f"{len(tokens)} tokens but {len(ranks)} ranks")
    classes = [rank_bucket(int(r)) for r in ranks]
    n = len(classes)
    legend = " ".join(
        f'<span class="{cls}">{html.escape(label)}: {classes.count(cls)}'
        f"{f' ({100 * classes.count(cls) / n:.0f}%)' if n else ''}</span>"
        for cls, _, label in _BUCKETS
    )
    spans = "".join(
        f'<span class="{cls}" title="rank {int(r)}">{html.escape(tok)}</span>'
        for tok, r, cls in zip(tokens, ranks, classes)
    )
    return (
        f'<div class="token-shift"><style>{TOKEN_SHIFT_CSS}</style>'
        f'<div class="legend">{legend}</div><div class="tokens">{spans}</div></div>'
    )
