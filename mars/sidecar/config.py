"""The sidecar's configuration: one typed dataclass, built by the CLI, the simulator or tests.

The policies' own knobs (AIMD, packing, pressure) live in :class:`AdmissionConfig` of the
framework-free layer; this file only adds what the *mechanism* needs (ports, timeouts, queue
and stream limits), so a policy change never touches the proxy and vice versa.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mars.policy.control.admission import AdmissionConfig
from mars.policy.control.packing import PackConfig
from mars.policy.control.placement import PLACERS
from mars.stream.publisher import rank_endpoint
from mars.policy.control.pressure import CPU_BUDGETS, PressureConfig
from mars.policy.control.window import AIMDConfig

#: AdmissionConfig's nested configurations, by their key in an override object
_SUB = {"aimd": AIMDConfig, "packing": PackConfig, "pressure": PressureConfig}


def engine_events_for(upstream: str) -> str:
    """The engine events endpoint ``mars-vllm serve --no-sidecar --port P`` binds by default.

    Same rule as ``mars.engine.serve.cli.default_events_endpoint`` (not imported: the
    sidecar must not pull in vLLM).
    """
    port = urlsplit(upstream).port or 80
    return f"ipc://{tempfile.gettempdir()}/mars-engine-{port}.ipc"


def _base_url(url: str) -> str:
    """An upstream's base URL: no trailing slash or ``/v1``; http(s) only."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"upstream must be an http(s) URL, got {url!r}")
    return url


def read_admission_overrides(text: str) -> dict[str, Any]:
    """``--admission-config``'s value: a JSON object, or ``@FILE`` holding one."""
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as f:
            text = f.read()
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("--admission-config must be a JSON object")
    return raw


def admission_config(overrides: Mapping[str, Any] | None = None, *,
                     tool_cores: float | None = None, initial_window: float | None = None,
                     min_window: int | None = None, max_window: int | None = None,
                     max_queue: int | None = None) -> AdmissionConfig:
    """The control plane's configuration from an override object (``AdmissionConfig``'s
    keys; ``aimd`` / ``packing`` / ``pressure`` as objects of their own) and the sidecar's
    named options: the windows and ``max_queue`` win over the object; ``tool_cores`` only
    fills ``pressure.tool_cores`` where the object leaves it out, and when it is None or 0
    this host's cores are taken (the tools run beside the sidecar unless told otherwise)."""
    raw = dict(overrides or {})
    subs = {k: dict(raw.pop(k, None) or {}) for k in _SUB}
    aimd = subs["aimd"]
    for key, value in (("initial_window", initial_window), ("min_window", min_window),
                       ("max_window", max_window)):
        if value is not None:
            aimd[key] = value
    # a window given alone implies consistent bounds (e.g. --max-window 4 with the default
    # initial window 8 means "at most 4")
    if "initial_window" not in aimd and ("min_window" in aimd or "max_window" in aimd):
        d = AIMDConfig()
        aimd["initial_window"] = min(max(d.initial_window, aimd.get("min_window", d.min_window)),
                                     aimd.get("max_window", d.max_window))
    subs["pressure"].setdefault("tool_cores", float(tool_cores or os.cpu_count() or 1))
    if max_queue is not None:
        raw["max_queue"] = max_queue
    return AdmissionConfig(**raw, **{k: _SUB[k](**v) for k, v in subs.items()})


