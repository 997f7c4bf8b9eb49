"""What is judged (:class:`Comparison`) and what a judge said of it (:class:`Judgement`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from .prompt import JUDGE_PROMPT, Preference, format_judge_prompt, parse_letter_logprobs


@dataclass(frozen=True)
class Comparison:
    """One policy response to judge against the reference summary of the same post.

    Attributes:
        id: unique within one evaluation; it fixes the A/B order (:func:`response_is_a`).
        post: the forum post shown to the judge.
        response: the policy's summary.
        reference: the human-written reference summary.
        title: the post's title; when set the judge sees ``"{title}\\n\\n{post}"``.
        policy: which model produced ``response`` (bookkeeping, copied to the judgement).
        template: the judge prompt (:func:`rlhf_core.evaluation.judging.prompt.load_judge_prompt`).

    Raises:
        ValueError: ``id`` is empty; TypeError: a text field is not a string.
    """

    id: str
    post: str
    response: str
    reference: str
    title: str | None = None
    policy: str | None = None
    template: str = JUDGE_PROMPT

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"comparison id must be a non-empty string, got {self.id!r}")
        for name in ("post", "response", "reference"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"comparison {self.id}: {name} must be a string")
        if self.title is not None and not isinstance(self.title, str):
            raise TypeError(f"comparison {self.id}: title must be a string or None")

    @property
    def post_text(self) -> str:
        """The text shown under "Post:"."""
        return f"{self.title}\n\n{self.post}" if self.title else self.post

    def prompt(self, response_first: bool) -> str:
        """The judge prompt, with the response as Summary A when ``response_first``."""
        a, b = (self.response, self.reference) if response_first else (self.reference, self.response)
        return format_judge_prompt(self.post_text, a, b, self.template)

    def to_dict(self) -> dict[str, Any]:
        """The comparison's fields but its prompt template (the same for every comparison)."""
        return {k: v for k, v in asdict(self).items() if k != "template"}


@dataclass(frozen=True)
class Judgement:
    """The judge's verdict on one :class:`Comparison`.

    Attributes:
        id: the comparison's id.
        judge: the judge's name (a model id).
        prompt_sha256: hex SHA-256 of the exact prompt sent.
        response_is_a: whether the policy response was Summary A.
        answer: the judge's last raw answer (``None`` when no answer was received).
        preferred: ``"A"``, ``"B"``, or ``None`` for an invalid answer or an error.
        response_wins: ``True``/``False`` when ``preferred`` is set, else ``None``.
        attempts: requests made in this run (0 for a cache hit; the cache record keeps
            the count of the run that paid for the answer).
        error: why no valid answer could be had from the transport (not cached), else ``None``.
        cached: the answer came from the cache.
        policy: copied from the comparison.
        swapped: the same comparison judged with Summary A and Summary B swapped, when both
            orders are judged (``eval.judge_orders: both``); the fields above are then those
            of the seeded order (:func:`response_is_a`), and :attr:`outcome` combines the two.
    """

    id: str
    judge: str
    prompt_sha256: str
    response_is_a: bool
    answer: str | None
    preferred: Preference | None
    response_wins: bool | None
    attempts: int
    error: str | None = None
    cached: bool = False
    policy: str | None = None
    swapped: Judgement | None = None

    @property
    def valid(self) -> bool:
        """A preference was parsed (in both orders, when both were judged)."""
        return self.preferred is not None and (self.swapped is None or self.swapped.preferred is not None)

    @property
    def response_margin(self) -> float | None:
        """``log p(response) - log p(reference)`` of an offline judge's letters in this order
        (:func:`parse_letter_logprobs`); ``None`` for a text judge's answer."""
        letters = parse_letter_logprobs(self.answer) if self.error is None else None
        if letters is None:
            return None
        margin = letters[0] - letters[1]
        return margin if self.response_is_a else -margin

    @property
    def outcome(self) -> float | None:
        """The response's result against the reference: 1.0 a win, 0.0 a loss, 0.5 a tie;
        ``None`` when a judged order has no valid answer.

        One order: the parsed preference. Both orders (:attr:`swapped` set), following
        Zheng et al. 2023 (arXiv 2306.05685, MT-Bench's swap rule): a judge that states its
        letters' log-probabilities (the offline judge) is decided by the sum of the two
        orders' margins, so a constant preference for one position cancels out (a sum of
        exactly 0 is a tie); a text judge's win needs both orders, and a split is a tie.
        """
        if self.swapped is None:
            return None if self.response_wins is None else float(self.response_wins)
        margins = (self.response_margin, self.swapped.response_margin)
        if margins[0] is not None and margins[1] is not None:
            total = margins[0] + margins[1]
            return 1.0 if total > 0 else 0.0 if total < 0 else 0.5
        if self.response_wins is None or self.swapped.response_wins is None:
            return None
        return (float(self.response_wins) + float(self.swapped.response_wins)) / 2

    @property
    def orders_agree(self) -> bool | None:
        """Whether both orders' parsed preferences pick the same summary; ``None`` with one
        order judged or an invalid answer."""
        if self.swapped is None or self.response_wins is None or self.swapped.response_wins is None:
            return None
        return self.response_wins == self.swapped.response_wins

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Judgement:
        swapped = data.get("swapped")
        if isinstance(swapped, dict):
            data = data | {"swapped": cls.from_dict(swapped)}
        return cls(**data)


def _outcome(preferred: Preference | None, response_first: bool) -> bool | None:
    if preferred is None:
        return None
    return (preferred == "A") == response_first


def win_counts(judgements: Iterable[Judgement]) -> dict[str, int]:
    """Counts of ``wins``, ``losses``, ``ties`` (both orders judged and split: :attr:`Judgement.outcome`),
    ``invalid`` answers and transport ``errors`` (in either order).

    The win rate over valid judgements is ``(wins + ties / 2) / (wins + losses + ties)``.
    """
    counts = {"wins": 0, "losses": 0, "ties": 0, "invalid": 0, "errors": 0}
    for j in judgements:
        outcome = j.outcome
        if j.error is not None or (j.swapped is not None and j.swapped.error is not None):
            counts["errors"] += 1
        elif outcome is None:
            counts["invalid"] += 1
        elif outcome == 1.0:
            counts["wins"] += 1
        elif outcome == 0.0:
            counts["losses"] += 1
        else:
            counts["ties"] += 1
    return counts
