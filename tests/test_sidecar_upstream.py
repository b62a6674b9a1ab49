"""The sidecar's fast upstream client against a real socket server that closes kept-alive
connections as vLLM's uvicorn does (after an idle timeout), at the worst moments."""

from __future__ import annotations

import asyncio

from mars.sidecar.upstream import FastUpstream

OK = (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n"
      b"connection: keep-alive\r\n\r\nok")


class OneShotServer:
    """Answers the first request of each connection and keeps it open; a later request on a
    connection that already served one is met by closing it unanswered: what the client sees
    when the server's keep-alive timer fired just as it reused the connection."""

    def __init__(self) -> None:
        self.connections = 0
        self.refused = 0
        self.server: asyncio.base_events.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                if served:
                    self.refused += 1
                    break
                writer.write(OK)
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()


async def _get(up: FastUpstream) -> bytes:
    resp = await up.open("POST", "/v1/completions", b"", [], b"{}")
    assert resp.status_code == 200
    return await up.read(resp)


def test_a_retry_after_a_closed_keepalive_takes_a_new_connection():
    """Two idle connections, both closed by the server as they are reused: the request is
    sent again on a new connection, not on the other stale one (which would fail it)."""

    async def main() -> None:
        srv = OneShotServer()
        async with srv as url:
            up = FastUpstream(url, keepalive_expiry_s=60.0)
            try:
                assert await asyncio.gather(_get(up), _get(up)) == [b"ok", b"ok"]
                assert srv.connections == 2 and len(up._idle) == 2
                assert await _get(up) == b"ok"
                # the reused one was refused, the retry went to a third, new connection
                assert srv.refused == 1 and srv.connections == 3
                assert up.failures == 0
            finally:
                await up.aclose()

    asyncio.run(main())


def test_idle_time_counts_from_the_responses_end_not_its_release():
    """A response read late (a slow client downstream) does not make its connection look
    freshly idle: the server's keep-alive timer started when the response ended."""

    async def main() -> None:
        srv = OneShotServer()
        async with srv as url:
            up = FastUpstream(url, keepalive_expiry_s=0.3)
            try:
                resp = await up.open("POST", "/v1/completions", b"", [], b"{}")
                await asyncio.sleep(0.6)  # the whole body is in; nobody reads it yet
                assert await up.read(resp) == b"ok"
                assert await _get(up) == b"ok"
                assert srv.refused == 0 and srv.connections == 2
            finally:
                await up.aclose()

    asyncio.run(main())
