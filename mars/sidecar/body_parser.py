"""Large request bodies are parsed in a child process, never on the sidecar's event loop.

Why a process and not a thread: CPython's JSON decoder is C code that holds the GIL for the
whole document, so a worker thread gives the loop no turn while it decodes (measured by
``experiments/bench_body_parse.py``, table in docs/sidecar.md: a thread halves the stall at
best). On the loop a 50 MB prompt held it ~130-160 ms, 5 M token ids ~0.6-0.7 s: every other
client's stream, every event post and every admission waited that long. With a child the loop
only hands the bytes to a pipe and reads the small answer back, both non-blocking.

Small bodies -- all real traffic but huge prompts -- stay on the loop: below
``threshold_bytes`` a parse costs less than the hop to another process.

The child is ``python -m mars.sidecar.body_parser`` speaking length-prefixed pickles over its
stdin / stdout (not :mod:`multiprocessing`, whose ``spawn`` re-runs the parent's main module
in the child -- whatever program embeds the sidecar). It is started on first use, dies with
the sidecar (``PR_SET_PDEATHSIG``), ignores the process group's stop signals (the sidecar
decides when it ends), holds no descriptor of the sidecar's but its pipes, and parses one body
at a time under an address-space limit (a hostile body of 64 MB of ``[{},{},...]`` needs
~1.5 GB of Python objects: it gets 413, not the machine's OOM killer). A child that dies is
replaced, and the body it held parsed once more; a second death, or a parse that outlasts
``timeout_s``, is a 503.

Only the sidecar's own child ever writes to the pipe it unpickles from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

from mars.protocol.events import Event
from mars.sidecar.request import (SESSION_HEADERS, GenerateRequest, parse_event_batch,
                                  parse_generate)

log = logging.getLogger("mars.sidecar")

#: below this size a body is parsed on the loop (about a millisecond of JSON at most)
DEFAULT_THRESHOLD_BYTES = 256 << 10
#: Python objects per byte of the worst JSON a body can hold (``[{},{},...]``: a 64-byte dict
#: per 3 bytes) is ~22; real bodies need far less (token ids ~6, text ~2). The child may grow
#: by this many times the largest body, plus its interpreter.
MEMORY_PER_BODY_BYTE = 16

_LEN = struct.Struct("!Q")
#: how a request to the child names its job (never a callable from the wire)
_GENERATE, _EVENTS = "generate", "events"


class ParserUnavailable(RuntimeError):
    """The parsing child died twice on one body, or outlasted its deadline: 503."""


class BodyTooComplex(ValueError):
    """Parsing the body needs more memory than the child may use: 413."""


class _ChildDied(Exception):
    pass


# ---------------------------------------------------------------------- the child's side
def _read_frame(src: BinaryIO) -> bytes | None:
    head = src.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    n, = _LEN.unpack(head)
    data = src.read(n)
    return data if len(data) == n else None


def _answer(ok: bool, result: Any, rewritten: bool) -> bytes:
    try:
        return pickle.dumps((ok, result, rewritten), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - an exception that cannot be pickled
        return pickle.dumps((False, RuntimeError(f"body parser: {result!r}: {exc}"), False))


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
        new_body = None
        try:
            job, args = pickle.loads(head)
            if job == _GENERATE:
                req = parse_generate(body, *args)
                if req.body is not body:
                    new_body = req.body
                out: tuple[bool, Any] = (True, replace(req, body=b""))
            elif job == _EVENTS:
                out = (True, parse_event_batch(body, *args))
            else:
                out = (False, RuntimeError(f"unknown job {job!r}"))
        except MemoryError:
            new_body = None
            out = (False, BodyTooComplex(
                "the body's JSON needs more memory to parse than the sidecar allows"))
        except Exception as exc:  # noqa: BLE001 - the sidecar re-raises it
            out = (False, exc)
        data = _answer(*out, new_body is not None)
        dst.write(_LEN.pack(len(data)) + data)
        if new_body is not None:
            dst.write(_LEN.pack(len(new_body)))
            dst.write(new_body)
        dst.flush()
        del body, new_body, out


def _limit_memory(extra_bytes: int) -> None:
    """Cap this process's address space at what it maps now plus ``extra_bytes``."""
    import resource

    try:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = vm + extra_bytes
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except (OSError, ValueError, StopIteration):
        pass  # not Linux: no cap


