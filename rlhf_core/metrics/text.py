"""Measurements of the summaries' text: ROUGE-L against references, repetition loops, how much of
the post's title a summary copies, how different the samples for one prompt are, and which
response tokens the pre-trained model would also have picked (Huang et al. 2024, Table 8).

Words, wherever this module counts or compares them, come from :func:`words`: ``rouge-score``'s
tokenizer without stemming — lower-cased, every run of characters other than ``a-z`` and ``0-9``
is a separator (so punctuation disappears and ``"boyfriend's"`` is ``["boyfriend", "s"]``;
non-ASCII letters are separators too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from rouge_score import tokenize as _rouge_tokenize

from .statistics import NAN, wilson_interval

"""CSS for :func:`token_shift_html` (also embedded in each fragment)."""


def rouge_l(predictions: list[str], references: list[str]) -> list[float]:
    """ROUGE-L F1 of each prediction against its reference (``rouge-score``, Porter stemming)."""
    from rouge_score import rouge_scorer  # imports NLTK (and scikit-learn): only where ROUGE is computed

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references)]


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
