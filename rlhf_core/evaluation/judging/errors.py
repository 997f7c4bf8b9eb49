"""The judges' errors."""

from __future__ import annotations


class JudgeError(RuntimeError):
    """A judge could not produce an answer."""


class JudgeConfigError(JudgeError, ValueError):
    """A judge cannot be set up (for example, no API key)."""


class JudgeUnreadableError(JudgeError):
    """Too many of a judge's answers named neither summary (``eval.max_unreadable``): its
    verdicts would measure nothing. The answers stay in the judgement cache."""


class JudgeRequestError(JudgeError):
    """A request failed after the client's own retries, or its reply could not be read.

    Attributes:
        status: the HTTP status of the last reply, ``None`` for connection errors,
            timeouts and unreadable replies.
        fatal: ``True`` when every further request would fail the same way (HTTP 400,
            401, 403, 404: a bad request shape, key, permission or model name);
            :func:`judge_comparisons` stops on these instead of recording them.
    """

    def __init__(self, message: str, status: int | None = None, fatal: bool = False):
        super().__init__(message)
        self.status = status
        self.fatal = fatal


#: HTTP statuses after which every further request would fail the same way (``JudgeRequestError.fatal``).
FATAL_STATUSES = (400, 401, 403, 404)
