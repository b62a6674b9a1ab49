"""The sidecar application: ``create_app(SidecarConfig) -> FastAPI``.

Wiring only; every part has one job and lives in its own module:

* :mod:`~mars.sidecar.request`: which session a request belongs to (and the only body edit);
* :mod:`~mars.sidecar.control`: session admission around ``BalanceAndAdmit`` (waiting, waking,
  ending sessions);
* :mod:`~mars.sidecar.proxy`: byte-level forwarding to vLLM and the failure model;
* :mod:`~mars.sidecar.hub` + :mod:`~mars.stream.engine_reader`: the merged event stream;
* :mod:`~mars.sidecar.metrics`: Prometheus.

Endpoints (everything else is forwarded to the engine unchanged, without admission):

=====================================  ==========================================================
``POST /v1/chat/completions``          proxied with session admission (streaming included)
``POST /v1/completions``               same
``POST /v1/mars/events``               tool events (a JSON list, or one object) -> the stream
``GET  /v1/mars/events/stream``        the merged stream as SSE (``kind``, ``session``,
                                       ``max_events``, ``timeout`` query parameters)
``GET  /v1/mars/state``                window, queue, dual-pressure signals, upstream
``GET  /v1/mars/sessions``             sessions known to the sidecar
``DELETE /v1/mars/sessions/{id}``      end a session (frees its slot / queue entry)
``GET  /v1/mars/health``               the sidecar itself (the engine's ``/health`` is proxied)
``GET  /metrics``                      sidecar metrics, followed by the engine's own
=====================================  ==========================================================

The two generation routes bypass FastAPI's routing and middleware (:class:`HotPath`): they
take the raw request and use none of it, and every microsecond there is added latency.

Past 600 lines on purpose: :class:`Sidecar` is the one place where a request's session, its
admission wait, its relay and its cleanup meet the stream and the metrics; what has a job of its
own is apart (the request's session :mod:`.request`, the relay :mod:`.proxy`, the engine
clients :mod:`.upstream`, admission :mod:`.control`, placement :mod:`.engines`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from functools import partial
from typing import Any

from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mars.policy.control.admission import QueueFull
from mars.policy.control.placement import LEAVING
from mars.protocol.events import TOOL_KINDS, EventError, make_event
from mars.sidecar.auth import Access, Authenticator
from mars.sidecar.config import SidecarConfig
from mars.sidecar.control import AdmissionTimeout, ControlPlane, Session, SessionClosed
from mars.stream.engine_reader import EngineEventReader
from mars.sidecar.errors import openai_error
from mars.sidecar.hub import EventHub
from mars.sidecar.metrics import SidecarMetrics
from mars.sidecar.proxy import (DisconnectWatch, GuardedStreamingResponse, RelayResponse,
                                buffered, is_event_stream, request_headers)
from mars.sidecar.engines import EngineSet, NoEngineError
from mars.sidecar.upstream import UpstreamUnavailable
from mars.sidecar.body_parser import BodyParser, BodyTooComplex, ParserUnavailable
from mars.sidecar.request import BadRequest

log = logging.getLogger("mars.sidecar")

GENERATE_ROUTES = ("/v1/chat/completions", "/v1/completions")
#: kinds clients may post: the CPU plane, plus ``session_end`` as "this session is over"
POSTABLE_KINDS = frozenset(TOOL_KINDS) | {"session_end"}
#: where HotPath leaves the caller's proven audience (mars.sidecar.auth.Access) in the scope
ACCESS_SCOPE_KEY = "mars.access"
#: state gauges of the sidecar itself, not of one engine (no ``engine`` label)
SIDECAR_GAUGES = frozenset({"sse_subscribers"})
#: status recorded for a request whose client went away (nginx's convention)
CLIENT_CLOSED = 499


class Sidecar:
    """Owns the parts and implements the endpoints; one per app."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.metrics = SidecarMetrics()
        self.hub = EventHub(self.metrics, config.events_file, config.sse_queue)
        self.engines = EngineSet(config, self.hub.publish, self.metrics)
        # the first engine's parts (the only one's, in the common case)
        self.control: ControlPlane = self.engines[0].control
        self.upstream = self.engines[0].upstream
        self.hub.add_observer(self.engines.observe)
        self.hub.add_observer(self.metrics.stream.observe)
        self.parser = BodyParser(config.offload_parse_bytes, config.max_body_bytes,
                                 on_restart=self.metrics.body_parser_restarts.inc)
        self._tasks: list[asyncio.Task] = []
        self._rid = itertools.count(1)
        self._rid_prefix = f"sc-{os.getpid():x}-"
        self.started_at = time.time()
        self.metrics.add_state(self._gauges)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.engines.start(loop, self.hub.publish_many, self.metrics.engine_events_malformed.inc)
        self._tasks = [loop.create_task(self.control.run_timer(self._tick)),
                       loop.create_task(self._flusher())]
        self._tasks += [loop.create_task(e.control.run_timer()) for e in self.engines.engines[1:]]

    @property
    def reader(self) -> EngineEventReader | None:
        return self.engines[0].reader

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.engines.stop()
        self.hub.close()
        await self.parser.aclose()

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(self.config.flush_interval_s)
            self.hub.flush()

    def _tick(self, now: float) -> None:
        pp = self.config.parent_pid
        if pp and os.getppid() != pp:
            # the engine went with our parent: no stream can finish, nothing to drain (a
            # graceful shutdown would hold the port for --drain-timeout)
            log.warning("parent process %d is gone: exiting", pp)
            self.hub.flush()
            os._exit(0)

    # ------------------------------------------------------------------ generation
    def _answer(self, route: str, resp: Response) -> Response:
        self.metrics.request(route, resp.status_code)
        return resp

    def _request_done(self, control: ControlPlane, session: Session, rid: str, t0: float,
                      status: int, outcome: str) -> None:
        dt = time.perf_counter() - t0
        self.metrics.request_seconds.observe(dt)
        if outcome == "disconnect":
            self.metrics.disconnects.inc()
            status = CLIENT_CLOSED
        elif outcome == "error" and status < 500:
            status = 503
        self.hub.publish(make_event("request_end", session_id=session.id, request_id=rid,
                                    status=status, duration_s=dt), "control")
        control.finish(session, outcome)

    async def read_body(self, request: Request) -> bytes | Response:
        """The request body, or a 413 once it exceeds ``max_body_bytes`` (checked against the
        declared length first, then while reading: an oversized body is never held whole)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return self._too_big(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return self._too_big(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_big(self, limit: int) -> Response:
        self.metrics.bad_requests.inc()
        return openai_error(413, f"request body exceeds the sidecar's limit of {limit} bytes "
                                 "(--max-body-bytes)")

    async def generate(self, request: Request) -> Response:
        """A chat / completion request: session identity, admission, forwarding."""
        t0 = time.perf_counter()
        scope = request.scope
        route = scope["path"]
        body = await self.read_body(request)
        if isinstance(body, Response):
            return self._answer(route, body)
        try:
            info = await self.parser.generate(body, request.headers, self.config.bytes_per_token)
        except BadRequest as exc:
            self.metrics.bad_requests.inc()
            return self._answer(route, openai_error(400, str(exc), param=exc.param))
        except BodyTooComplex as exc:
            self.metrics.bad_requests.inc()
            return self._answer(route, openai_error(413, str(exc)))
        except ParserUnavailable as exc:
            return self._answer(route, openai_error(503, str(exc),
                                                    retry_after=self.config.retry_after_s))
        cfg = self.config
        one_shot = info.session_id is None
        sid = info.session_id if not one_shot else self.engines[0].control.oneshot_id()
        watch = DisconnectWatch(request.receive)
        session: Session | None = None
        control = self.control
        rid, outcome, status, handed_over = "", "error", 503, False
        try:
            for attempt in range(len(self.engines)):
                try:
                    eng, _ = self.engines.place(sid, lambda: info.prompt_tokens)
                except NoEngineError as exc:
                    return self._answer(route, openai_error(
                        503, f"{exc}: every engine behind the sidecar is down",
                        retry_after=cfg.retry_after_s))
                control = eng.control
                try:
                    eng, session = await self.engines.acquire(
                        eng, sid, one_shot=one_shot, last_round=info.last_round,
                        prompt_tokens=lambda: info.prompt_tokens)
                    control = eng.control
                except QueueFull as exc:
                    self.metrics.queue_full.inc()
                    return self._answer(route, openai_error(
                        429, f"{exc}: retry later", retry_after=cfg.retry_after_s))
                except AdmissionTimeout as exc:
                    return self._answer(route, openai_error(
                        503, str(exc), type_="admission_timeout", retry_after=cfg.retry_after_s))
                except SessionClosed as exc:
                    return self._answer(route, openai_error(409, str(exc)))
                rid = self._rid_prefix + str(next(self._rid))
                self.hub.publish(make_event("request_start", session_id=sid, request_id=rid,
                                            round=info.round), "control")
                try:
                    resp = await eng.upstream.open(
                        "POST", route, scope["query_string"],
                        self.engines.headers_for(eng, request_headers(scope["headers"])),
                        info.body)
                except UpstreamUnavailable as exc:
                    self.metrics.upstream_errors.inc()
                    if exc.connect_failed:
                        self.engines.down(eng)
                    if exc.connect_failed and attempt + 1 < len(self.engines) and \
                            self.engines.any_alive():
                        # nothing reached the client: the call leaves this engine, its
                        # session with it, and is placed again
                        control.end(session, "moved")
                        self._request_done(control, session, rid, t0, 503, "error")
                        session = None
                        continue
                    status = 503
                    return self._answer(route, openai_error(503, str(exc),
                                                            retry_after=cfg.retry_after_s))
                break
            try:
                status = resp.status_code
                if is_event_stream(resp):
                    relay = RelayResponse(eng.upstream, resp, partial(
                        self._stream_done, control, session, rid, t0, resp.status_code), watch)
                    # from here on the response owns the watch and the cleanup (exactly once)
                    handed_over = True
                    return self._answer(route, relay)
                content = await eng.upstream.read(resp)
            except UpstreamUnavailable as exc:
                self.metrics.upstream_errors.inc()
                status = 503
                return self._answer(route, openai_error(503, str(exc),
                                                        retry_after=cfg.retry_after_s))
            outcome = "refused" if status in (401, 403) else "ok"
            return self._answer(route, buffered(resp, content))
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            asyncio.current_task().uncancel()
            outcome = "disconnect"
            if session is None:
                self.metrics.disconnects.inc()
            return self._answer(route, Response(status_code=CLIENT_CLOSED))
        finally:
            if not handed_over:
                watch.stop()
                if session is not None:
                    self._request_done(control, session, rid, t0, status, outcome)

    def _stream_done(self, control: ControlPlane, session: Session, rid: str, t0: float,
                     status: int, outcome: str) -> None:
        if outcome == "error":
            self.metrics.upstream_errors.inc()
        self._request_done(control, session, rid, t0, status, outcome)

    async def forward(self, request: Request) -> Response:
        """Anything else (models, health, tokenize, ...): forwarded as is, no admission."""
        scope = request.scope
        route = "other"
        body = await self.read_body(request)
        if isinstance(body, Response):
            return self._answer(route, body)
        watch = DisconnectWatch(request.receive)
        handed_over = False
        upstream = self.engines.first_alive().upstream
        try:
            try:
                resp = await upstream.open(scope["method"], scope["path"],
                                           scope["query_string"],
                                           request_headers(scope["headers"]), body)
                if is_event_stream(resp):
                    handed_over = True
                    return self._answer(route, RelayResponse(upstream, resp, _noop, watch))
                content = await upstream.read(resp)
            except UpstreamUnavailable as exc:
                self.metrics.upstream_errors.inc()
                return self._answer(route, openai_error(
                    503, str(exc), retry_after=self.config.retry_after_s))
            return self._answer(route, buffered(resp, content))
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            asyncio.current_task().uncancel()
            self.metrics.disconnects.inc()
            return self._answer(route, Response(status_code=CLIENT_CLOSED))
        finally:
            if not handed_over:
                watch.stop()

    # ------------------------------------------------------------------ mars endpoints
    async def post_events(self, request: Request) -> Response:
        body = await self.read_body(request)
        if isinstance(body, Response):
            return body
        try:
            events = await self.parser.events(body, now=time.time())
            bad = sorted({e.kind for e in events if e.kind not in POSTABLE_KINDS})
            if bad:
                raise EventError(f"kinds {bad} cannot be posted here (only "
                                 f"{sorted(POSTABLE_KINDS)}); engine and control events "
                                 f"come from the engine and the sidecar")
            leaving = sorted({e.reason for e in events
                              if e.kind == "session_end" and e.reason in LEAVING})
            if leaving:
                raise EventError(f"session_end reasons {leaving} are the sidecar's own (a "
                                 f"session going on at another engine); a client ends a "
                                 f"session with another reason, e.g. 'deleted'")
            if request.scope.get(ACCESS_SCOPE_KEY) is Access.EVENTS and any(
                    e.kind == "session_end" for e in events):
                self.metrics.events_rejected.inc()
                return self._answer("events", openai_error(
                    403, "a tool-runner key (--events-api-key) may post tool events, not "
                         "session_end: ending a session needs an API key"))
        except EventError as exc:
            self.metrics.events_rejected.inc()
            return self._answer("events", openai_error(400, f"rejected events: {exc}"))
        except BodyTooComplex as exc:
            self.metrics.events_rejected.inc()
            return self._answer("events", openai_error(413, f"rejected events: {exc}"))
        except ParserUnavailable as exc:
            return self._answer("events", openai_error(503, str(exc),
                                                       retry_after=self.config.retry_after_s))
        for ev in events:
            d = ev.model_dump()
            if d["kind"] == "session_end":
                self.end_session(d["session_id"], d["reason"])
            else:
                self.hub.publish(d, "tool")
        return self._answer("events", JSONResponse({"accepted": len(events)}))

    def event_stream(self, kinds: list[str] | None, session: str | None,
                     max_events: int | None, timeout: float | None) -> Response:
        sub = self.hub.subscribe(kinds, session)
        keepalive = self.config.sse_keepalive_s

        async def gen():
            yield b": mars unified event stream\n\n"
            sent, idle_since = 0, time.monotonic()
            while max_events is None or sent < max_events:
                wait = keepalive if timeout is None else \
                    min(keepalive, max(0.0, timeout - (time.monotonic() - idle_since)))
                line = await sub.get(wait)
                if line is None:
                    if timeout is not None and time.monotonic() - idle_since >= timeout:
                        return
                    yield b": keepalive\n\n"
                    continue
                idle_since = time.monotonic()
                sent += 1
                yield b"data: " + line + b"\n\n"

        return GuardedStreamingResponse(gen(), partial(self.hub.unsubscribe, sub),
                                        media_type="text/event-stream",
                                        headers={"cache-control": "no-cache"})

    def state(self) -> dict[str, Any]:
        snap = self.control.snapshot()
        up = self.upstream
        snap["upstream"] = {"url": up.base_url, "up": up.up, "failures": up.failures,
                            "last_error": up.last_error, "client": type(up).__name__}
        snap["stream"] = {"published": self.hub.published, "subscribers": self.hub.subscribers,
                          "engine_events": self.config.engine_events or None,
                          "engine_events_received": self.reader.received if self.reader else 0,
                          "events_file": self.config.events_file}
        snap["uptime_s"] = time.time() - self.started_at
        if self.engines.multi:  # the top level is the first engine's; each engine's here
            snap["placement"] = self.engines.placement_view()
        return snap

    def end_session(self, sid: str, reason: str) -> bool:
        eng = self.engines.find_session(sid)
        return eng is not None and eng.control.end_session(sid, reason)

    def sessions_view(self) -> list[dict[str, Any]]:
        if not self.engines.multi:
            return self.control.sessions_view()
        return [{**s, "engine": e.rank} for e in self.engines.engines
                for s in e.control.sessions_view()]

    async def metrics_text(self) -> Response:
        text = self.metrics.render()
        if self.config.merge_upstream_metrics:
            engine = await self.upstream.get_text("/metrics")
            if engine:
                text += b"\n" + engine.encode()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    def _gauges(self) -> dict[str, tuple]:
        """The state gauges; with several engines each engine's, under an ``engine`` label
        (the stream's subscribers are the sidecar's own, unlabelled)."""
        if not self.engines.multi:
            return self._engine_gauges(self.control, self.upstream)
        per = [(str(e.rank), self._engine_gauges(e.control, e.upstream))
               for e in self.engines.engines]
        out: dict[str, tuple] = {}
        for name, spec in per[0][1].items():
            if name in SIDECAR_GAUGES:
                out[name] = spec
            elif len(spec) == 2:
                out[name] = (spec[0], {(rank, ): g[name][1] for rank, g in per}, ("engine",))
            else:
                out[name] = (spec[0], {key + (rank,): v for rank, g in per
                                       for key, v in g[name][1].items()},
                             tuple(spec[2]) + ("engine",))
        return out

    def _engine_gauges(self, control: ControlPlane, upstream) -> dict[str, tuple]:
        snap = control.snapshot()
        s = snap["signals"]
        up = upstream.up
        return {
            "admission_enabled": ("1 if the sidecar gates new sessions", 1 if control.admission else 0),
            "window": ("Raw AIMD window W", snap["window"]),
            "window_budget": ("Admitted sessions allowed: min(W, caps), clamped", snap["budget"]),
            "window_limit": ("1 for what bounds the admitted sessions now (the smallest of the "
                             "AIMD window, the CPU cap and the KV cap), else 0",
                             {(k,): (None if snap["binding"] is None
                                     else int(snap["binding"] == k))
                              for k in ("window", "cpu", "kv")}, ("limit",)),
            "cpu_cap": ("Session cap from CPU pressure (Little's law)", snap["cpu_cap"]),
            "kv_cap": ("Session cap from KV utilisation (soft cap)", snap["kv_cap"]),
            "sessions_active": ("Sessions holding a window slot (window occupancy)", snap["admitted"]),
            "sessions_queued": ("Sessions waiting for admission", snap["queued"]),
            "requests_inflight": ("Requests forwarded and not finished", snap["inflight"]),
            "active_tools": ("Running tool calls of this engine's sessions (CPU plane)",
                             s["active_tools"]),
            "tools_queued": ("Tool calls enqueued by their runner and not started (waiting "
                             "for a core)", s["queued_tools"]),
            "cpu_load": ("Running tools per tool core on the host (every engine's sessions "
                         "with --cpu-budget node)", s["cpu_load"]),
            "tool_duration_ema_seconds": ("EMA of tool durations", s["tool_duration_ema_s"]),
            "tool_slowdown": ("Tool slowdown over the per-type baseline (1 unless significant)",
                              s["tool_slowdown"]),
            "kv_blocks": ("Engine KV blocks (latest snapshot)",
                          {("total",): s["total_blocks"], ("free",): s["free_blocks"],
                           ("used",): s["used_blocks"], ("pinned",): s["pinned_blocks"]},
                          ("state",)),
            "kv_utilisation": ("Engine KV utilisation", s["kv_utilisation"]),
            "engine_requests": ("Engine requests (latest snapshot)",
                                {("running",): s["engine_running"],
                                 ("waiting",): s["engine_waiting"]}, ("state",)),
            "engine_requests_loading": ("Of the waiting engine requests, those whose KV is "
                                        "being loaded from the host tier",
                                        s["engine_loading"]),
            "engine_batch_share": ("Share of the engine's decode step that grows with its "
                                   "batch, as the engine fits it (the batch cost's alpha)",
                                   s["batch_share"]),
            "engine_share": ("With a host tier: the measured fraction of the admitted contexts' "
                             "time with a call in the engine, each context's charge",
                             snap["engine_share"]),
            "preemptions_recent": ("Engine preemptions in the trailing window", s["preemptions"]),
            "upstream_up": ("1 if the last upstream contact succeeded", None if up is None else int(up)),
            "sse_subscribers": ("Open event-stream subscriptions", self.hub.subscribers),
        }


def _noop(_outcome: str) -> None:
    pass


def _authorization(scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


class HotPath:
    """ASGI entry point: the key check for every request, then the generation routes skip
    FastAPI's routing and middleware stack.

    The check comes first so that a request without a valid key never reads a body, never
    creates a session and never waits in (or takes) an admission slot. The generation
    routes take the raw request and need none of FastAPI; on the 2-core machine its stack
    costs about a tenth of the sidecar's per-request budget. Everything else, lifespan
    included, goes to the FastAPI app.
    """

    def __init__(self, app: FastAPI, sidecar: Sidecar) -> None:
        self.app = app
        self.sidecar = sidecar
        self.state = app.state
        cfg = sidecar.config
        self.auth = Authenticator.from_keys(cfg.api_keys, cfg.events_api_keys, cfg.open_metrics)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.auth.enabled:
            access = self.auth.grant(scope["method"], scope["path"], _authorization(scope))
            scope[ACCESS_SCOPE_KEY] = access
        else:
            access = Access.API
        if access is None:
            self.sidecar.metrics.unauthorized.inc()
            response = openai_error(401, "missing or invalid API key (send 'Authorization: "
                                         "Bearer <key>')")
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] in GENERATE_ROUTES \
                and scope["method"] == "POST":
            try:
                response = await self.sidecar.generate(Request(scope, receive))
            except Exception as exc:  # a bug must still produce exactly one response
                log.exception("generate failed")
                response = openai_error(500, f"sidecar internal error: "
                                             f"{type(exc).__name__}: {exc}")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(config: SidecarConfig) -> HotPath:
    """The sidecar as an ASGI app (``.app`` is the FastAPI app, ``.sidecar`` the parts)."""
    sc = Sidecar(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await sc.start()
        try:
            yield
        finally:
            await sc.stop()

    # no /docs or /openapi.json of our own: the engine's are proxied (drop-in for vllm serve)
    app = FastAPI(title="mars sidecar", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.sidecar = sc

    for path in GENERATE_ROUTES:  # served by HotPath; kept for introspection
        app.add_route(path, sc.generate, methods=["POST"])
    app.add_route("/v1/mars/events", sc.post_events, methods=["POST"])

    @app.get("/v1/mars/events/stream")
    async def event_stream(kind: list[str] | None = Query(None),
                           session: str | None = None,
                           max_events: int | None = Query(None, ge=1),
                           timeout: float | None = Query(None, gt=0)) -> Response:
        kinds = [k for item in (kind or []) for k in item.split(",") if k] or None
        return sc.event_stream(kinds, session, max_events, timeout)

    @app.get("/v1/mars/state")
    async def state() -> Response:
        return JSONResponse(sc.state())

    @app.get("/v1/mars/sessions")
    async def sessions() -> Response:
        return JSONResponse({"sessions": sc.sessions_view()})

    @app.delete("/v1/mars/sessions/{session_id:path}")
    async def end_session(session_id: str) -> Response:
        if sc.end_session(session_id, "deleted"):
            return JSONResponse({"session_id": session_id, "ended": True})
        return openai_error(404, f"no session {session_id!r} at the sidecar")

    @app.get("/v1/mars/health")
    async def health() -> Response:
        up = sc.upstream.up if not sc.engines.multi else \
            any(e.upstream.up for e in sc.engines.engines)
        return JSONResponse({"status": "ok", "upstream_up": up,
                             "admission": "on" if sc.control.admission else "off"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return await sc.metrics_text()

    app.add_route("/{path:path}", sc.forward,
                  methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> Response:
        parts = ["{}: {}".format(".".join(str(p) for p in e.get("loc", ())), e.get("msg"))
                 for e in exc.errors()[:5]]
        return openai_error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> Response:
        return openai_error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _crash(_request: Request, exc: Exception) -> Response:
        log.exception("sidecar handler failed")
        return openai_error(500, f"sidecar internal error: {type(exc).__name__}: {exc}")

    return HotPath(app, sc)
