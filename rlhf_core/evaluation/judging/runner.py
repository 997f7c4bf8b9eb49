"""Runs a judge over comparisons: the cache, a spending cap, bounded concurrency, one retry of an unreadable answer."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from tqdm.auto import tqdm

from .cache import JudgementCache
from .errors import JudgeRequestError, JudgeUnreadableError
from .prompt import parse_preference, prompt_sha256, response_is_a
from .records import Comparison, Judgement, _outcome, win_counts

log = logging.getLogger(__name__)


class Judge(Protocol):
    """What :func:`judge_comparisons` needs from a judge: ``name`` (shown), ``identity`` (keys
    its cached answers: what decides them, such as its weights' digest or its model id and
    server), ``thread_safe`` and ``answer``."""

    name: str
    identity: str
    thread_safe: bool

    def answer(self, prompt: str) -> str: ...


@dataclass
class _Job:
    comparison: Comparison
    prompt: str
    response_first: bool


def _judgement(
    job: _Job, judge_name: str, answer: str | None, attempts: int, error: str | None = None, cached: bool = False
) -> Judgement:
    preferred = parse_preference(answer) if (answer is not None and error is None) else None
    return Judgement(
        id=job.comparison.id,
        judge=judge_name,
        prompt_sha256=prompt_sha256(job.prompt),
        response_is_a=job.response_first,
        answer=answer,
        preferred=preferred,
        response_wins=_outcome(preferred, job.response_first),
        attempts=attempts,
        error=error,
        cached=cached,
        policy=job.comparison.policy,
    )


def _finish(judge: Judge, job: _Job, cache: JudgementCache | None, answer: str | None, attempts: int) -> Judgement:
    """Ask (again, at most once in all, after an invalid answer), store, and record one comparison."""
    while answer is None or (parse_preference(answer) is None and attempts < 2):
        try:
            answer = judge.answer(job.prompt)
        except JudgeRequestError as err:
            if err.fatal:
                raise
            return _judgement(job, judge.name, answer, attempts + 1, error=str(err))
        attempts += 1
    if cache is not None:
        cache.put(judge.identity, job.prompt, answer, attempts)
    return _judgement(job, judge.name, answer, attempts)


def judge_comparisons(
    judge: Judge,
    comparisons: Iterable[Comparison],
    *,
    cache: JudgementCache | None,
    seed: int,
    max_comparisons: int | None = None,
    concurrency: int = 4,
    progress: bool = True,
    orders: Literal["one", "both"] = "one",
) -> list[Judgement]:
    """Judge each comparison's response against its reference.

    Per comparison: the A/B order comes from :func:`response_is_a` (``seed``, id); with
    ``orders="both"`` the comparison is judged in the swapped order too, and the swapped
    judgement is the first one's :attr:`Judgement.swapped` (its :attr:`Judgement.outcome`
    combines the two: Zheng et al. 2023, arXiv 2306.05685). The prompt is
    :meth:`Comparison.prompt`; a cached answer of the same judge (its ``identity``) to the
    same prompt is reused without a request, per order. Otherwise the judge is asked; an answer that
    :func:`parse_preference` cannot read is asked again once with a fresh request, and if
    that one cannot be read either the order is recorded as invalid (``preferred`` and
    ``response_wins`` ``None``). Answers, valid or invalid, are cached.
    A :class:`JudgeRequestError` (the client's retries exhausted, an unreadable reply) is
    recorded with ``error`` set and not cached, so a later run asks again; a fatal one
    (bad key, model or request) is raised.

    Judges with ``thread_safe`` run up to ``concurrency`` requests at once; others run
    sequentially, through ``answer_batch`` when they have one, on prompts taken in order
    of length (so a batch pads little; a batch's answers do not depend on its padding).

    Args:
        cache: ``None`` disables caching.
        max_comparisons: spending cap: the first this many comparisons in input order are
            judged (one comparison may take two requests per order; cached answers are not
            sent again); the rest are neither judged nor returned, and a log line says how
            many. Which comparisons are judged does not depend on the cache.
        progress: show a tqdm progress bar.
        orders: ``"one"`` (the seeded order, as Huang et al. 2024, Appendix I) or ``"both"``.

    Returns:
        Judgements in input order: cache hits and the comparisons sent.

    Raises:
        ValueError: two comparisons share an id, ``max_comparisons`` < 0, ``concurrency`` < 1
            or ``orders`` is neither ``"one"`` nor ``"both"``.
        JudgeRequestError: a fatal request error (already stored answers stay cached).
    """
    if max_comparisons is not None and max_comparisons < 0:
        raise ValueError(f"max_comparisons must be >= 0, got {max_comparisons}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if orders not in ("one", "both"):
        raise ValueError(f"orders must be 'one' or 'both', got {orders!r}")
    results, pending = _cached_or_pending(judge, comparisons, cache, seed, orders)
    hits = len(results)
    pending, skipped = _spending_cap(judge, pending, results, max_comparisons)
    log.info("judge %s: %d answers cached, %d prompts to send", judge.name, hits, len(pending))
    results.update(_ask(judge, pending, cache, concurrency, progress))
    judgements = [
        replace(results[index, 0], swapped=results.get((index, 1))) if orders == "both" else results[index, 0]
        for index in sorted({index for index, _ in results})
    ]
    counts = win_counts(judgements)
    log.info(
        "judge %s: %d judged (%d wins, %d losses, %d ties, %d invalid, %d errors)%s",
        judge.name,
        len(judgements),
        counts["wins"],
        counts["losses"],
        counts["ties"],
        counts["invalid"],
        counts["errors"],
        f"; {skipped} left out by the spending cap" if skipped else "",
    )
    return judgements


#: A judgement's place: (the comparison's index in the input, 0 the seeded order / 1 swapped).
_Key = tuple[int, int]


def _cached_or_pending(
    judge: Judge,
    comparisons: Iterable[Comparison],
    cache: JudgementCache | None,
    seed: int,
    orders: Literal["one", "both"],
) -> tuple[dict[_Key, Judgement], list[tuple[_Key, _Job]]]:
    """Each comparison's job per order (:func:`response_is_a`): the judgements of the cached
    answers, and the jobs still to send, in input order.

    Raises:
        ValueError: two comparisons share an id.
    """
    results: dict[_Key, Judgement] = {}
    pending: list[tuple[_Key, _Job]] = []
    seen: set[str] = set()
    for index, comparison in enumerate(comparisons):
        if comparison.id in seen:
            raise ValueError(f"duplicate comparison id {comparison.id!r}")
        seen.add(comparison.id)
        first = response_is_a(seed, comparison.id)
        for order, response_first in enumerate((first, not first)[: 2 if orders == "both" else 1]):
            job = _Job(comparison, comparison.prompt(response_first), response_first)
            hit = cache.get(judge.identity, job.prompt) if cache is not None else None
            if hit is not None:
                results[index, order] = _judgement(job, judge.name, hit.answer, 0, cached=True)
            else:
                pending.append(((index, order), job))
    return results, pending


def _spending_cap(
    judge: Judge, pending: list[tuple[_Key, _Job]], results: dict[_Key, Judgement], max_comparisons: int | None
) -> tuple[list[tuple[_Key, _Job]], int]:
    """Keep the first ``max_comparisons`` comparisons in input order, cached or not, so that which
    comparisons are judged never depends on what the cache holds; the others' jobs are dropped
    and their cached judgements too (``results``, in place). Returns the jobs kept and how many
    comparisons were left out."""
    indices = sorted({index for index, _ in results} | {index for (index, _), _ in pending})
    if max_comparisons is None or len(indices) <= max_comparisons:
        return pending, 0
    left_out = indices[max_comparisons:]
    for index in left_out:
        results.pop((index, 0), None)
        results.pop((index, 1), None)
    log.warning(
        "judge %s: spending cap max_comparisons=%d: %d comparisons not judged",
        judge.name,
        max_comparisons,
        len(left_out),
    )
    return [(key, job) for key, job in pending if key[0] < indices[max_comparisons]], len(left_out)


def _ask(
    judge: Judge, pending: list[tuple[_Key, _Job]], cache: JudgementCache | None, concurrency: int, progress: bool
) -> dict[_Key, Judgement]:
    """Send the pending jobs (:func:`_finish`): at most ``concurrency`` at once to a thread-safe
    judge, else in order, through ``answer_batch`` (prompts by length) when the judge has one."""
    results: dict[_Key, Judgement] = {}
    bar = tqdm(
        total=len(pending), desc=f"judging ({judge.name})", disable=not progress or not pending, dynamic_ncols=True
    )
    try:
        if getattr(judge, "thread_safe", False) and concurrency > 1 and len(pending) > 1:
            with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="judge") as pool:
                futures = {pool.submit(_finish, judge, job, cache, None, 0): index for index, job in pending}
                try:
                    for future in as_completed(futures):
                        results[futures[future]] = future.result()  # re-raises a fatal error
                        bar.update(1)
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
        elif hasattr(judge, "answer_batch"):
            step = max(1, int(getattr(judge, "batch_size", 8)))
            by_length = sorted(pending, key=lambda item: len(item[1].prompt))
            for start in range(0, len(by_length), step):
                chunk = by_length[start : start + step]
                answers = judge.answer_batch([job.prompt for _, job in chunk])  # type: ignore[attr-defined]
                for (index, job), answer in zip(chunk, answers):
                    results[index] = _finish(judge, job, cache, answer, 1)
                bar.update(len(chunk))
        else:
            for index, job in pending:
                results[index] = _finish(judge, job, cache, None, 0)
                bar.update(1)
    finally:
        bar.close()
    return results


def unreadable_answers(judgements: Iterable[Judgement]) -> tuple[int, int, str | None]:
    """How many of the judgements' answers (each order's, request errors left out) name neither
    summary: ``(unreadable, answered, an example unreadable answer or None)``."""
    unreadable = answered = 0
    example = None
    for judgement in judgements:
        for order in (judgement, judgement.swapped):
            if order is None or order.error is not None or order.answer is None:
                continue
            answered += 1
            if order.preferred is None:
                unreadable += 1
                example = example if example is not None else order.answer
    return unreadable, answered, example


def require_readable(judge_name: str, judgements: list[Judgement], max_unreadable: float, what: str) -> None:
    """Stop when more than ``max_unreadable`` of the judge's answers (:func:`unreadable_answers`)
    name neither summary (``eval.max_unreadable``), rather than report verdicts of nothing.

    Raises:
        JudgeUnreadableError: naming the judge, the count and an example answer cut short.
    """
    unreadable, answered, example = unreadable_answers(judgements)
    if answered and unreadable / answered > max_unreadable:
        shown = example if len(example or "") <= 160 else f"{example[:160]}..."  # type: ignore[index]
        raise JudgeUnreadableError(
            f"judge {judge_name}: {unreadable} of {answered} answers on {what} name neither summary "
            f"(more than eval.max_unreadable={max_unreadable:g}), for example {shown!r}: use a judge that "
            "follows the prompt (a larger model, or eval.judge_prompt), or raise eval.max_unreadable; its "
            "answers stay cached, so a re-run asks nothing again"
        )
