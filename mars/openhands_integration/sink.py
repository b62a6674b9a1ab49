"""Non-blocking batched event sink: tool events go to the sidecar's ``POST /v1/mars/events``.

The agent thread only ever appends to a bounded in-memory buffer (``emit`` takes a lock for a
deque append and returns); a daemon thread drains the buffer, appends the events to an
optional local JSONL file and POSTs them to the sidecar as a JSON list. When the sidecar is
slow, down or absent, nothing the agent does waits on it: a failed batch is kept for a retry
(with capped back-off) in a second bounded queue, and whatever does not fit in either queue is
dropped and counted in :attr:`EventSink.dropped`.

No OpenHands and no vLLM here: only the standard library and httpx.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger(__name__)

EVENTS_PATH = "/v1/mars/events"
#: events that end a session (not a tool runner's to post with its own key)
SESSION_KINDS = frozenset({"session_end"})


@dataclass
class SinkStats:
    emitted: int = 0
    sent: int = 0
    dropped: int = 0
    written: int = 0
    posts_ok: int = 0
    posts_failed: int = 0
    last_error: str | None = None
    #: longest time one ``emit`` call took (seconds): the agent-facing cost of the sink
    max_emit_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra


def events_url(base_url: str | None) -> str | None:
    """``http://host:port`` or ``http://host:port/v1`` -> ``.../v1/mars/events``."""
    if not base_url:
        return None
    url = base_url.rstrip("/")
    if url.endswith(EVENTS_PATH):
        return url
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url + EVENTS_PATH


