"""Clients for the one upstream the sidecar talks to: the vLLM OpenAI server.

Two interchangeable implementations of one small interface (``open`` a request, get a response
with ``status_code`` / ``headers`` once the headers are in, then ``aiter_raw`` / ``aclose``):

``FastUpstream`` (default)
    HTTP/1.1 keep-alive connections on asyncio protocols with the ``httptools`` parser (the
    one uvicorn uses). One origin, no URL parsing, no header models, no anyio: about 0.1 ms of
    CPU per request on the 2-core test machine.
``HttpxUpstream`` (``--upstream-client httpx``)
    an ``httpx.AsyncClient``. Measured here at ~0.8 ms of CPU per request on the same machine
    (httpx + httpcore + h11 + anyio layers), i.e. on its own most of the sidecar's 1 ms budget,
    which is why it is not the default. It is kept as the reference implementation and for
    what the fast client does not do (HEAD).

Both map every transport failure before the response headers to :class:`UpstreamUnavailable`
(-> 503) and every failure while reading the body to :class:`UpstreamBroken`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

log = logging.getLogger("mars.sidecar.upstream")


class UpstreamUnavailable(Exception):
    """Could not get a response from the engine (down, restarting, crashed): 503.
    ``connect_failed``: no connection was made, so nothing of the request reached the
    engine (it may be sent to another)."""

    def __init__(self, message: str, connect_failed: bool = False) -> None:
        super().__init__(message)
        self.connect_failed = connect_failed


class UpstreamBroken(Exception):
    """The engine broke the connection while sending a response body."""


def content_type(headers: list[tuple[bytes, bytes]]) -> bytes:
    for k, v in headers:
        if k == b"content-type":
            return v
    return b""


class Upstream:
    """Shared bookkeeping: whether the engine answered recently (for metrics and state)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.up: bool | None = None
        self.failures = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None

    def down(self, exc: BaseException, connect_failed: bool = False) -> UpstreamUnavailable:
        self.up = False
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.last_error_at = time.time()
        return UpstreamUnavailable(f"upstream {self.base_url} unavailable ({self.last_error})",
                                   connect_failed)

    async def open(self, method: str, path: str, query: bytes,
                   headers: list[tuple[bytes, bytes]], body: bytes):
        raise NotImplementedError

    async def read(self, resp) -> bytes:
        """The whole raw body of a response; raises :class:`UpstreamUnavailable`."""
        try:
            chunks = [c async for c in resp.aiter_raw()]
        except UpstreamBroken as exc:
            raise self.down(exc) from None
        finally:
            await resp.aclose()
        return b"".join(chunks)

    async def get_text(self, path: str, timeout: float = 1.0) -> str | None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------- httpx
