"""Server-sent event streams read line by line, where the SSE spec ends a line.

httpx's ``iter_lines`` / ``aiter_lines`` split as Python's ``str.splitlines`` does: also at
U+0085, U+2028 and U+2029. JSON leaves those unescaped inside a string, and a generated
token can be one (the emulated model's random tokens were: a replay round failed with
``JSONDecodeError: Unterminated string`` when a ``data:`` line was cut in two at such a
character). The SSE spec ends a line at CRLF, LF or CR only; so do these readers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator


def split_lines(buf: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines in ``buf`` and what is left of it (a line still arriving; a
    trailing CR waits, it may be the first half of a CRLF)."""
    *lines, rest = buf.split(b"\n")
    out: list[bytes] = []
    for ln in lines:
        if ln.endswith(b"\r"):
            ln = ln[:-1]
        out.extend(ln.split(b"\r") if b"\r" in ln else (ln,))
    return out, rest


def _decode(line: bytes) -> str:
    return line.decode("utf-8", errors="replace")


def iter_sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Lines of a stream of byte chunks (``response.iter_bytes()``)."""
    rest = b""
    for chunk in chunks:
        lines, rest = split_lines(rest + chunk)
        for ln in lines:
            yield _decode(ln)
    if rest:
        yield _decode(rest.rstrip(b"\r"))


async def aiter_sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Lines of an async stream of byte chunks (``response.aiter_bytes()``)."""
    rest = b""
    async for chunk in chunks:
        lines, rest = split_lines(rest + chunk)
        for ln in lines:
            yield _decode(ln)
    if rest:
        yield _decode(rest.rstrip(b"\r"))
