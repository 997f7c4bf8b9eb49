"""A scriptable Anthropic Messages API server on 127.0.0.1 for tests.

:class:`MessagesAPI` serves ``POST /v1/messages`` from a ``ThreadingHTTPServer`` running in
a background thread. Replies come from a queue of scripted :class:`Reply` objects, or,
when the queue is empty, from a callable that sees the request; every request is recorded
(method, path, headers, JSON body, arrival time) so tests can check what the client sent.

Bodies follow the real API: a success is a ``message`` object, an error is
``{"type": "error", "error": {"type": ..., "message": ...}}``. Error replies carry
``retry-after-ms`` (1 ms by default) so the SDK's retries stay fast; the SDK honours it
before ``retry-after``.

Example::

    with MessagesAPI() as api:
        api.push(error_reply(429, "rate_limit_error"), text_reply("Comparison: ...\\nPreferred: A"))
        client = anthropic.Anthropic(api_key="k", base_url=api.url)
"""

from __future__ import annotations

import itertools
import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

DEFAULT_MODEL = "claude-test-judge"


@dataclass
class Reply:
    """One HTTP reply: status, body (a dict is sent as JSON; str/bytes as given) and headers."""

    status: int = 200
    body: dict | str | bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"
    delay: float = 0.0  # seconds to wait before answering


@dataclass
class Request:
    """One request the server received. ``headers`` have lower-case names; ``json`` is
    the parsed body (``None`` when it is not JSON)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any
    received_at: float

    @property
    def prompt(self) -> str:
        """The text of the first user message (the judge prompt)."""
        content = self.json["messages"][0]["content"]
        if isinstance(content, str):
            return content
        return "".join(block.get("text", "") for block in content)


_ids = itertools.count(1)


def message_body(
    text: str,
    model: str = DEFAULT_MODEL,
    stop_reason: str = "end_turn",
    input_tokens: int = 231,
    output_tokens: int = 38,
) -> dict:
    """A Messages API ``message`` object with one text block."""
    return {
        "id": f"msg_01Test{next(_ids):016d}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


def text_reply(text: str, **kwargs: Any) -> Reply:
    """A 200 reply whose message holds ``text``; ``kwargs`` go to :func:`message_body`."""
    return Reply(200, message_body(text, **kwargs), {"request-id": f"req_test{next(_ids)}"})


def error_reply(
    status: int,
    error_type: str,
    message: str | None = None,
    retry_after_ms: int | None = 1,
    headers: dict[str, str] | None = None,
) -> Reply:
    """An API error (``rate_limit_error`` with 429, ``api_error`` with 500, ...)."""
    hdrs = {"request-id": f"req_test{next(_ids)}"}
    if retry_after_ms is not None:
        hdrs["retry-after-ms"] = str(retry_after_ms)
    hdrs.update(headers or {})
    body = {"type": "error", "error": {"type": error_type, "message": message or f"test {error_type}"}}
    return Reply(status, body, hdrs)


class MessagesAPI:
    """The server; use as a context manager or call :meth:`start` and :meth:`stop`.

    Args:
        handler: decides the reply for a request when no scripted reply is queued. Without
            one, an unscripted request gets a 500 with ``x-should-retry: false``, so a test
            that sends more requests than it scripted fails loudly.
        api_key: when set, a request must carry it (``x-api-key: KEY`` or
            ``authorization: Bearer KEY``) or it gets a 401 ``authentication_error``.
    """

    def __init__(self, handler: Callable[[Request], Reply] | None = None, api_key: str | None = None):
        self.handler = handler
        self.api_key = api_key
        self.replies: queue.Queue[Reply] = queue.Queue()
        self.requests: list[Request] = []
        self.handler_errors: list[Exception] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self.max_in_flight = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control

    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def push(self, *replies: Reply) -> None:
        """Queue replies; each request takes the oldest one."""
        for reply in replies:
            self.replies.put(reply)

    def reset(self) -> None:
        """Forget recorded requests and queued replies."""
        with self._lock:
            self.requests.clear()
            self.max_in_flight = 0
        while not self.replies.empty():
            self.replies.get_nowait()

    def start(self) -> Self:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:
                api._serve(self)

            def do_GET(self) -> None:
                api._serve(self)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):  # a client hung up
                    super().handle_error(request, client_address)

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="messages-api", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)  # type: ignore[union-attr]
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ serving

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("content-length") or 0)
        body = h.rfile.read(length) if length else b""
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        request = Request(
            h.command, h.path, {k.lower(): v for k, v in h.headers.items()}, body, parsed, time.monotonic()
        )
        with self._lock:
            self.requests.append(request)
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            reply = self._reply_for(request)
            if reply.delay:
                time.sleep(reply.delay)
        finally:
            with self._lock:
                self._in_flight -= 1
        if isinstance(reply.body, dict):
            data = json.dumps(reply.body).encode()
        elif isinstance(reply.body, str):
            data = reply.body.encode()
        else:
            data = reply.body
        try:
            h.send_response(reply.status)
            h.send_header("content-type", reply.content_type)
            h.send_header("content-length", str(len(data)))
            for name, value in reply.headers.items():
                h.send_header(name, value)
            h.end_headers()
            h.wfile.write(data)
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
            h.close_connection = True

    def _reply_for(self, request: Request) -> Reply:
        if request.method != "POST" or request.path.split("?")[0] != "/v1/messages":
            return error_reply(
                404, "not_found_error", f"{request.method} {request.path}: not found", retry_after_ms=None
            )
        if self.api_key is not None and self.api_key not in (
            request.headers.get("x-api-key"),
            request.headers.get("authorization", "").removeprefix("Bearer "),
        ):
            return error_reply(401, "authentication_error", "invalid x-api-key", retry_after_ms=None)
        if request.json is None:
            return error_reply(400, "invalid_request_error", "body is not JSON", retry_after_ms=None)
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
                    500,
                    "api_error",
                    f"test handler failed: {err!r}",
                    retry_after_ms=None,
                    headers={"x-should-retry": "false"},
                )
        return error_reply(
            500,
            "api_error",
            "no scripted reply for this request",
            retry_after_ms=None,
            headers={"x-should-retry": "false"},
        )