class EventSink:
    """Bounded, batched, background event shipper.

    Parameters
    ----------
    url:
        the sidecar base URL (``http://127.0.0.1:8000``) or the full events URL; ``None``
        keeps events local (file only).
    path:
        optional JSONL file every event is appended to (written by the background thread).
    max_buffer:
        events the producer side may hold before ``emit`` starts dropping (new events are
        dropped, never the caller blocked).
    max_retry:
        events kept for re-sending while the sidecar is unreachable (oldest dropped first).
    """

    def __init__(
        self,
        url: str | None,
        *,
        path: str | os.PathLike | None = None,
        batch_size: int = 64,
        flush_interval_s: float = 0.01,
        max_buffer: int = 4096,
        max_retry: int = 4096,
        timeout_s: float = 1.0,
        max_backoff_s: float = 2.0,
        headers: dict[str, str] | None = None,
        session_headers: dict[str, str] | None = None,
    ) -> None:
        self.url = events_url(url)
        self.path = os.fspath(path) if path is not None else None
        self.batch_size = max(1, int(batch_size))
        self.flush_interval_s = flush_interval_s
        self.max_buffer = max(1, int(max_buffer))
        self.max_retry = max(0, int(max_retry))
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.headers = {"content-type": "application/json", **(headers or {})}
        #: for ``session_end``, which a tool-runner key may not post (docs/sidecar.md, "Trust
        #: model"): sent in posts of its own with these (default: ``headers``)
        self.session_headers = self.headers if session_headers is None else {
            "content-type": "application/json", **session_headers}
        self.stats = SinkStats()
        self._buf: collections.deque[dict] = collections.deque()
        self._retry: collections.deque[dict] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._busy = False
        self._inflight = 0
        self._abandoned = False
        self._backoff_until = 0.0
        self._backoff = 0.0
        self._file = None
        self._thread = threading.Thread(target=self._loop, name="mars-event-sink", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    @property
    def dropped(self) -> int:
        return self.stats.dropped

    def emit(self, event: dict[str, Any]) -> bool:
        """Queue one event; never blocks on I/O. Returns False when it had to be dropped."""
        t0 = time.perf_counter()
        with self._cv:
            self.stats.emitted += 1
            if self._closing or len(self._buf) >= self.max_buffer:
                self.stats.dropped += 1
                ok = False
            else:
                self._buf.append(event)
                ok = True
                self._cv.notify_all()
        dt = time.perf_counter() - t0
        if dt > self.stats.max_emit_s:
            self.stats.max_emit_s = dt
        return ok

    def pending(self) -> int:
        with self._cv:
            return len(self._buf) + len(self._retry) + (1 if self._busy else 0)

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait (bounded) until everything queued was handed on; True if nothing is left."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while (self._buf or self._busy or self._retry) and self._thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if self._retry and not self._busy:
                    self._backoff_until = 0.0  # retry now rather than after the back-off
                self._cv.notify_all()
                self._cv.wait(timeout=min(0.05, remaining))
            return not (self._buf or self._retry or self._busy)

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush (bounded), stop the thread; undelivered events count as dropped."""
        self.flush(timeout_s)
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout=max(0.1, timeout_s))
        with self._cv:
            lost = len(self._buf) + len(self._retry)
            if self._thread.is_alive():
                # stuck in a POST to a hanging sidecar: whatever it holds is given up
                lost += self._inflight
                self._abandoned = True
            self.stats.dropped += lost
            self._buf.clear()
            self._retry.clear()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def __enter__(self) -> "EventSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ consumer side
    def _loop(self) -> None:
        client = httpx.Client(timeout=httpx.Timeout(self.timeout_s, connect=min(0.5, self.timeout_s))) if self.url else None
        try:
            while True:
                with self._cv:
                    while not self._closing and not self._buf and not (
                        self._retry and time.monotonic() >= self._backoff_until
                    ):
                        wait = self.flush_interval_s * 20
                        if self._retry:
                            wait = max(0.01, self._backoff_until - time.monotonic())
                        self._cv.wait(timeout=wait)
                    if self._closing and not self._buf and not self._retry:
                        return
                    if self._closing and not self._buf and time.monotonic() < self._backoff_until:
                        return
                    # let a batch fill up a little (the agent is never waiting on this)
                    deadline = time.monotonic() + self.flush_interval_s
                    while self._buf and len(self._buf) < self.batch_size and not self._closing:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cv.wait(timeout=remaining)
                    fresh = [self._buf.popleft() for _ in range(min(self.batch_size, len(self._buf)))]
                    self._busy = True
                try:
                    if fresh:
                        self._write(fresh)
                    if client is None:
                        continue
                    batch: list[dict] = []
                    with self._cv:
                        while self._retry and len(batch) < self.batch_size:
                            batch.append(self._retry.popleft())
                    batch.extend(fresh)
                    if not batch:
                        continue
                    if time.monotonic() < self._backoff_until and not self._closing:
                        self._requeue(batch)
                        continue
                    self._post(client, batch)
                finally:
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()
        except Exception:  # pragma: no cover - the sink must never take the agent down
            log.exception("event sink thread crashed; further events are dropped")
            with self._cv:
                self._closing = True
        finally:
            if client is not None:
                client.close()

    def _write(self, events: list[dict]) -> None:
        if self.path is None:
            return
        try:
            if self._file is None:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
            self._file.flush()
            self.stats.written += len(events)
        except OSError as exc:
            self.stats.last_error = f"write {self.path}: {exc}"

    def _post(self, client: httpx.Client, batch: list[dict]) -> None:
        self._inflight = len(batch)
        try:
            tools = [e for e in batch if e.get("kind") not in SESSION_KINDS]
            ends = [e for e in batch if e.get("kind") in SESSION_KINDS]
            if tools and not self._post_once(client, tools, self.headers):
                # the tool events wait for a retry: a session's end must not overtake them
                self._requeue(tools + ends)
            elif ends and not self._post_once(client, ends, self.session_headers):
                self._requeue(ends)
        finally:
            self._inflight = 0

    def _post_once(self, client: httpx.Client, batch: list[dict],
                   headers: dict[str, str]) -> bool:
        """One POST; False when the batch should be retried (the caller requeues it)."""
        try:
            resp = client.post(self.url, content=json.dumps(batch), headers=headers)
            if self._abandoned:
                return True
            if resp.status_code >= 500 or resp.status_code == 429:
                raise httpx.HTTPStatusError(f"HTTP {resp.status_code}", request=resp.request, response=resp)
            if resp.status_code >= 400:
                # the sidecar rejected the batch (schema): retrying cannot help
                self.stats.posts_failed += 1
                self.stats.dropped += len(batch)
                self.stats.last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                log.warning("sidecar rejected %d events: %s", len(batch), self.stats.last_error)
                return True
            self.stats.posts_ok += 1
            self.stats.sent += len(batch)
            self._backoff = 0.0
            self._backoff_until = 0.0
            return True
        except httpx.HTTPError as exc:
            if self._abandoned:
                return True
            self.stats.posts_failed += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            self._backoff = min(self.max_backoff_s, max(0.05, self._backoff * 2))
            self._backoff_until = time.monotonic() + self._backoff
            return False

    def _requeue(self, batch: list[dict]) -> None:
        with self._cv:
            if self._closing:
                # close() already counted what is queued; these would never be sent
                if not self._abandoned:
                    self.stats.dropped += len(batch)
                return
            for ev in reversed(batch):
                self._retry.appendleft(ev)
            while len(self._retry) > self.max_retry:
                self._retry.popleft()  # the oldest go first: recent state matters most
                self.stats.dropped += 1
