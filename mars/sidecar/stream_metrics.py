"""Metrics read off the unified stream: what the engine and the tools did, for an operator.

The sidecar merges every engine, tool and control event (:mod:`mars.sidecar.hub`); this
observer turns the ones an operator asks about into Prometheus series: per-round time to
first token, prefix-cache hits, preemptions, chunk shrinks, pins by outcome and how long
they were held, tool durations, the window's decisions. The state (KV blocks free / used /
pinned, requests, tools running and waiting for a core) is a scrape-time gauge of the
control plane's snapshot instead (:meth:`mars.sidecar.app.Sidecar._gauges`).

Label sets are bounded, as Prometheus asks: no session, request or tool name is ever a label
(tool names come from clients); rounds are folded into five classes; pin outcomes and tool
statuses are the schema's closed sets (:mod:`mars.protocol.events`). A test drives a
thousand sessions through it and checks the series count stays flat. Engine events reach
the sidecar unvalidated: a field of the wrong type counts as nothing rather than stopping
the observer.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

#: time-to-first-token buckets (seconds): a cached continuation to a long prefill past a queue
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: how long pins are held and tools run (seconds): sub-second edits to long test runs
HOLD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
#: the round classes of the TTFT histogram (rounds count from 0, as the replay and the
#: OpenHands integration number them): the first round (a cold prompt), the next few (the
#: session's context is fresh), long sessions (deep contexts), and calls without a round
#: (one-shot calls)
ROUND_CLASSES = ("0", "1-3", "4-15", "16+", "none")
UNPIN_OUTCOMES = ("resumed", "expired", "pressure", "finished", "shutdown")
TOOL_STATUSES = ("ok", "error", "timeout", "interrupted")
WINDOW_MODES = ("increase", "decrease", "hold")


def round_class(r: Any) -> str:
    """The TTFT histogram's label for a round number."""
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        return "none"
    return "0" if r == 0 else "1-3" if r <= 3 else "4-15" if r <= 15 else "16+"


def _count(x: Any) -> int:
    """A count from an event field: engine events are not validated, so anything that is not a
    non-negative number counts as 0 rather than stopping the observer."""
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 else 0


def _seconds(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 \
        else None


class StreamMetrics:
    """An observer of the merged stream (``hub.add_observer(metrics.observe)``)."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        r = registry
        self.ttft = Histogram(prefix + "ttft_seconds",
                              "Engine arrival to first token of a call, by round class",
                              ["round"], buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(prefix + "prompt_tokens",
                                     "Prompt tokens of calls that reached their first token",
                                     registry=r)
        self.cached_tokens = Counter(prefix + "cached_tokens",
                                     "Of those, tokens served from the prefix cache", registry=r)
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
        self.tool_seconds = Histogram(prefix + "tool_duration_seconds",
                                      "Tool call durations, by status", ["status"],
                                      buckets=HOLD_BUCKETS, registry=r)
        self.window_updates = Counter(
            prefix + "window_updates", "Window decisions published, by mode (every change, and "
            "the last decision again at each heartbeat)", ["mode"], registry=r)
        self._ttft = {c: self.ttft.labels(c) for c in ROUND_CLASSES}
        self._unpins = {o: self.unpins.labels(o) for o in UNPIN_OUTCOMES}
        self._held = {o: self.pin_held.labels(o) for o in UNPIN_OUTCOMES}
        self._tools = {s: self.tool_seconds.labels(s) for s in TOOL_STATUSES}
        self._modes = {m: self.window_updates.labels(m) for m in WINDOW_MODES}

    def observe(self, ev: dict[str, Any]) -> None:
        kind = ev.get("kind")
        if kind == "gpu_1st_token":
            delay = _seconds(ev.get("launch_delay_s"))
            if delay is not None:
                self._ttft[round_class(ev.get("round"))].observe(delay)
            if ev.get("prompt_tokens") is not None:
                self.prompt_tokens.inc(_count(ev.get("prompt_tokens")))
                self.cached_tokens.inc(_count(ev.get("cached_tokens")))
        elif kind == "preempt":
            self.preemptions.inc()
            self.preempted_blocks.inc(_count(ev.get("blocks")))
        elif kind == "chunk_shrink":
            self.chunk_shrinks.inc()
        elif kind == "pin":
            self.pins.inc()
            self.pinned_blocks.inc(_count(ev.get("blocks")))
        elif kind == "unpin":
            outcome = ev.get("reason")
            if isinstance(outcome, str) and outcome in self._unpins:
                self._unpins[outcome].inc()
                self._held[outcome].observe(_seconds(ev.get("held_s")) or 0.0)
        elif kind == "tool_end":
            status = ev.get("status", "ok")
            held = _seconds(ev.get("duration_s"))
            if isinstance(status, str) and status in self._tools and held is not None:
                self._tools[status].observe(held)
        elif kind == "window_update":
            mode = ev.get("mode")
            if isinstance(mode, str) and mode in self._modes:
                self._modes[mode].inc()
