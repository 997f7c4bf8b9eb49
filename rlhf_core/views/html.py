"""HTML views of measurements for the report: the token-shift view, each response token coloured
by its rank under the pre-trained model (Huang et al. 2024, Table 8), and its CSS.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

"""CSS for :func:`token_shift_html` (also embedded in each fragment)."""


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