def main(argv: list[str] | None = None) -> None:
    import signal

    from mars.launch import die_with_parent

    argv = sys.argv[1:] if argv is None else argv
    parent, memory = int(argv[0]), int(argv[1])
    # the sidecar decides when this ends: a group's Ctrl-C or SIGTERM mid-drain must not cut
    # a parse short; it goes with the sidecar (death signal) or at the end of its input
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(expected_parent=parent)
    # the event loop's subprocess support may not close what the sidecar has open (its
    # listening socket among them): hold nothing but the pipes
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    # the protocol gets stdout to itself: anything printed goes to stderr (the sidecar's log)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _limit_memory(memory)
    serve(sys.stdin.buffer, answers)


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
    async def start(cls, memory_bytes: int) -> "_Child":
        root = str(Path(__file__).resolve().parents[2])  # the checkout or site-packages
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mars.sidecar.body_parser", str(os.getpid()),
            str(memory_bytes), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env)
        return cls(proc)

    @property
    def alive(self) -> bool:
        return not self.dead and self.proc.returncode is None

    async def call(self, job: str, args: tuple, body: bytes,
                   timeout_s: float) -> tuple[Any, bytes | None]:
        """``(result, rewritten body or None)``; the job's own exception is raised as is.
        Raises :class:`_ChildDied` if the child is or goes away, :class:`ParserUnavailable`
        when the deadline passes (the child is killed: the body may be why)."""
        async with self.lock:
            if not self.alive:  # died while this call waited its turn
                raise _ChildDied()
            try:
                ok, result, new_body = await asyncio.wait_for(
                    self._exchange(job, args, body), timeout_s)
            except asyncio.TimeoutError:
                self.kill()
                raise ParserUnavailable(f"the sidecar's body parser took more than "
                                        f"{timeout_s:g} s on this request") from None
            except asyncio.CancelledError:
                self.kill()  # cancelled half-way: the pipe's framing is lost
                raise
            except Exception:
                # a broken pipe, a closed handle (uvloop), a short read: a child that went
                self.kill()
                raise _ChildDied() from None
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
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


class BodyParser:
    """Parses generation and event bodies, large ones in a child process.

    ``max_body_bytes`` sizes the child's memory cap; ``on_restart`` is told each time a
    child had to be replaced (a metric)."""

    def __init__(self, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                 max_body_bytes: int = 64 << 20, timeout_s: float = 60.0,
                 on_restart: Callable[[], None] | None = None) -> None:
        self.threshold_bytes = threshold_bytes
        self.memory_bytes = MEMORY_PER_BODY_BYTE * max_body_bytes + (256 << 20)
        self.timeout_s = timeout_s
        self._on_restart = on_restart
        self._child: _Child | None = None
        self._starting: asyncio.Lock | None = None
        self._closed = False

    async def generate(self, body: bytes, headers: Mapping[str, str],
                       bytes_per_token: float) -> GenerateRequest:
        """:func:`~mars.sidecar.request.parse_generate`; raises ``BadRequest``,
        :class:`BodyTooComplex`, :class:`ParserUnavailable`."""
        if len(body) < self.threshold_bytes:
            return parse_generate(body, headers, bytes_per_token)
        hdrs = {h: headers[h] for h in SESSION_HEADERS if headers.get(h)}
        req, new_body = await self._in_child(_GENERATE, (hdrs, bytes_per_token), body)
        return replace(req, body=body if new_body is None else new_body)

    async def events(self, body: bytes, now: float | None = None) -> list[Event]:
        """:func:`~mars.sidecar.request.parse_event_batch`; raises ``EventError``,
        :class:`BodyTooComplex`, :class:`ParserUnavailable`."""
        if len(body) < self.threshold_bytes:
            return parse_event_batch(body, now)
        events, _ = await self._in_child(_EVENTS, (now,), body)
        return events

    async def _in_child(self, job: str, args: tuple, body: bytes) -> tuple[Any, bytes | None]:
        for attempt in (1, 2):
            if self._closed:
                raise ParserUnavailable("the sidecar is shutting down")
            try:
                child = await self._current()
            except OSError as exc:  # out of processes or file descriptors
                raise ParserUnavailable(f"cannot start the sidecar's body parser: {exc}") \
                    from None
            try:
                return await child.call(job, args, body, self.timeout_s)
            except _ChildDied:
                log.warning("the body parser process died (attempt %d); starting a new one",
                            attempt)
        raise ParserUnavailable("the sidecar's body parser process died twice on this "
                                "request; retry later")

    async def _current(self) -> _Child:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._child is None or not self._child.alive:
                if self._child is not None and self._on_restart is not None:
                    self._on_restart()
                self._child = await _Child.start(self.memory_bytes)
            return self._child

    @property
    def pid(self) -> int | None:
        """The running child's pid (None before the first large body)."""
        return self._child.proc.pid if self._child is not None and self._child.alive else None

    async def aclose(self) -> None:
        """Ends the child (a kill: it holds nothing worth finishing) and reaps it."""
        self._closed = True
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.proc.wait(), 5)


if __name__ == "__main__":
    # run the module's own copy, not this ``__main__`` one: what the child pickles (its
    # exceptions) must name classes the sidecar can import
    from mars.sidecar.body_parser import main as _main

    _main()
