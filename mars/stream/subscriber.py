"""Consumers of the engine event stream: ZMQ SUB or following a JSONL file."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

from mars.stream.publisher import TOPIC


def subscribe(endpoint: str, timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
    """Yield events published on ``endpoint`` until ``timeout_s`` passes with none (or forever)."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sock.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))
            if sock not in ready:
                return
            _, payload = sock.recv_multipart()
            yield json.loads(payload)
    finally:
        sock.close(0)


def follow_jsonl(path: str, from_start: bool = True, poll_s: float = 0.1,
                 idle_timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
    """``tail -f`` for an events JSONL file; partial last lines are held back until complete."""
    while not os.path.exists(path):
        time.sleep(poll_s)
    idle = 0.0
    with open(path, encoding="utf-8") as f:
        if not from_start:
            f.seek(0, os.SEEK_END)
        pending = ""
        while True:
            chunk = f.readline()
            if not chunk:
                if idle_timeout_s is not None and idle >= idle_timeout_s:
                    return
                time.sleep(poll_s)
                idle += poll_s
                continue
            idle = 0.0
            pending += chunk
            if not pending.endswith("\n"):
                continue
            line, pending = pending.strip(), ""
            if line:
                yield json.loads(line)