@dataclass(slots=True)
class SidecarConfig:
    """Everything ``mars sidecar`` needs. Defaults suit one engine on the same host."""

    #: base URL of the vLLM OpenAI server (no trailing ``/v1``)
    upstream: str = "http://127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 8000
    #: True: new sessions wait for BalanceAndAdmit; False: pass-through (sessions, events and
    #: metrics still work; baselines and ``mars_no_ctrl`` run behind this mode so that every
    #: policy pays the same proxy cost)
    admission: bool = True
    admission_config: AdmissionConfig = field(default_factory=AdmissionConfig)
    #: ZMQ endpoint of the engine's event publisher; "" = do not subscribe
    engine_events: str = ""
    #: several engines of one model, one server each (vLLM's external load-balancing shape):
    #: their base URLs and, position for position, their event endpoints ("" = none). Empty:
    #: the one engine above. The first is ``upstream`` / ``engine_events`` then.
    upstreams: tuple[str, ...] = ()
    engines_events: tuple[str, ...] = ()
    #: which engine a new session goes to (mars.policy.control.placement.PLACERS)
    placement: str = "mars"
    #: several engines: their control planes share the host's tool cores ("node") or each
    #: counts an equal share of them ("split"; mars.policy.control.pressure.NodeTools)
    cpu_budget: str = "node"
    #: N > 1: the one upstream is a ``--data-parallel-size N`` server, its engines addressed
    #: by vLLM's ``X-data-parallel-rank`` header, each publishing its events on its own
    #: endpoint (mars.stream.publisher.rank_endpoint of ``engine_events``)
    data_parallel_size: int = 1
    #: append the merged stream (engine + tool + control events) to this JSONL file
    events_file: str | None = None

    # --- sessions -------------------------------------------------------------------------
    #: a request waiting for admission gets 503 once nothing has progressed (admission,
    #: session end, request finished well, engine output, tool end) for this long (seconds):
    #: a stall bound, not a bound on the wait (AdmissionCore.wait_deadline)
    admission_timeout_s: float = 300.0
    #: an admitted session with no request in flight, no open tool call and no activity for
    #: this long is ended (seconds); agents that vanish must not hold a slot forever
    idle_timeout_s: float = 300.0
    #: period of the control-step timer (seconds); steps also run after relevant events
    step_interval_s: float = 0.25
    #: a window_update is emitted when the decision changes, and at least this often
    window_heartbeat_s: float = 5.0
    #: prompt bytes per token used to estimate a new session's KV blocks from its body
    bytes_per_token: float = 4.0

    # --- upstream -------------------------------------------------------------------------
    #: "fast" (asyncio + httptools, ~0.1 ms CPU per request) or "httpx" (~0.8 ms); see
    #: mars/sidecar/upstream.py
    upstream_client: str = "fast"
    connect_timeout_s: float = 5.0
    #: read timeout for upstream responses; None = wait as long as the generation takes
    read_timeout_s: float | None = None
    max_connections: int = 2048
    #: largest request body accepted (bytes); larger ones get 413 before they are read whole
    #: (a 262K-token prompt is ~2 MB as token ids; 64 MiB leaves room for base64 images)
    max_body_bytes: int = 64 << 20
    #: bodies of this size and more are JSON-parsed in a child process, not on the event loop
    #: (mars/sidecar/body_parser.py: CPython's decoder holds the GIL, so a thread would not
    #: free the loop); below it a parse takes about a millisecond at most
    offload_parse_bytes: int = 256 << 10
    #: seconds clients are told to wait in Retry-After (429 / 503)
    retry_after_s: int = 1

    # --- event stream ---------------------------------------------------------------------
    #: events buffered per SSE subscriber before the oldest are dropped (slow consumers)
    sse_queue: int = 10000
    sse_keepalive_s: float = 10.0
    #: JSONL writes are batched this often (seconds)
    flush_interval_s: float = 0.1
    #: include the upstream's own /metrics text in GET /metrics
    merge_upstream_metrics: bool = True

    # --- access (mars/sidecar/auth.py; docs/sidecar.md "Trust model") ----------------------
    #: bearer keys for every guarded endpoint (vLLM's --api-key / VLLM_API_KEY); () = open
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    #: extra keys that may only post tool events (tool runners); API keys work there too
    events_api_keys: tuple[str, ...] = field(default=(), repr=False)
    #: serve GET /metrics without a key even when keys are set (a scraper on a trusted network)
    open_metrics: bool = False

    # --- process --------------------------------------------------------------------------
    #: exit when this process is no longer our parent (set by ``mars-vllm serve``)
    parent_pid: int | None = None
    #: serve on this inherited, already listening socket instead of binding host:port
    #: (``mars-vllm serve`` binds the public port itself, so that a taken port fails at once,
    #: before the engine loads, not in the sidecar after it)
    listen_fd: int | None = None
    #: on SIGTERM, in-flight requests may finish for this long before they are cut (seconds)
    drain_timeout_s: float = 5.0
    log_level: str = "warning"
    access_log: bool = False

    def __post_init__(self) -> None:
        self.upstreams = tuple(_base_url(u) for u in (self.upstreams or (self.upstream,)))
        if len(set(self.upstreams)) != len(self.upstreams):
            raise ValueError(f"an upstream is named twice in {list(self.upstreams)}")
        dp = self.data_parallel_size
        if not isinstance(dp, int) or dp < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {dp!r}")
        if dp > 1 and len(self.upstreams) > 1:
            raise ValueError("--data-parallel-size addresses the engines of one server by "
                             "rank; several --upstream URLs are engines of their own: "
                             "give one or the other")
        engines = len(self.engine_urls)
        if self.engines_events:
            events = tuple(self.engines_events)
        elif dp > 1:
            events = tuple(rank_endpoint(self.engine_events, r) or "" for r in range(dp))
        else:
            events = (self.engine_events,) + ("",) * (engines - 1)
        if len(events) != engines:
            raise ValueError(f"{len(events)} engine event endpoints for {engines} engines: "
                             "give one per engine")
        named = [e for e in events if e]
        if len(set(named)) != len(named):
            raise ValueError("two upstreams cannot share one engine event endpoint: each "
                             "engine publishes its own")
        self.engines_events = events
        self.upstream, self.engine_events = self.upstreams[0], events[0]
        if self.placement not in PLACERS:
            raise ValueError(f"unknown placement {self.placement!r}; choose one of "
                             f"{', '.join(sorted(PLACERS))}")
        if self.cpu_budget not in CPU_BUDGETS:
            raise ValueError(f"unknown cpu budget {self.cpu_budget!r}; choose one of "
                             f"{', '.join(CPU_BUDGETS)}")
        for name in ("admission_timeout_s", "idle_timeout_s", "step_interval_s",
                     "window_heartbeat_s", "bytes_per_token", "connect_timeout_s",
                     "flush_interval_s", "sse_keepalive_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):  # (nan > 0 is False too)
                raise ValueError(f"{name} must be > 0 and finite")
        if self.upstream_client not in ("fast", "httpx"):
            raise ValueError("upstream_client must be 'fast' or 'httpx'")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.max_body_bytes < 1 or self.offload_parse_bytes < 0:
            raise ValueError("max_body_bytes must be >= 1 and offload_parse_bytes >= 0")
        self.api_keys = tuple(k for k in self.api_keys if k)
        self.events_api_keys = tuple(k for k in self.events_api_keys if k)
        if any(any(c.isspace() for c in k) for k in self.api_keys + self.events_api_keys):
            raise ValueError("API keys must not contain whitespace")
        if self.retry_after_s < 0 or self.max_connections < 1 or self.sse_queue < 1:
            raise ValueError("retry_after_s must be >= 0, max_connections and sse_queue >= 1")

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """The URL of each engine, by rank: the upstreams, or the one data-parallel server
        once per rank."""
        if self.data_parallel_size > 1:
            return self.upstreams[:1] * self.data_parallel_size
        return self.upstreams
