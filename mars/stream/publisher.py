"""Non-blocking event publisher for producers on hot paths (the EngineCore step).

``publish`` is an O(1) append to a bounded deque; a daemon thread drains it every
``flush_interval_s`` to a ZMQ PUB socket (topic ``mars``) and/or a JSONL file. The step never
waits on I/O, and if the drain falls behind the oldest events are dropped and counted rather
than letting memory grow. Events are flushed continuously, not at shutdown, because vLLM kills
the EngineCore process without calling ``Scheduler.shutdown()``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

TOPIC = b"mars"


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Where data-parallel engine ``rank`` of a server publishes, given the server's
    endpoint: rank 0 on the endpoint itself (so one engine is unchanged), rank r on its own
    (``ipc://P.ipc`` -> ``ipc://P-dp<r>.ipc``; ``tcp://H:PORT`` -> ``tcp://H:PORT+r``).
    Several engines on one endpoint would not work: only one can bind it. The sidecar
    derives the same endpoints from the server's (``mars sidecar --data-parallel-size``)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1].isdigit():
        head, port = endpoint.rsplit(":", 1)
        return f"{head}:{int(port) + rank}"
    stem, dot, ext = endpoint.rpartition(".")
    if dot and "/" not in ext:
        return f"{stem}-dp{rank}.{ext}"
    return f"{endpoint}-dp{rank}"


def rank_path(path: str | None, rank: int) -> str | None:
    """The events file of data-parallel engine ``rank``: rank 0 writes ``path`` itself,
    rank r ``<stem>.dp<r><suffix>`` beside it (processes appending one file in buffered
    chunks would cut each other's lines)."""
    if not path or rank == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.dp{rank}{ext}"


class EventPublisher:
    def __init__(self, endpoint: str | None = None, jsonl_path: str | None = None,
                 max_buffer: int = 65536, flush_interval_s: float = 0.02) -> None:
        self.endpoint = endpoint
        self.jsonl_path = jsonl_path
        self.dropped = 0
        self.published = 0
        self._buf: collections.deque[dict[str, Any]] = collections.deque()
        self._max = max_buffer
        self._interval = flush_interval_s
        self._wake = threading.Event()
        self._stop = False
        self._sock = None
        self._ctx = None
        self._file = None
        if endpoint:
            import zmq

            self._ctx = zmq.Context.instance()
            self._sock = self._ctx.socket(zmq.PUB)
            self._sock.setsockopt(zmq.SNDHWM, max_buffer)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(endpoint)
        if jsonl_path:
            self._file = open(jsonl_path, "a", buffering=1 << 16, encoding="utf-8")
        self._thread = threading.Thread(target=self._run, name="mars-events", daemon=True)
        self._thread.start()

    def publish(self, event: dict[str, Any]) -> None:
        if len(self._buf) >= self._max:
            self._buf.popleft()
            self.dropped += 1
        self._buf.append(event)

    def _drain(self) -> None:
        buf = self._buf
        if not buf:
            return
        lines = []
        while buf:
            try:
                ev = buf.popleft()
            except IndexError:
                break
            lines.append(json.dumps(ev, separators=(",", ":")))
        self.published += len(lines)
        if self._sock is not None:
            for line in lines:
                try:
                    self._sock.send_multipart([TOPIC, line.encode()], copy=False, flags=1)  # NOBLOCK
                except Exception:  # HWM reached or socket gone: a dropped event, not a crash
                    self.dropped += 1
        if self._file is not None:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._interval)
            try:
                self._drain()
            except Exception:  # never let telemetry take the engine down
                logger.exception("mars event publisher failed to drain")

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=2)
        self._drain()
        if self._file is not None:
            self._file.close()
        if self._sock is not None:
            self._sock.close(0)
