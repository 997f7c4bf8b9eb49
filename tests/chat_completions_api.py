"""A scriptable OpenAI-compatible Chat Completions server on 127.0.0.1 for tests.

:class:`ChatCompletionsAPI` serves ``POST /v1/chat/completions`` and ``GET /v1/models`` from a
``ThreadingHTTPServer`` running in a background thread (the machinery of
:class:`tests.messages_api.MessagesAPI`: scripted :class:`Reply` objects in a queue, else a
handler that sees the request; every request recorded with its method, path, headers, JSON
body and arrival time). The queue and the handler answer completions only; ``/v1/models``
lists :attr:`ChatCompletionsAPI.models`. Set as ``HTTP_PROXY``, it answers plain-HTTP requests
for any host too, e.g. for ``http://api.openai.com/v1`` (:func:`route_path`).

Bodies follow the OpenAI API: a success is a ``chat.completion`` object, an error is
``{"error": {"message", "type", "param", "code"}}``. Error replies carry ``retry-after-ms``
(1 ms by default) so the client's retries stay fast; the ``openai`` client honours it before
``retry-after``.

Example::

    with ChatCompletionsAPI() as api:
        api.push(error_reply(429, "rate_limit_exceeded"), completion_reply("Comparison: ...\\nPreferred: A"))
        client = openai.OpenAI(api_key="k", base_url=api.url + "/v1")
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from tests.messages_api import MessagesAPI, Reply, Request

DEFAULT_MODEL = "judge-test-model"

_ids = itertools.count(1)


def completion_body(
    content: str | None,
    model: str = DEFAULT_MODEL,
    finish_reason: str = "stop",
    prompt_tokens: int = 211,
    completion_tokens: int = 29,
    refusal: str | None = None,
) -> dict:
    """A ``chat.completion`` object with one choice whose message holds ``content`` (``None``: null)."""
    return {
        "id": f"chatcmpl-test{next(_ids):012d}",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": refusal},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def completion_reply(content: str | None, **kwargs: Any) -> Reply:
    """A 200 reply whose completion holds ``content``; ``kwargs`` go to :func:`completion_body`."""
    return Reply(200, completion_body(content, **kwargs), {"x-request-id": f"req_test{next(_ids)}"})


def error_reply(
    status: int,
    error_type: str,
    message: str | None = None,
    retry_after_ms: int | None = 1,
    headers: dict[str, str] | None = None,
) -> Reply:
    """An API error (``rate_limit_exceeded`` with 429, ``server_error`` with 500, ...)."""
    hdrs = {"x-request-id": f"req_test{next(_ids)}"}
    if retry_after_ms is not None:
        hdrs["retry-after-ms"] = str(retry_after_ms)
    hdrs.update(headers or {})
    body = {"error": {"message": message or f"test {error_type}", "type": error_type, "param": None, "code": None}}
    return Reply(status, body, hdrs)


def models_body(models: list[str]) -> dict:
    """The ``GET /v1/models`` list of ``models``."""
    return {
        "object": "list",
        "data": [{"id": m, "object": "model", "created": 1_700_000_000, "owned_by": "test"} for m in models],
    }


def route_path(request: Request) -> str:
    """The request's path without its query; a request sent through the server as a plain-HTTP
    proxy (``HTTP_PROXY``) names its URL whole (``http://api.openai.com/v1/models``), and its path
    counts, so the server can stand in for any host."""
    return urlsplit(request.path).path


class ChatCompletionsAPI(MessagesAPI):
    """The server; use as a context manager or call :meth:`start` and :meth:`stop`.
    :attr:`url` is the host (``http://127.0.0.1:PORT``), :attr:`base_url` the API root a client
    is given (``.../v1``).

    Args:
        handler: decides the reply for a completion request when no scripted reply is queued.
            Without one, an unscripted request gets a 500 with ``x-should-retry: false``, so a
            test that sends more requests than it scripted fails loudly.
        api_key: when set, a request must carry ``authorization: Bearer KEY`` or it gets a 401
            ``invalid_api_key``.
        models: the model ids ``GET /v1/models`` lists.
        models_reply: answers ``GET /v1/models`` instead of the list, when set.
    """

    def __init__(
        self,
        handler: Callable[[Request], Reply] | None = None,
        api_key: str | None = None,
        models: list[str] | None = None,
        models_reply: Reply | None = None,
    ):
        super().__init__(handler, api_key)
        self.models = list(models) if models is not None else [DEFAULT_MODEL]
        self.models_reply = models_reply

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def completions(self) -> list[Request]:
        """The requests for completions (not for the model list)."""
        return [r for r in self.requests if route_path(r) == "/v1/chat/completions"]

    def _reply_for(self, request: Request) -> Reply:
        route = (request.method, route_path(request))
        if route not in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            return error_reply(404, "invalid_request_error", f"{request.method} {request.path}: not found", None)
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return error_reply(401, "invalid_api_key", "Incorrect API key provided", retry_after_ms=None)
        if route[0] == "GET":
            return self.models_reply or Reply(200, models_body(self.models))
        if request.json is None:
            return error_reply(400, "invalid_request_error", "body is not JSON", retry_after_ms=None)
        return self._scripted_or_handled(request)

    def _scripted_or_handled(self, request: Request) -> Reply:
        try:
            return self.replies.get_nowait()
        except queue.Empty:
            pass
        if self.handler is not None:
            try:
                return self.handler(request)
            except Exception as err:  # noqa: BLE001 -- a broken test handler: answer, and keep it for the test
                self.handler_errors.append(err)
                return error_reply(
                    500, "server_error", f"test handler failed: {err!r}", None, {"x-should-retry": "false"}
                )
        return error_reply(500, "server_error", "no scripted reply for this request", None, {"x-should-retry": "false"})
