"""A model on any OpenAI-compatible server as judge, through the Chat Completions API. The only module that imports ``openai``."""

from __future__ import annotations

import os
from typing import Any

import openai

from ...config.settings import OPENAI_API_URL, is_openai_api
from .api_judge import ApiJudge
from .errors import JudgeConfigError, JudgeRequestError

#: The key sent to a server that needs none (any OpenAI-compatible server but the OpenAI API)
#: when ``OPENAI_API_KEY`` is unset: the client cannot be built without one.
NO_KEY = "no-key"


def _key(api_key: str | None, base_url: str, who: str) -> str | None:
    """``api_key``, else for the OpenAI API's hosts (:func:`is_openai_api`) ``OPENAI_API_KEY``,
    else ``None``: another server is never sent ``OPENAI_API_KEY``, only a key given for it.

    Raises:
        JudgeConfigError: no key and ``base_url`` is the OpenAI API.
    """
    openai_api = is_openai_api(base_url)
    key = api_key or (os.environ.get("OPENAI_API_KEY") if openai_api else None) or None
    if key is None and openai_api:
        raise JudgeConfigError(
            f"{who} needs an API key for {base_url}: set the OPENAI_API_KEY environment variable (or pass "
            "api_key=...), or point eval.judge_base_url at a server that needs none"
        )
    return key


def _status_text(err: openai.APIStatusError) -> tuple[str, str]:
    """The error's type and message as the server gave them (``{"error": {...}}`` or a bare error object)."""
    error = err.body if isinstance(err.body, dict) else None
    etype = error.get("type") if error else None
    emsg = error.get("message") if error else None
    return str(etype or type(err).__name__), str(emsg or err.message)


def _connection_text(err: openai.APIConnectionError) -> str:
    """The client's message and the transport's reason (``ConnectError: [Errno 111] Connection refused``)."""
    cause = err.__cause__
    return f"{err.message} {type(cause).__name__}: {cause}" if cause is not None else err.message


