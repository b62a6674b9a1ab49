"""The GPU half of the unified stream: a ZMQ SUB reader of the EngineCore's publisher.

The socket is non-blocking and driven by the event loop itself (``add_reader`` on ZMQ's
notification fd), not by a thread: a reader thread would hand every batch over with
``call_soon_threadsafe`` (a pipe write and a loop wake-up) and compete with the loop for the
GIL, which on a 2-core machine showed up as proxy latency. Each wake-up drains whatever is
queued, so a burst of engine events costs one callback. ZMQ reconnects by itself, so an engine
that restarts on the same endpoint is picked up again without any action here; the
``scheduler_start`` it announces resets the KV view in the pressure state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from mars.stream.publisher import TOPIC

log = logging.getLogger("mars.stream.engine")


class EngineEventReader:
    def __init__(self, endpoint: str, deliver: Callable[[list[dict[str, Any]]], None],
                 loop: asyncio.AbstractEventLoop, on_malformed: Callable[[], None] | None = None,
                 max_batch: int = 4096) -> None:
        self.endpoint = endpoint
        self._deliver = deliver
        self._loop = loop
        self._on_malformed = on_malformed
        self._max_batch = max_batch
        self._sock = None
        self._fd: int | None = None
        self.received = 0
        self.last_event_at: float | None = None

    def start(self) -> None:
        import zmq

        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100000)
        # retry fast while the engine is (re)starting: its first event (scheduler_start,
        # with the block size) is published right after it binds
        sock.setsockopt(zmq.RECONNECT_IVL, 20)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError:
            log.exception("cannot connect to engine events at %s", self.endpoint)
            sock.close(0)
            return
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # the fd is edge-triggered: look once now

    def stop(self) -> None:
        if self._sock is None:
            return
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
        self._sock.close(0)
        self._sock = None

    def _drain(self) -> None:
        import zmq

        sock = self._sock
        if sock is None:
            return
        batch: list[dict[str, Any]] = []
        more = False
        try:
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                if len(batch) >= self._max_batch:
                    more = True
                    break
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    ev = json.loads(frames[-1])
                except (ValueError, IndexError):
                    ev = None
                if isinstance(ev, dict):
                    batch.append(ev)
                elif self._on_malformed is not None:
                    self._on_malformed()
        except zmq.ZMQError:
            log.exception("engine event socket failed")
        if batch:
            self.received += len(batch)
            self.last_event_at = time.time()
            self._deliver(batch)
        if more:  # edge-triggered fd: it will not fire again for what is still queued
            self._loop.call_soon(self._drain)
