"""Byte-level HTTP pass-through to the vLLM server (the clients are in :mod:`.upstream`).

Why byte level: the sidecar must not change what clients and the engine say to each other, and
parsing SSE or re-encoding JSON would cost time per token. Responses are relayed as the raw
body bytes read from the socket (no decompression, no SSE parsing); whatever arrived since
the last write is sent in one piece.

Failure model, so that every accepted request gets exactly one response:

* connecting fails, or the connection breaks before the response is complete: 503 with
  Retry-After (:class:`UpstreamUnavailable`), whatever the reason (engine down, restarting,
  crashed). Nothing is retried: a generation request is not idempotent.
* the connection breaks after a stream's headers were sent: the stream ends with an
  OpenAI-style ``error`` event and ``[DONE]`` (what vLLM sends when a stream fails).
* the client goes away: the upstream request is closed, which makes vLLM abort the
  generation, and the caller's cleanup runs exactly once (:class:`RelayResponse`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mars.sidecar.errors import sse_error_chunk
from mars.sidecar.upstream import Upstream, UpstreamBroken, content_type

log = logging.getLogger("mars.sidecar.proxy")

#: never forwarded in either direction (RFC 9110 hop-by-hop, plus what the server recomputes)
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"content-length", b"host",
    b"expect",
})
#: response headers uvicorn sets itself
_SERVER_SET = frozenset({b"server", b"date"})


def request_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """ASGI request headers (lower-case names by the spec) minus the hop-by-hop ones."""
    return [(k, v) for k, v in raw if k not in HOP_BY_HOP]


def response_headers(resp) -> list[tuple[bytes, bytes]]:
    """The upstream's headers as raw ASGI pairs (repeated headers kept, e.g. set-cookie)."""
    return [(k, v) for k, v in resp.headers if k not in HOP_BY_HOP and k not in _SERVER_SET]


def is_event_stream(resp) -> bool:
    return content_type(resp.headers).startswith(b"text/event-stream")


class DisconnectWatch:
    """Cancels the request's task as soon as its client disconnects.

    The ASGI server reports a disconnect as an ``http.disconnect`` message, which nothing
    reads while the handler awaits something else (admission, the engine's answer, the next
    chunk of a stream). The watch runs for the whole request, streams included, and the
    handler turns the cancellation into its cleanup (``disconnected`` tells it apart from a
    shutdown).
    """

    __slots__ = ("task", "disconnected", "_watcher")

    def __init__(self, receive: Receive) -> None:
        self.task = asyncio.current_task()
        self.disconnected = False
        self._watcher: asyncio.Task | None = asyncio.get_running_loop().create_task(
            self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                if self.task is not None:
                    self.task.cancel()
                return

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None


class RelayResponse(Response):
    """Relays an upstream response's body as it arrives; ``on_done(outcome)`` runs once.

    A plain ASGI loop (``await next_chunk()``, ``await send()``) rather than Starlette's
    ``StreamingResponse``: no async-generator layers and no per-stream task group on a path
    taken once per token and stream. The request's :class:`DisconnectWatch` keeps running
    and cancels the loop when the client goes away. ``outcome`` is "ok" when the upstream
    body ended normally, "error" when the upstream broke (an error event is sent), else
    "disconnect".
    """

    def __init__(self, upstream: Upstream, resp, on_done: Callable[[str], None],
                 watch: DisconnectWatch | None) -> None:
        self.status_code = resp.status_code
        self.raw_headers = response_headers(resp)
        self.background = None
        self._upstream = upstream
        self._resp = resp
        self._on_done: Callable[[str], None] | None = on_done
        self._watch = watch
        self.outcome = "disconnect"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = self._resp
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            try:
                while (data := await resp.next_chunk()) is not None:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                self.outcome = "ok"
            except UpstreamBroken as exc:
                self.outcome = "error"
                self._upstream.down(exc)
                await send({"type": "http.response.body", "more_body": True,
                            "body": sse_error_chunk(503, f"upstream connection lost "
                                                         f"mid-stream: {exc}")})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if self._watch is None or not self._watch.disconnected:
                raise
            asyncio.current_task().uncancel()  # the client left: nothing more to send
        except OSError:  # the transport is gone (ASGI servers may raise on send)
            pass
        finally:
            if self._watch is not None:
                self._watch.stop()
            self._cleanup()

    def _cleanup(self) -> None:
        if self._on_done is None:
            return
        on_done, self._on_done = self._on_done, None
        if not self._resp.is_closed:
            # Closing drops the connection (the body was not read to the end), which is what
            # makes vLLM abort the generation. A separate task, in case this one is being
            # cancelled (an await here would be interrupted).
            asyncio.get_running_loop().create_task(self._resp.aclose())
        try:
            on_done(self.outcome)
        except Exception:
            log.exception("stream completion callback failed")


class GuardedStreamingResponse(StreamingResponse):
    """A streaming response whose ``on_close`` runs exactly once, even if never iterated."""

    def __init__(self, content, on_close: Callable[[], None], **kw) -> None:
        super().__init__(content, **kw)
        self._on_close: Callable[[], None] | None = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_close is not None:
                fn, self._on_close = self._on_close, None
                fn()


def buffered(resp, content: bytes) -> Response:
    out = Response(content, status_code=resp.status_code)
    out.raw_headers = [*response_headers(resp), (b"content-length", str(len(content)).encode())]
    return out
