"""What is judged (:class:`Comparison`) and what a judge said of it (:class:`Judgement`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from .prompt import Preference, format_judge_prompt


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

    Raises:
        ValueError: ``id`` is empty; TypeError: a text field is not a string.
    """

    id: str
    post: str
    response: str
    reference: str
    title: str | None = None
    policy: str | None = None

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
        return format_judge_prompt(self.post_text, a, b)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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

    @property
    def valid(self) -> bool:
        """A preference was parsed."""
        return self.preferred is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Judgement:
        return cls(**data)


def _outcome(preferred: Preference | None, response_first: bool) -> bool | None:
    if preferred is None:
        return None
    return (preferred == "A") == response_first


def win_counts(judgements: Iterable[Judgement]) -> dict[str, int]:
    """Counts of ``wins``, ``losses``, ``invalid`` answers and transport ``errors``.

    The win rate over valid answers is ``wins / (wins + losses)``.
    """
    counts = {"wins": 0, "losses": 0, "invalid": 0, "errors": 0}
    for j in judgements:
        if j.error is not None:
            counts["errors"] += 1
        elif j.response_wins is None:
            counts["invalid"] += 1
        elif j.response_wins:
            counts["wins"] += 1
        else:
            counts["losses"] += 1
    return counts
