"""A Claude model as judge, through the Anthropic Messages API. The only module that imports ``anthropic``."""

from __future__ import annotations

import os
from typing import Any

import anthropic

from .api_judge import ApiJudge
from .errors import JudgeConfigError, JudgeRequestError


class AnthropicJudge(ApiJudge):
    """A Claude model as judge, through the Anthropic Messages API (``anthropic.Anthropic``).

    The prompt is sent as the single user turn; the reply's text blocks, joined, are the
    answer. The SDK retries connection errors, timeouts, 408, 409, 429 and 5xx replies up
    to ``max_retries`` times with exponential backoff (0.5 s doubling, at most 8 s, with
    jitter), and waits as long as a ``retry-after-ms`` or ``retry-after`` header asks when
    the server sends one. The client is thread-safe (``thread_safe = True``).

    No sampling parameters are sent: the API version that ``anthropic`` 2.x speaks
    (``anthropic-version: 2026-10-21``) rejects ``temperature``, ``top_p`` and ``top_k``
    with HTTP 400, and the SDK no longer accepts them. Answers are therefore not
    guaranteed to repeat; :class:`JudgementCache` makes a finished evaluation reproducible.
    The SDK sends the key as ``Authorization: Bearer <key>``.

    The API key is never shown (:class:`~.api_judge.ApiJudge`), and the SDK's own exception is
    not chained to the errors raised.

    Args:
        model: the model id, e.g. ``claude-haiku-4-5``; also the judge's ``name``.
        api_key: the key; ``None`` reads ``ANTHROPIC_API_KEY``.
        base_url: the API's address; ``None`` lets the SDK read ``ANTHROPIC_BASE_URL``
            (default ``https://api.anthropic.com``).
        max_retries: retries per request after the first attempt.
        timeout: seconds per attempt.
        max_tokens: the answer's token limit (``eval.judge_max_tokens``).

    Raises:
        JudgeConfigError: no key given and ``ANTHROPIC_API_KEY`` unset or empty.
    """

    def __init__(
        self,
        model: str,
        api_key: str | None = None,
        base_url: str | None = None,
        max_retries: int = 4,
        timeout: float = 60.0,
        max_tokens: int = 256,
    ):
        if not model:
            raise JudgeConfigError("AnthropicJudge needs a model id (eval.judge_model)")
        key = api_key or os.environ.get("ANTHROPIC_API_KEY") or None
        if key is None:
            raise JudgeConfigError(
                "AnthropicJudge needs an API key: set the ANTHROPIC_API_KEY environment variable (or pass api_key=...)"
            )
        super().__init__(model, key, max_retries, timeout, max_tokens)
        self._client = anthropic.Anthropic(
            api_key=key, base_url=base_url, max_retries=self.max_retries, timeout=self.timeout
        )

    def answer(self, prompt: str) -> str:
        """Send ``prompt`` and return the text of the reply (possibly empty).

        Raises:
            JudgeRequestError: the request failed after the SDK's retries (status and
                error type in the message), the reply is not a readable message, or it was
                cut at ``max_tokens`` (``stop_reason`` ``max_tokens``).
        """
        try:
            message = self._client.messages.create(
                model=self.model, max_tokens=self.max_tokens, messages=[{"role": "user", "content": prompt}]
            )
        except anthropic.APIStatusError as err:
            error = err.body.get("error") if isinstance(err.body, dict) else None
            etype = error.get("type") if isinstance(error, dict) else None
            emsg = error.get("message") if isinstance(error, dict) else err.message
            etype = str(etype or type(err).__name__)
            raise self._status_error(err.status_code, etype, emsg, getattr(err, "request_id", None)) from None
        except anthropic.APITimeoutError:
            raise self._timeout_error() from None
        except anthropic.APIConnectionError as err:
            raise self._connection_error(err.message) from None
        except (anthropic.APIResponseValidationError, ValueError) as err:
            raise self._unreadable(err) from None
        text = self._message_text(message)
        usage = getattr(message, "usage", None)
        self._count(getattr(usage, "input_tokens", 0), getattr(usage, "output_tokens", 0))
        stop = getattr(message, "stop_reason", None)
        if stop in ("max_tokens", "model_context_window_exceeded"):
            raise self._cut_at_limit(text, f"stop_reason {stop}")
        return text

    def _message_text(self, message: Any) -> str:
        content = getattr(message, "content", None)
        if not isinstance(content, list):
            shown = self._scrub(repr(message)[:200])
            raise JudgeRequestError(f"{self.model}: reply is not a message with content: {shown}")
        return "".join(getattr(block, "text", "") or "" for block in content if getattr(block, "type", None) == "text")
