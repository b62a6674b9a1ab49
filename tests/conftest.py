"""Shared fixtures. Engine tests start real ``mars-vllm serve`` processes on the embedded tiny
model; one server per test module (start-up costs ~20-40 s on two cores)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

#: a small exact KV cache: 16 MiB = 32,768 tokens of the tiny model (512 B/token)
SMALL_KV = str(16 << 20)
BASE_ARGS = ["--max-model-len", "16384", "--kv-cache-memory-bytes", SMALL_KV,
             "--max-num-seqs", "32", "--seed", "0"]


def read_events(path: str | os.PathLike, kind: str | None = None) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        if line.strip():
            ev = json.loads(line)
            if kind is None or ev.get("kind") == kind:
                out.append(ev)
    return out


def wait_for_events(path, pred, timeout_s: float = 10.0) -> list[dict]:
    """Events are flushed by a background thread every few ms: poll briefly."""
    deadline = time.monotonic() + timeout_s
    while True:
        evs = [e for e in read_events(path) if pred(e)]
        if evs or time.monotonic() > deadline:
            return evs
        time.sleep(0.1)


def engine_server(extra_args: list[str] | None = None, **kw):
    vllm = pytest.importorskip("vllm")  # noqa: F841 - engine tests need the serving env
    from mars.launch import ServerProcess

    return ServerProcess(args=[*BASE_ARGS, *(extra_args or [])], **kw)
