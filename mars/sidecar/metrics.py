"""Prometheus metrics of the sidecar (``GET /metrics``).

Counters and histograms are updated on the hot path, so their label children are cached
(``labels()`` costs a lock and a dict lookup per call otherwise). Gauges of the control state
(window, queue, dual-pressure signals) are *not* maintained on the hot path at all: a custom
collector reads them from the live objects when Prometheus scrapes, so they cost nothing
between scrapes and can never drift from the state they describe.

Each app gets its own :class:`CollectorRegistry`, so several sidecars can live in one
process (tests) without clashing on the global registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily

from mars.sidecar.stream_metrics import StreamMetrics

# ``*_created`` timestamp series double the output and nobody plots them
disable_created_metrics()

PREFIX = "mars_sidecar_"
#: queue-wait buckets: admission waits range from a loop iteration to minutes
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

#: a gauge sample source: name -> (help, value) or (help, {labels-tuple: value}, label names)
GaugeSource = Callable[[], dict[str, tuple]]


class _StateCollector:
    """Turns a :data:`GaugeSource` into gauge families at scrape time."""

    def __init__(self, source: GaugeSource) -> None:
        self._source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        for name, spec in self._source().items():
            if len(spec) == 2:
                help_, value = spec
                if value is None:
                    continue
                yield GaugeMetricFamily(PREFIX + name, help_, value=float(value))
            else:
                help_, values, labels = spec
                fam = GaugeMetricFamily(PREFIX + name, help_, labels=list(labels))
                for key, value in values.items():
                    if value is not None:
                        fam.add_metric(list(key), float(value))
                yield fam

    def describe(self) -> list:  # no fixed description: collected on scrape only
        return []


class SidecarMetrics:
    """The sidecar's counters and histograms plus the scrape-time gauge collector."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter(PREFIX + "requests", "Requests answered, by route and status",
                                 ["route", "code"], registry=r)
        self._events = Counter(PREFIX + "events", "Events merged into the unified stream",
                               ["source", "kind"], registry=r)
        self.events_rejected = Counter(PREFIX + "events_rejected",
                                       "Event batches rejected (malformed, 400)", registry=r)
        self.sessions_admitted = Counter(PREFIX + "sessions_admitted",
                                         "Sessions admitted (or registered in pass-through)",
                                         registry=r)
        self._sessions_ended = Counter(PREFIX + "sessions_ended", "Sessions ended, by reason",
                                       ["reason"], registry=r)
        self.queue_full = Counter(PREFIX + "queue_full", "Requests refused with 429 (queue full)",
                                  registry=r)
        self.admission_timeouts = Counter(PREFIX + "admission_timeouts",
                                          "Requests that timed out waiting for admission",
                                          registry=r)
        self.disconnects = Counter(PREFIX + "client_disconnects",
                                   "Requests whose client went away before the end", registry=r)
        self.upstream_errors = Counter(PREFIX + "upstream_errors",
                                       "Upstream connection failures (503 or broken stream)",
                                       registry=r)
        self.bad_requests = Counter(PREFIX + "bad_requests",
                                    "Generation requests refused with 400 by the sidecar",
                                    registry=r)
        self.unauthorized = Counter(PREFIX + "unauthorized",
                                    "Requests refused with 401 (missing or invalid key)",
                                    registry=r)
        self.body_parser_restarts = Counter(
            PREFIX + "body_parser_restarts",
            "Body-parser child processes replaced after dying (mars/sidecar/body_parser.py)",
            registry=r)
        self.sse_dropped = Counter(PREFIX + "sse_dropped",
                                   "Events dropped for slow SSE subscribers", registry=r)
        self.observer_errors = Counter(PREFIX + "observer_errors",
                                       "Events an observer of the stream failed on (the "
                                       "control state or the metrics; each is logged)",
                                       registry=r)
        self.session_moves = Counter(PREFIX + "session_moves",
                                     "Sessions sent to another engine because theirs was down "
                                     "(several engines behind one sidecar)", registry=r)
        self.session_rebinds = Counter(PREFIX + "session_rebinds",
                                       "Queued sessions moved to another engine that could "
                                       "admit them at once (MARS placement)", registry=r)
        self.engine_events_malformed = Counter(PREFIX + "engine_events_malformed",
                                               "Engine stream messages that were not JSON",
                                               registry=r)
        self.queue_wait = Histogram(PREFIX + "queue_wait_seconds",
                                    "Time a new session waited for admission",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.request_seconds = Histogram(PREFIX + "request_seconds",
                                         "Generation request duration at the sidecar",
                                         buckets=LATENCY_BUCKETS, registry=r)
        #: what the engine and the tools did, read off the merged stream (an observer)
        self.stream = StreamMetrics(r, PREFIX)
        self._req_children: dict[tuple[str, int], Any] = {}
        self._event_children: dict[tuple[str, str], Any] = {}
        self._end_children: dict[str, Any] = {}

    def add_state(self, source: GaugeSource) -> None:
        self.registry.register(_StateCollector(source))

    # --- cached children (hot path) ---------------------------------------------------------
    def request(self, route: str, code: int) -> None:
        key = (route, code)
        c = self._req_children.get(key)
        if c is None:
            c = self._req_children[key] = self._requests.labels(route, str(code))
        c.inc()

    def event(self, source: str, kind: str) -> None:
        key = (source, kind)
        c = self._event_children.get(key)
        if c is None:
            c = self._event_children[key] = self._events.labels(source, str(kind))
        c.inc()

    def session_ended(self, reason: str) -> None:
        c = self._end_children.get(reason)
        if c is None:
            c = self._end_children[reason] = self._sessions_ended.labels(reason)
        c.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
