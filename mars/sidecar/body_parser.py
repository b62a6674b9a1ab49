"""Large request bodies are parsed in a child process, never on the sidecar's event loop.

Why a process and not a thread: CPython's JSON decoder is C code that holds the GIL for the
whole document, so a worker thread gives the loop no turn until the parse ends. Measured on
this project's 2-core machine (``experiments/bench_body_parse.py``, docs/sidecar.md): a 50 MB
text prompt held the loop ~210 ms parsed on it and ~180 ms parsed in a thread; 5 M token ids
(44 MB) held it over a second either way. Every other client's stream, every event post and
every admission waited that long. With a child the loop only hands the bytes to a pipe and
reads the small answer back, both non-blocking.

Small bodies -- all real traffic but huge prompts -- stay on the loop: below
``threshold_bytes`` a parse costs less than the hop to another process.

The child is ``python -m mars.sidecar.body_parser`` speaking length-prefixed pickles over its
stdin / stdout (not :mod:`multiprocessing`, whose ``spawn`` re-runs the parent's main module
in the child -- whatever program embeds the sidecar). It is started on first use, dies with
the sidecar (``PR_SET_PDEATHSIG``), serves one body at a time, and is replaced when it dies; a
body whose parse was lost that way is parsed once more on a fresh child, then answered with
:class:`ParserUnavailable` (503) if that one dies too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from mars.policy.events import Event
from mars.sidecar.request import (SESSION_HEADERS, GenerateRequest, parse_event_batch,
                                  parse_generate)

log = logging.getLogger("mars.sidecar")

#: below this size a body is parsed on the loop (about a millisecond of JSON at most)
DEFAULT_THRESHOLD_BYTES = 256 << 10

_LEN = struct.Struct("!Q")
#: how a request to the child names its job (never a callable from the wire)
_GENERATE, _EVENTS = "generate", "events"


class ParserUnavailable(RuntimeError):
    """The parsing child died twice on one body: answered 503 (retry later)."""


class _ChildDied(Exception):
    pass


# ---------------------------------------------------------------------- the child's side
def _generate_detached(body: bytes, headers: dict[str, str],
                       bytes_per_token: float) -> GenerateRequest:
    """:func:`parse_generate` without the parsed object (only the prompt estimate the sidecar
    needs from it) and without the body when it is unchanged (the sidecar holds it)."""
    req = parse_generate(body, headers)
    return req.detached(bytes_per_token, keep_body=req.body is not body)


def _read_frame(src: BinaryIO) -> bytes | None:
    head = src.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    n, = _LEN.unpack(head)
    data = src.read(n)
    return data if len(data) == n else None


def serve(src: BinaryIO, dst: BinaryIO) -> None:
    """The child's loop. In: a frame ``(job, args)`` and a frame with the body. Out: a frame
    ``(ok, result or exception, rewritten)`` and, if ``rewritten``, a frame with the new
    body (raw bytes: a pickle around it would cost the sidecar one more copy). Ends at end
    of input (the sidecar closed the pipe or died)."""
    while True:
        head = _read_frame(src)
        body = _read_frame(src) if head is not None else None
        if body is None:
            return
        job, args = pickle.loads(head)
        new_body = None
        try:
            if job == _GENERATE:
                req = _generate_detached(body, *args)
                new_body, req.body = req.body, None
                out: tuple[bool, Any] = (True, req)
            elif job == _EVENTS:
                out = (True, parse_event_batch(body, *args))
            else:
                out = (False, RuntimeError(f"unknown job {job!r}"))
        except Exception as exc:  # noqa: BLE001 - the sidecar re-raises it
            out = (False, exc)
        data = pickle.dumps((*out, new_body is not None), protocol=pickle.HIGHEST_PROTOCOL)
        dst.write(_LEN.pack(len(data)) + data)
        if new_body is not None:
            dst.write(_LEN.pack(len(new_body)))
            dst.write(new_body)
        dst.flush()


# ---------------------------------------------------------------------- the sidecar's side
class _Child:
    """One running parser process and its pipes; one request at a time."""

    #: bytes handed to the pipe per write: each write copies what the pipe does not take at
    #: once, so a whole 50 MB body in one write would be one 50 MB copy on the loop
    WRITE_CHUNK = 1 << 20

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lock = asyncio.Lock()
        self.dead = False

    @classmethod
    async def start(cls) -> "_Child":
        root = str(Path(__file__).resolve().parents[2])  # the checkout or site-packages
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mars.sidecar.body_parser", str(os.getpid()),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        return cls(proc)

    @property
    def alive(self) -> bool:
        return not self.dead and self.proc.returncode is None

    async def call(self, job: str, args: tuple, body: bytes) -> tuple[Any, bytes | None]:
        """``(result, rewritten body or None)``; the job's own exception is raised as is."""
        async with self.lock:
            try:
                ok, result, new_body = await self._exchange(job, args, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.kill()
                raise _ChildDied() from None
            except BaseException:
                # cancelled half-way: the pipe's framing is lost, and so is this child
                self.kill()
                raise
        if not ok:
            raise result
        return result, new_body

    async def _exchange(self, job: str, args: tuple,
                        body: bytes) -> tuple[bool, Any, bytes | None]:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        head = pickle.dumps((job, args), protocol=pickle.HIGHEST_PROTOCOL)
        stdin.write(_LEN.pack(len(head)) + head + _LEN.pack(len(body)))
        view = memoryview(body)
        for off in range(0, len(body), self.WRITE_CHUNK):
            stdin.write(view[off:off + self.WRITE_CHUNK])
            await stdin.drain()
        await stdin.drain()
        n, = _LEN.unpack(await stdout.readexactly(_LEN.size))
        ok, result, rewritten = pickle.loads(await stdout.readexactly(n))
        new_body = None
        if rewritten:
            n, = _LEN.unpack(await stdout.readexactly(_LEN.size))
            parts, left = [], n
            while left:  # small reads: readexactly(n) would copy n bytes twice in one go
                part = await stdout.read(min(left, self.WRITE_CHUNK))
                if not part:
                    raise asyncio.IncompleteReadError(b"", left)
                parts.append(part)
                left -= len(part)
            new_body = b"".join(parts)
        return ok, result, new_body

    def kill(self) -> None:
        self.dead = True
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass


class BodyParser:
    """Parses generation and event bodies, large ones in a child process."""

    def __init__(self, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> None:
        self.threshold_bytes = threshold_bytes
        self._child: _Child | None = None
        self._starting: asyncio.Lock | None = None
        #: children replaced after dying
        self.restarts = 0

    async def generate(self, body: bytes, headers: Mapping[str, str],
                       bytes_per_token: float) -> GenerateRequest:
        """:func:`~mars.sidecar.request.parse_generate`; raises ``BadRequest``."""
        if len(body) < self.threshold_bytes:
            return parse_generate(body, headers)
        hdrs = {h: headers[h] for h in SESSION_HEADERS if headers.get(h)}
        req, new_body = await self._in_child(_GENERATE, (hdrs, bytes_per_token), body)
        return req.with_body(body if new_body is None else new_body)

    async def events(self, body: bytes, now: float | None = None) -> list[Event]:
        """:func:`~mars.sidecar.request.parse_event_batch`; raises ``EventError``."""
        if len(body) < self.threshold_bytes:
            return parse_event_batch(body, now)
        events, _ = await self._in_child(_EVENTS, (now,), body)
        return events

    async def _in_child(self, job: str, args: tuple, body: bytes) -> tuple[Any, bytes | None]:
        for attempt in (1, 2):
            try:
                child = await self._current()
            except OSError as exc:  # out of processes or file descriptors
                raise ParserUnavailable(f"cannot start the sidecar's body parser: {exc}") \
                    from None
            try:
                return await child.call(job, args, body)
            except _ChildDied:
                self.restarts += 1
                log.warning("the body parser process died (attempt %d); starting a new one",
                            attempt)
        raise ParserUnavailable("the sidecar's body parser process died twice on this "
                                "request; retry later")

    async def _current(self) -> _Child:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._child is None or not self._child.alive:
                self._child = await _Child.start()
            return self._child

    @property
    def pid(self) -> int | None:
        """The running child's pid (None before the first large body)."""
        return self._child.proc.pid if self._child is not None and self._child.alive else None

    async def aclose(self) -> None:
        """Ends the child (a kill: it holds nothing worth finishing) and reaps it."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.proc.wait(), 5)


def main() -> None:
    import signal

    from mars.launch import die_with_parent

    # Ctrl-C reaches the sidecar's whole group: the sidecar decides, this child goes with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(expected_parent=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    # the protocol gets stdout to itself: anything printed goes to stderr (the sidecar's log)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
