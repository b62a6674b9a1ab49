"""Metrics read off the unified stream: what the engine and the tools did, for an operator.

The sidecar merges every engine, tool and control event (:mod:`mars.sidecar.hub`); this
observer turns the ones an operator asks about into Prometheus series: per-round time to
first token, prefix-cache hits, preemptions, chunk shrinks, pins by outcome and how long
they were held, tool durations and the tools waiting for a core. The engine's own state
(KV blocks free / used / pinned, running and waiting requests) is already a scrape-time gauge
of the control plane's last snapshot (:meth:`mars.sidecar.app.Sidecar._gauges`).

Label sets are bounded, as Prometheus asks: no session, request or tool name is ever a label
(tool names come from clients); rounds are folded into four classes; pin outcomes and tool
statuses are the schema's closed sets (:mod:`mars.protocol.events`). A test drives a
thousand sessions through it and checks the series count stays flat.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

#: time-to-first-token buckets (seconds): a cached continuation to a long prefill past a queue
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: how long pins are held and tools run (seconds): sub-second edits to long test runs
HOLD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
#: the round classes of the TTFT histogram: the first round (a cold prompt), the next few
#: (the session's context is fresh), and long sessions (deep contexts)
ROUND_CLASSES = ("1", "2-4", "5-16", "17+")
UNPIN_OUTCOMES = ("resumed", "expired", "pressure", "finished", "shutdown")
TOOL_STATUSES = ("ok", "error", "timeout", "interrupted")
#: enqueued tool calls tracked for the queued gauge; beyond this a lost tool_start (a runner
#: that died) can no longer grow the set
MAX_TRACKED_TOOL_CALLS = 100_000


def round_class(r: Any) -> str:
    """The TTFT histogram's label for a round number (``"?"``-free: unknown counts as 1)."""
    n = r if isinstance(r, int) and r >= 1 else 1
    return "1" if n == 1 else "2-4" if n <= 4 else "5-16" if n <= 16 else "17+"


class StreamMetrics:
    """An observer of the merged stream (``hub.add_observer(metrics.observe)``)."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        r = registry
        self.ttft = Histogram(prefix + "ttft_seconds",
                              "Engine arrival to first token of a call, by round class",
                              ["round"], buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(prefix + "prompt_tokens",
                                     "Prompt tokens of calls submitted to the engine",
                                     registry=r)
        self.cached_tokens = Counter(prefix + "cached_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.preemptions = Counter(prefix + "preemptions", "Calls preempted by the engine",
                                   registry=r)
        self.preempted_blocks = Counter(prefix + "preempted_blocks",
                                        "KV blocks freed by preemption", registry=r)
        self.chunk_shrinks = Counter(prefix + "chunk_shrinks",
                                     "Prefill chunks the co-scheduler shrank", registry=r)
        self.pins = Counter(prefix + "pins", "Contexts pinned across a tool call", registry=r)
        self.pinned_blocks = Counter(prefix + "pinned_blocks", "KV blocks pinned", registry=r)
        self.unpins = Counter(prefix + "unpins", "Pins returned, by outcome", ["outcome"],
                              registry=r)
        self.pin_held = Histogram(prefix + "pin_held_seconds", "How long a pin was held, by outcome",
                                  ["outcome"], buckets=HOLD_BUCKETS, registry=r)
        self.tool_seconds = Histogram(prefix + "tool_seconds", "Tool call durations, by status",
                                      ["status"], buckets=HOLD_BUCKETS, registry=r)
        self._ttft = {c: self.ttft.labels(c) for c in ROUND_CLASSES}
        self._unpins = {o: self.unpins.labels(o) for o in UNPIN_OUTCOMES}
        self._held = {o: self.pin_held.labels(o) for o in UNPIN_OUTCOMES}
        self._tools = {s: self.tool_seconds.labels(s) for s in TOOL_STATUSES}
        #: (session, call id or tool) of tools enqueued and not started yet
        self._queued: set[tuple[str, str]] = set()

    @property
    def tools_queued(self) -> int:
        """Tool calls enqueued by their runner and not started (waiting for a core)."""
        return len(self._queued)

    def observe(self, ev: dict[str, Any]) -> None:
        kind = ev.get("kind")
        if kind == "gpu_1st_token":
            self._ttft[round_class(ev.get("round"))].observe(float(ev.get("launch_delay_s", 0)))
            self.cached_tokens.inc(int(ev.get("cached_tokens") or 0))
        elif kind == "gpu_submit":
            self.prompt_tokens.inc(int(ev.get("prompt_tokens") or 0))
        elif kind == "preempt":
            self.preemptions.inc()
            self.preempted_blocks.inc(int(ev.get("blocks") or 0))
        elif kind == "chunk_shrink":
            self.chunk_shrinks.inc()
        elif kind == "pin":
            self.pins.inc()
            self.pinned_blocks.inc(int(ev.get("blocks") or 0))
        elif kind == "unpin":
            outcome = ev.get("reason")
            if outcome in self._unpins:
                self._unpins[outcome].inc()
                self._held[outcome].observe(float(ev.get("held_s") or 0))
        elif kind == "tool_enqueue":
            if len(self._queued) < MAX_TRACKED_TOOL_CALLS:
                self._queued.add(_tool_key(ev))
        elif kind == "tool_start":
            self._queued.discard(_tool_key(ev))
        elif kind == "tool_end":
            self._queued.discard(_tool_key(ev))
            status = ev.get("status", "ok")
            if status in self._tools:
                self._tools[status].observe(float(ev.get("duration_s") or 0))
        elif kind == "session_end":
            sid = ev.get("session_id")
            if self._queued and sid:
                self._queued = {k for k in self._queued if k[0] != sid}


def _tool_key(ev: dict[str, Any]) -> tuple[str, str]:
    return (str(ev.get("session_id")), str(ev.get("call_id") or ev.get("tool")))
