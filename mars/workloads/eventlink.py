"""The replay's link to the unified information stream: post tool events, record the stream.

When the replay talks to the mars sidecar, it stands in for the instrumented agent tools and
posts ``tool_enqueue`` / ``tool_start`` / ``tool_end`` to ``POST /v1/mars/events`` (the CPU
plane of the stream, paper §4.1). Posting never blocks a task: events go into a queue that a
background task drains in batches; a failed post is counted and dropped, never retried into
the run's critical path.

It also records the sidecar's merged stream (``GET /v1/mars/events/stream``, SSE) into the
run's ``events.jsonl``. Without a sidecar, the engine's own JSONL file
(``mars-vllm serve --mars-events-file``) can be sliced to the run's time window instead
(:func:`slice_events_file`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

import httpx

from mars.protocol.events import make_event
from mars.protocol.sse import aiter_sse_lines


#: events that end a session: a tool-runner key may not post them (docs/sidecar.md, "Trust
#: model"), so they go in posts of their own with the API key
SESSION_KINDS = frozenset({"session_end"})


class EventPoster:
    """Batching, fire-and-forget poster of tool events to the sidecar.

    ``headers`` authorise the tool events (a tool-runner key); ``session_headers`` (default:
    ``headers``) the ``session_end`` events, posted apart from them."""

    def __init__(self, client: httpx.AsyncClient, url: str, batch: int = 64,
                 headers: dict[str, str] | None = None,
                 session_headers: dict[str, str] | None = None) -> None:
        self._client = client
        self._url = url + "/v1/mars/events"
        self._headers = headers
        self._session_headers = headers if session_headers is None else session_headers
        self._batch = batch
        self._queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.posted = 0
        self.failed = 0

    def start(self) -> "EventPoster":
        self._task = asyncio.create_task(self._drain(), name="mars-event-poster")
        return self

    def emit(self, kind: str, *, session_id: str, ts: float, **fields: Any) -> None:
        self._queue.put_nowait(make_event(kind, session_id=session_id, ts=ts, **fields))

    async def _drain(self) -> None:
        done = False
        while not done:
            ev = await self._queue.get()
            batch = []
            if ev is None:
                done = True
            else:
                batch.append(ev)
            while len(batch) < self._batch and not self._queue.empty():
                nxt = self._queue.get_nowait()
                if nxt is None:
                    done = True
                    break
                batch.append(nxt)
            tools = [e for e in batch if e["kind"] not in SESSION_KINDS]
            ends = [e for e in batch if e["kind"] in SESSION_KINDS]
            if tools:
                await self._post(tools, self._headers)
            if ends:
                await self._post(ends, self._session_headers)

    async def _post(self, batch: list[dict[str, Any]], headers: dict[str, str] | None) -> None:
        try:
            r = await self._client.post(self._url, json=batch, timeout=5.0, headers=headers)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            self.posted += len(batch)
        else:
            self.failed += len(batch)

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._task is None:
            return
        self._queue.put_nowait(None)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._task, timeout_s)
        self._task = None


class StreamRecorder:
    """Append the sidecar's SSE event stream to a JSONL file while the run goes on."""

    def __init__(self, client: httpx.AsyncClient, url: str, path: str | os.PathLike[str]) -> None:
        self._client = client
        self._url = url + "/v1/mars/events/stream"
        self.path = Path(path)
        self._task: asyncio.Task | None = None
        self.count = 0
        self.error: str | None = None

    def start(self) -> "StreamRecorder":
        self._task = asyncio.create_task(self._run(), name="mars-event-recorder")
        return self

    async def _run(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as f:
            try:
                async with self._client.stream("GET", self._url, timeout=httpx.Timeout(
                        None, connect=5.0)) as r:
                    if r.status_code != 200:
                        self.error = f"HTTP {r.status_code}"
                        return
                    async for line in aiter_sse_lines(r.aiter_bytes()):
                        if line.startswith("data:"):
                            self._write(f, line[5:].strip())
            except httpx.HTTPError as e:
                self.error = f"{type(e).__name__}: {e}"

    def _write(self, f: TextIO, data: str) -> None:
        try:
            obj = json.loads(data)
        except ValueError:
            return
        for ev in obj if isinstance(obj, list) else [obj]:
            if isinstance(ev, dict) and "kind" in ev:
                f.write(json.dumps(ev, separators=(",", ":")) + "\n")
                self.count += 1
        f.flush()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Events of a JSONL file; unparsable lines (a partly written last line) are skipped."""
    out: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict):
                    out.append(ev)
    except FileNotFoundError:
        return []
    return out


def slice_events_file(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                      t0: float, t1: float) -> int:
    """Copy the events with ``t0 <= ts <= t1`` (Unix time) from ``src`` to ``dst``."""
    evs = [e for e in read_events(src) if isinstance(e.get("ts"), (int, float)) and t0 <= e["ts"] <= t1]
    write_events(dst, evs)
    return len(evs)


def write_events(path: str | os.PathLike[str], events: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for ev in events:
            f.write(json.dumps(ev, separators=(",", ":")) + "\n")
