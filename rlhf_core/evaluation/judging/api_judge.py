"""What the judges behind a web API share: their settings, the key kept out of every message, the
tokens counted, and the :class:`JudgeRequestError` each failure of their SDK becomes."""

from __future__ import annotations

import threading
from typing import Any

from .errors import FATAL_STATUSES, JudgeRequestError


class ApiJudge:
    """The base of :class:`~.anthropic_judge.AnthropicJudge` and
    :class:`~.openai_judge.OpenAIJudge`: a model behind an HTTP API whose SDK client (in
    ``self._client``, with a ``base_url``) retries on its own, and is thread-safe
    (``thread_safe = True``).

    The key is never shown: ``repr``/``str`` leave it out, and every message of the errors
    made here has it replaced by ``[redacted]`` (even where the server echoes it).

    Args:
        model: the model id; also the judge's ``name`` (its :attr:`identity` keys the
            judgement cache).
        key: the API key, ``None`` for a server that needs none.
        max_retries: the SDK's retries per request after the first attempt.
        timeout: seconds per attempt.
        max_tokens: the answer's token limit.

    Attributes:
        usage: ``{"requests", "input_tokens", "output_tokens"}`` of the answered requests.
    """

    thread_safe = True
    _client: Any

    def __init__(self, model: str, key: str | None, max_retries: int, timeout: float, max_tokens: int):
        self.model = model
        self.name = model
        self.max_retries = int(max_retries)
        self.timeout = float(timeout)
        self.max_tokens = int(max_tokens)
        self._secret = key
        self._usage_lock = threading.Lock()
        self.usage = {"requests": 0, "input_tokens": 0, "output_tokens": 0}

    @property
    def base_url(self) -> str:
        """The address requests go to."""
        return str(self._client.base_url)

    @property
    def identity(self) -> str:
        """What the judgement cache keys its answers by: the model id and the server's address,
        so that one id on two servers (two quantisations, two providers) shares no answer."""
        return f"{self.model} at {self.base_url}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.model!r}, base_url={self.base_url!r}, "
            f"max_retries={self.max_retries}, timeout={self.timeout}, max_tokens={self.max_tokens})"
        )

    __str__ = __repr__

    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "[redacted]") if self._secret else text

    def _count(self, input_tokens: Any, output_tokens: Any) -> None:
        """Count an answered request and its tokens (``None`` counts 0)."""
        with self._usage_lock:
            self.usage["requests"] += 1
            self.usage["input_tokens"] += int(input_tokens or 0)
            self.usage["output_tokens"] += int(output_tokens or 0)

    def _status_error(self, status: int, etype: str, message: str, request_id: str | None) -> JudgeRequestError:
        """An error reply, after the SDK's retries unless ``status`` is in :data:`FATAL_STATUSES`."""
        text = f"{self.model}: HTTP {status} {etype}: {message}"
        if request_id:
            text += f" (request-id {request_id})"
        if status not in FATAL_STATUSES:
            text += f"; gave up after {self.max_retries} retries"
        return JudgeRequestError(self._scrub(text), status, status in FATAL_STATUSES)

    def _timeout_error(self) -> JudgeRequestError:
        return JudgeRequestError(
            f"{self.model}: timed out after {self.timeout} s; gave up after {self.max_retries} retries"
        )

    def _connection_error(self, reason: str) -> JudgeRequestError:
        return JudgeRequestError(
            self._scrub(
                f"{self.model}: connection to {self.base_url} failed ({reason}); gave up after {self.max_retries} retries"
            )
        )

    def _unreadable(self, err: Exception) -> JudgeRequestError:
        return JudgeRequestError(self._scrub(f"{self.model}: unreadable reply: {type(err).__name__}: {err}"))

    def _cut_at_limit(self, text: str, reason: str) -> JudgeRequestError:
        """A reply cut at :attr:`max_tokens` (``reason``: the API's stop reason): an error, so
        that it is reported and never cached (a reasoning model may spend the limit thinking)."""
        return JudgeRequestError(
            self._scrub(
                f"{self.model}: the answer was cut at its {self.max_tokens} tokens ({reason}) after {text[:80]!r}: "
                "raise eval.judge_max_tokens"
            )
        )