class OpenAIJudge(ApiJudge):
    """A model on an OpenAI-compatible server as judge, through the Chat Completions API
    (``openai.OpenAI``): the OpenAI API itself, or vLLM, llama.cpp's server, Ollama and the like.

    The prompt is sent as the single user turn; the first choice's message content is the
    answer (its ``refusal`` when the content is null, else ``""``: an answer naming neither
    summary, asked again once by :func:`judge_comparisons`, then invalid). The SDK retries
    connection errors, timeouts, 408, 409, 429 and 5xx replies up to ``max_retries`` times
    with exponential backoff (0.5 s doubling, at most 8 s, with jitter), and waits as long as
    a ``retry-after-ms`` or ``retry-after`` header asks (up to 2 minutes). The client is
    thread-safe (``thread_safe = True``).

    OpenAI's request shape (``openai_request``; by default on the OpenAI API's hosts,
    :func:`~rlhf_core.config.settings.is_openai_api`) sends ``max_completion_tokens`` and no
    temperature (its reasoning models refuse ``max_tokens`` and any temperature but the
    default; like the Anthropic judge's, its answers need not repeat, and
    :class:`JudgementCache` makes a finished evaluation reproducible); the compatible shape
    sends ``max_tokens`` and ``temperature: 0`` (greedy), which vLLM, llama.cpp and Ollama all
    read. A reply cut at the token limit (``finish_reason`` ``length``: a reasoning model that
    spent it thinking) raises :class:`JudgeRequestError`, so it is reported and never cached.

    The key: ``api_key``, else on the OpenAI API's hosts ``OPENAI_API_KEY``, which they need;
    another server is sent ``api_key`` only, else :data:`NO_KEY`. The SDK sends it as
    ``Authorization: Bearer <key>``. It is never shown (:class:`~.api_judge.ApiJudge`), and
    the SDK's own exception is not chained to the errors raised.

    Args:
        model: the model id the server serves, e.g. ``gpt-4o-mini`` or
            ``Qwen/Qwen2.5-7B-Instruct``; also the judge's ``name``. Its ``identity``, which
            keys the judgement cache, is the id and ``base_url``.
        api_key: the key; ``None`` reads ``OPENAI_API_KEY`` on the OpenAI API's hosts.
        base_url: the server's API root (``eval.judge_base_url``), e.g.
            ``http://127.0.0.1:8000/v1``; default the OpenAI API.
        max_retries: retries per request after the first attempt.
        timeout: seconds per attempt.
        max_tokens: the answer's token limit (``eval.judge_max_tokens``).
        openai_request: OpenAI's request shape (``eval.judge_request``); ``None``: on the
            OpenAI API's hosts.

    Raises:
        JudgeConfigError: no model id; or no key given, ``OPENAI_API_KEY`` unset or empty,
            and ``base_url`` the OpenAI API.
    """

    def __init__(
        self,
        model: str,
        api_key: str | None = None,
        base_url: str = OPENAI_API_URL,
        max_retries: int = 4,
        timeout: float = 60.0,
        max_tokens: int = 256,
        openai_request: bool | None = None,
    ):
        if not model:
            raise JudgeConfigError("OpenAIJudge needs a model id (eval.judge_model)")
        key = _key(api_key, base_url, "OpenAIJudge")
        super().__init__(model, key, max_retries, timeout, max_tokens)
        self.openai_request = is_openai_api(base_url) if openai_request is None else bool(openai_request)
        self._client = openai.OpenAI(
            api_key=key or NO_KEY, base_url=base_url, max_retries=self.max_retries, timeout=self.timeout
        )

    def answer(self, prompt: str) -> str:
        """Send ``prompt`` and return the text of the reply (possibly empty).

        Raises:
            JudgeRequestError: the request failed after the SDK's retries (status and
                error type in the message; ``fatal`` for :data:`FATAL_STATUSES`), the reply is
                not a chat completion with a message, or it was cut at ``max_tokens``.
        """
        if self.openai_request:
            limits: dict[str, Any] = {"max_completion_tokens": self.max_tokens}
        else:
            limits = {"max_tokens": self.max_tokens, "temperature": 0}
        try:
            completion = self._client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}], **limits
            )
        except openai.APIStatusError as err:
            raise self._status_error(err.status_code, *_status_text(err), err.request_id) from None
        except openai.APITimeoutError:
            raise self._timeout_error() from None
        except openai.APIConnectionError as err:
            raise self._connection_error(_connection_text(err)) from None
        except (openai.APIResponseValidationError, ValueError) as err:
            raise self._unreadable(err) from None
        text = self._completion_text(completion)
        usage = getattr(completion, "usage", None)
        self._count(getattr(usage, "prompt_tokens", 0), getattr(usage, "completion_tokens", 0))
        if getattr(completion.choices[0], "finish_reason", None) == "length":
            raise self._cut_at_limit(text, "finish_reason length")
        return text

    def _completion_text(self, completion: Any) -> str:
        choices = getattr(completion, "choices", None)
        message = getattr(choices[0], "message", None) if isinstance(choices, list) and choices else None
        if message is None:
            shown = self._scrub(repr(completion)[:200])
            raise JudgeRequestError(f"{self.model}: reply is not a chat completion with a message: {shown}")
        content = getattr(message, "content", None)
        if isinstance(content, str):
            return content
        refusal = getattr(message, "refusal", None)
        return refusal if isinstance(refusal, str) else ""


def served_models(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> list[str]:
    """The ids of the models the server at ``base_url`` serves (``GET {base_url}/models``, one
    attempt, no retry), asked with the key :class:`OpenAIJudge` would send.

    Returns:
        The model ids in the server's order.

    Raises:
        JudgeConfigError: the OpenAI API and no key (``api_key`` or ``OPENAI_API_KEY``).
        JudgeRequestError: the server cannot be reached or times out (``status`` ``None``),
            answers with an error status (``status`` set), or its reply is not a model list;
            the key never in the message.
    """
    key = _key(api_key, base_url, "the model list")
    client = openai.OpenAI(api_key=key or NO_KEY, base_url=base_url, max_retries=0, timeout=timeout)

    def scrub(text: str) -> str:
        return text.replace(key, "[redacted]") if key else text

    try:
        models = list(client.models.list())
    except openai.APIStatusError as err:
        etype, emsg = _status_text(err)
        raise JudgeRequestError(scrub(f"HTTP {err.status_code} {etype}: {emsg}"), err.status_code) from None
    except openai.APITimeoutError:
        raise JudgeRequestError(f"timed out after {timeout} s") from None
    except openai.APIConnectionError as err:
        raise JudgeRequestError(scrub(f"connection failed ({_connection_text(err)})")) from None
    except (openai.APIResponseValidationError, ValueError, TypeError, AttributeError) as err:
        raise JudgeRequestError(scrub(f"unreadable model list: {type(err).__name__}: {err}")) from None
    finally:
        client.close()
    ids = [getattr(model, "id", None) for model in models]
    if not all(isinstance(i, str) for i in ids):
        raise JudgeRequestError(scrub(f"unreadable model list: an entry without an id: {models[:3]!r}"[:300]))
    return ids  # type: ignore[return-value]
