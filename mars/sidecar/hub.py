"""The unified information stream at the sidecar: one ordered merge of engine, tool and
control events, fed to the control plane and fanned out to SSE subscribers and a JSONL file.

Everything here runs on the event loop thread (the engine reader is driven by the loop too),
so the merge order is simply the order of :meth:`EventHub.publish` calls and no lock is
needed. Publishing never waits: each subscriber has a bounded buffer
(oldest dropped and counted when a consumer is slow) and file lines are batched and written by
the flush timer. An event is serialised at most once, and only if someone reads it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from mars.sidecar.metrics import SidecarMetrics

log = logging.getLogger("mars.sidecar.hub")


class Subscriber:
    """One SSE client: a filter and a bounded buffer of serialised events."""

    __slots__ = ("kinds", "session", "_buf", "_max", "_wake", "dropped")

    def __init__(self, kinds: Iterable[str] | None, session: str | None, max_buffer: int) -> None:
        self.kinds = frozenset(kinds) if kinds else None
        self.session = session
        self._buf: collections.deque[bytes] = collections.deque()
        self._max = max_buffer
        self._wake = asyncio.Event()
        self.dropped = 0

    def wants(self, ev: dict[str, Any]) -> bool:
        return ((self.kinds is None or ev.get("kind") in self.kinds)
                and (self.session is None or ev.get("session_id") == self.session))

    def offer(self, line: bytes) -> bool:
        """Queue one line; False if the oldest had to be dropped to make room."""
        ok = True
        if len(self._buf) >= self._max:
            self._buf.popleft()
            self.dropped += 1
            ok = False
        self._buf.append(line)
        self._wake.set()
        return ok

    async def get(self, timeout: float) -> bytes | None:
        """The next line, or None after ``timeout`` seconds without one."""
        if not self._buf:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return None
        return self._buf.popleft() if self._buf else None


class EventHub:
    """Merge point of the three planes' events."""

    def __init__(self, metrics: SidecarMetrics, events_file: str | None = None,
                 sse_buffer: int = 10000) -> None:
        self.metrics = metrics
        self._observers: list[Callable[[dict[str, Any]], None]] = []
        self._subs: set[Subscriber] = set()
        self._sse_buffer = sse_buffer
        self._file = open(events_file, "ab") if events_file else None
        self._pending: list[bytes] = []
        self.published = 0
        self.observer_errors = 0

    # --- producers ------------------------------------------------------------------------
    def add_observer(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self._observers.append(fn)

    def publish(self, ev: dict[str, Any], source: str) -> None:
        """Merge one event: observers first (the control state), then the readers."""
        self.published += 1
        self.metrics.event(source, ev.get("kind", "?"))
        for fn in self._observers:
            try:
                fn(ev)
            except Exception:  # an observer bug must not stop the stream
                self.observer_errors += 1
                self.metrics.observer_errors.inc()
                log.exception("event observer failed on %r", ev.get("kind"))
        if self._file is None and not self._subs:
            return
        line = json.dumps(ev, separators=(",", ":")).encode()
        if self._file is not None:
            self._pending.append(line)
        for sub in self._subs:
            if sub.wants(ev) and not sub.offer(line):
                self.metrics.sse_dropped.inc()

    def publish_many(self, events: Iterable[dict[str, Any]], source: str) -> None:
        for ev in events:
            self.publish(ev, source)

    # --- readers --------------------------------------------------------------------------
    def subscribe(self, kinds: Iterable[str] | None = None,
                  session: str | None = None) -> Subscriber:
        sub = Subscriber(kinds, session, self._sse_buffer)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subs.discard(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def flush(self) -> None:
        if self._file is None or not self._pending:
            return
        lines, self._pending = self._pending, []
        try:
            self._file.write(b"\n".join(lines) + b"\n")
            self._file.flush()
        except OSError:
            log.exception("cannot append to the events file")

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