class _HttpxResponse:
    __slots__ = ("_r", "_it", "status_code", "headers")

    def __init__(self, r: httpx.Response) -> None:
        self._r = r
        self._it = None
        self.status_code = r.status_code
        self.headers = [(k.lower(), v) for k, v in r.headers.raw]

    @property
    def is_closed(self) -> bool:
        return self._r.is_closed

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            raise UpstreamBroken(f"{type(exc).__name__}: {exc}") from None

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, None at its end."""
        if self._it is None:
            self._it = self._r.aiter_raw()
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            return None
        except httpx.TransportError as exc:
            raise UpstreamBroken(f"{type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        await self._r.aclose()


class HttpxUpstream(Upstream):
    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0,
                 read_timeout_s: float | None = None, max_connections: int = 2048) -> None:
        super().__init__(base_url)
        timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s,
                                write=read_timeout_s, pool=None)
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections, keepalive_expiry=4.0)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False,
                                        follow_redirects=False)

    async def open(self, method, path, query, headers, body):
        url = self.base_url + path + ("?" + query.decode("latin-1") if query else "")
        req = self.client.build_request(method, url, headers=headers, content=body)
        try:
            r = await self.client.send(req, stream=True)
        except httpx.TransportError as exc:
            connect = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
            raise self.down(exc, connect_failed=connect) from None
        self.up = True
        return _HttpxResponse(r)

    async def get_text(self, path: str, timeout: float = 1.0) -> str | None:
        try:
            r = await self.client.get(self.base_url + path, timeout=timeout)
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    async def aclose(self) -> None:
        await self.client.aclose()


# ---------------------------------------------------------------------------- fast
#: body bytes buffered from the engine before reading pauses (a slow client then slows
#: the engine's socket, not the sidecar's memory)
_HIGH_WATER = 1 << 20


class _ConnectionFailed(Exception):
    pass


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; parser callbacks fill the current response."""

    def __init__(self, parser_cls) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser_cls = parser_cls
        self.lost = False
        self.idle_since = 0.0
        #: when the last response's final byte arrived: the server's keep-alive timer runs
        #: from about then, not from when the relay got round to releasing the connection
        self.completed_at = 0.0
        self.reset()

    def reset(self) -> None:
        self.parser = self._parser_cls(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.got_bytes = False
        self.waiter: asyncio.Future | None = None

    # --- asyncio protocol -------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # httptools.HttpParserError and friends
            self._fail(exc)
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        if not self.complete:
            self._fail(exc or ConnectionResetError("upstream closed the connection"))

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        # only meaningful inside this callback: llhttp resets it for the next message
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self.completed_at = time.monotonic()
        self._wake()

    # --- used by the client -----------------------------------------------------------------
    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take(self) -> bytes:
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _FastResponse:
    __slots__ = ("_pool", "_conn", "status_code", "headers", "is_closed")

    def __init__(self, pool: "FastUpstream", conn: _Conn) -> None:
        self._pool = pool
        self._conn = conn
        self.status_code = conn.status
        self.headers = conn.headers
        self.is_closed = False

    async def next_chunk(self) -> bytes | None:
        """Whatever arrived since the last call (waiting if nothing did); None at the end."""
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.take()
            if conn.complete:
                self._close()
                return None
            if conn.error is not None:
                self._close()
                raise UpstreamBroken(f"{type(conn.error).__name__}: {conn.error}")
            await conn.wait()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while (data := await self.next_chunk()) is not None:
            yield data

    def _close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.chunks and conn.error is None \
                and not conn.lost:
            self._pool._release(conn)
        else:
            # not read to the end (client gone) or not reusable: dropping the connection is
            # what tells vLLM to abort the generation
            conn.close()

    async def aclose(self) -> None:
        self._close()


class FastUpstream(Upstream):
    """Minimal HTTP/1.1 client for one origin, on asyncio protocols + httptools."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0,
                 read_timeout_s: float | None = None, max_idle: int = 512,
                 keepalive_expiry_s: float = 4.0) -> None:
        import httptools

        super().__init__(base_url)
        u = urlsplit(self.base_url)
        if u.scheme != "http" or u.path not in ("", "/"):
            raise ValueError("the fast upstream client needs a plain http://host:port URL")
        self._host = u.hostname or "127.0.0.1"
        self._port = u.port or 80
        self._host_header = (u.netloc or self._host).encode()
        self._parser_cls = httptools.HttpResponseParser
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._idle: list[_Conn] = []
        self._max_idle = max_idle
        # vLLM's uvicorn closes idle keep-alive connections after 5 s: expire ours first
        self._expiry = keepalive_expiry_s
        # HEAD (no body despite content-length) and anything unusual go through httpx
        self._fallback = HttpxUpstream(base_url, connect_timeout_s=connect_timeout_s,
                                       read_timeout_s=read_timeout_s, max_connections=64)

    def _get_idle(self) -> _Conn | None:
        now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self._expiry:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Conn) -> None:
        if len(self._idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = conn.completed_at or time.monotonic()
        self._idle.append(conn)

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: _Conn(self._parser_cls), self._host, self._port),
            self._connect_timeout)
        return conn

    def _head(self, method: str, path: str, query: bytes,
              headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        target = path.encode("latin-1") + (b"?" + query if query else b"")
        parts = [method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", self._host_header,
                 b"\r\n"]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        if body or method in ("POST", "PUT", "PATCH"):
            parts += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def open(self, method, path, query, headers, body):
        if method == "HEAD":
            return await self._fallback.open(method, path, query, headers, body)
        head = self._head(method, path, query, headers, body)
        for attempt in (0, 1):
            # a retry takes a new connection: the other idle ones are as old as the one the
            # server has just closed
            conn = self._get_idle() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                try:
                    conn = await self._connect()
                except (OSError, asyncio.TimeoutError) as exc:
                    raise self.down(exc, connect_failed=True) from None
            conn.reset()
            try:
                conn.transport.write(head + body if len(body) < 65536 else head)
                if len(body) >= 65536:
                    conn.transport.write(body)
                while not conn.headers_done:
                    if conn.error is not None:
                        raise _ConnectionFailed(conn.error)
                    if self._read_timeout is None:
                        await conn.wait()
                    else:
                        await asyncio.wait_for(conn.wait(), self._read_timeout)
            except _ConnectionFailed as exc:
                conn.close()
                # a kept-alive connection the server closed just as we reused it: nothing
                # was received, so the request was not processed and may be sent again
                if reused and not conn.got_bytes and attempt == 0:
                    continue
                raise self.down(exc.args[0] if exc.args else exc) from None
            except asyncio.TimeoutError as exc:
                conn.close()
                raise self.down(exc) from None
            except BaseException:  # cancelled (client gone): drop the request upstream
                conn.close()
                raise
            self.up = True
            return _FastResponse(self, conn)
        raise AssertionError("unreachable")

    async def get_text(self, path: str, timeout: float = 1.0) -> str | None:
        try:
            async with asyncio.timeout(timeout):
                resp = await self.open("GET", path, b"", [], b"")
                body = await self.read(resp)
        except (UpstreamUnavailable, TimeoutError):
            return None
        return body.decode(errors="replace") if resp.status_code == 200 else None

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        await self._fallback.aclose()


def make_upstream(kind: str, base_url: str, *, connect_timeout_s: float = 5.0,
                  read_timeout_s: float | None = None, max_connections: int = 2048) -> Upstream:
    if kind == "fast":
        try:
            return FastUpstream(base_url, connect_timeout_s=connect_timeout_s,
                                read_timeout_s=read_timeout_s)
        except ImportError:
            log.warning("httptools is not installed: using the httpx upstream client")
        except ValueError as exc:
            log.warning("%s: using the httpx upstream client", exc)
    elif kind != "httpx":
        raise ValueError(f"unknown upstream client {kind!r} (fast or httpx)")
    return HttpxUpstream(base_url, connect_timeout_s=connect_timeout_s,
                         read_timeout_s=read_timeout_s, max_connections=max_connections)
