"""Replay an agent trace against an OpenAI-compatible server and measure it.

Each task of a :class:`~mars.workloads.trace.Trace` becomes an agent session: at its arrival
time it sends round 0; each round is one streamed ``/v1/completions`` call with an exact
token-id prompt (:mod:`mars.workloads.prompts`) and exactly ``output_tokens`` generated
(``max_tokens`` = ``min_tokens``, ``ignore_eos``), tagged with the session metadata the
engine and sidecar schedule by (``vllm_xargs``: ``job_id``, ``round``, ``last_round``,
``next_tool``, ``prev_tool``). Between rounds the recorded tool runs on the host
(:mod:`mars.workloads.toolpool`): CPU-bound kinds burn a pinned tool core and queue for one,
light kinds sleep. Round ``k+1``'s prompt is round ``k``'s prompt + the ids round ``k``
actually generated + its observation/template filler.

Two modes share this code:

* ``load``: tasks arrive as the trace says (open loop, Poisson in generated traces) and run
  concurrently: the measured run.
* ``isolated``: one task at a time, back to back, ignoring arrivals: the paper's ideal
  latency (max concurrency one) that goodput's dynamic SLO is relative to. Its task-specific
  content uses a different salt, so it never warms the measured run's prefix cache.

A task whose next prompt + output would exceed the server's ``max_model_len`` stops after
its last round that fits (status ``truncated``), as the generator cuts tasks; that is
deterministic, so the isolated run stops at the same round. Ctrl-C (:meth:`ReplaySession.stop`)
cancels in-flight calls and tools; the run still returns every task's state
(``interrupted`` / ``not_started``) so partial results are written.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mars.workloads.goodput import DEFAULT_SLACKS

from .eventlink import EventPoster, StreamRecorder, read_events, slice_events_file
from .httpclient import (
    CallError,
    ReplayError,
    ServerInfo,
    completion_body,
    fetch_metrics_text,
    metrics_delta,
    parse_metrics,
    probe_server,
    stream_completion,
)
from .prompts import DEFAULT_TOKEN_RANGE, TokenSpace
from .results import RoundResult, RunResult, TaskResult
from .task_script import TaskScript
from .toolpool import ToolPool, ToolTiming
from .trace import Round, Task, Trace, dumps_trace

MODES = ("load", "isolated")


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay (everything but the trace)."""

    url: str
    #: served model name; None = the first one ``/v1/models`` lists
    model: str | None = None
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE
    #: content seed (shared prefix, task context, filler ids)
    seed: int = 0
    #: separates task-specific content of runs sharing a server; the isolated run appends "/ideal"
    salt: str = "run"
    tool_cores: tuple[int, ...] | None = None
    tool_workers: int | None = None
    tool_burn: str = "cpu"
    request_timeout_s: float = 3600.0
    #: the engine's JSONL event file (``mars-vllm serve --mars-events-file``), if local
    events_file: str | None = None
    progress: bool = True
    slacks: tuple[float, ...] = DEFAULT_SLACKS
    #: bearer key for the server (``--api-key`` of mars-vllm serve / the sidecar)
    api_key: str | None = field(default=None, repr=False)
    #: key for posting tool events; None = ``api_key``
    events_api_key: str | None = field(default=None, repr=False)


def auth_header(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


@dataclass
class _Counters:
    active: int = 0
    inflight: int = 0
    rounds: int = 0
    finished: int = 0


@dataclass
class _RunState:
    trace: Trace
    mode: str
    space: TokenSpace
    t0: float
    t0_unix: float
    results: list[TaskResult]
    counters: _Counters = field(default_factory=_Counters)
    fingerprint: str | None = None
    bar: Any = None


class ReplaySession:
    """One client, one tool pool and one server probe, shared by the runs of an invocation
    (typically the isolated run for ideal times, then the load run)."""

    def __init__(self, cfg: ReplayConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        """``transport``: an httpx transport to use instead of the network (tests)."""
        self.cfg = cfg
        self._transport = transport
        self.url = cfg.url.rstrip("/")
        self.client: httpx.AsyncClient | None = None
        self.server: ServerInfo | None = None
        self.pool: ToolPool | None = None
        self.poster: EventPoster | None = None
        self.stopping = False
        self._active: list[asyncio.Task] = []
        self.nonce = uuid.uuid4().hex[:8]

    async def __aenter__(self) -> "ReplaySession":
        self.client = httpx.AsyncClient(
            transport=self._transport, headers=auth_header(self.cfg.api_key),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        try:
            self.server = await probe_server(
                self.client, self.url, self.cfg.model,
                auth_header(self.cfg.events_api_key or self.cfg.api_key))
            try:
                self.pool = ToolPool(list(self.cfg.tool_cores) if self.cfg.tool_cores else None,
                                     self.cfg.tool_workers, self.cfg.tool_burn)
            except ValueError as e:
                raise ReplayError(str(e)) from None
            await self.pool.__aenter__()
            if self.server.sidecar:
                self.poster = EventPoster(
                    self.client, self.url,
                    headers=auth_header(self.cfg.events_api_key or self.cfg.api_key),
                    session_headers=auth_header(self.cfg.api_key)).start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.poster is not None:
            await self.poster.close()
        if self.pool is not None:
            self.pool.close()
        if self.client is not None:
            await self.client.aclose()

    def stop(self) -> None:
        """Cancel every in-flight task (Ctrl-C); the running :meth:`run` returns normally."""
        self.stopping = True
        for t in self._active:
            t.cancel()

    # --------------------------------------------------------------------------- one run

    async def run(self, trace: Trace, mode: str = "load", label: str | None = None,
                  events_path: str | Path | None = None,
                  ideal: dict[str, float] | None = None) -> RunResult:
        """Replay ``trace`` once and return its (finalized) results.

        ``events_path``: where to record the run's events (sidecar SSE, or the slice of
        ``cfg.events_file`` covering the run); ``ideal``: ``task_id -> seconds`` for goodput.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
        assert self.client is not None and self.server is not None and self.pool is not None
        cfg = self.cfg
        salt = cfg.salt if mode == "load" else cfg.salt + "/ideal"
        space = TokenSpace(cfg.seed, cfg.token_range[0], cfg.token_range[1], salt)
        before = await self._metrics()
        recorder = None
        if events_path is not None and self.server.sidecar:
            recorder = StreamRecorder(self.client, self.url, events_path).start()
        st = _RunState(trace=trace, mode=mode, space=space, t0=time.monotonic(),
                       t0_unix=time.time(), results=[
                           TaskResult(t.task_id, t.arrival_s if mode == "load" else math.nan,
                                      t.num_rounds) for t in trace.tasks])
        st.bar = _progress(cfg.progress, len(trace), label or mode)
        try:
            if mode == "load" and not self.stopping:  # (stopped before it began: nothing runs)
                self._active = [asyncio.create_task(self._task(st, t, r, wait=True))
                                for t, r in zip(trace.tasks, st.results)]
                await asyncio.gather(*self._active, return_exceptions=True)
            elif mode != "load":
                for t, r in zip(trace.tasks, st.results):
                    if self.stopping:
                        break
                    self._active = [asyncio.create_task(self._task(st, t, r, wait=False))]
                    await asyncio.gather(*self._active, return_exceptions=True)
        finally:
            self._active = []
            if st.bar is not None:
                st.bar.close()
        t1 = time.monotonic()
        t1_unix = st.t0_unix + (t1 - st.t0)
        after = await self._metrics()
        for r in st.results:
            if r.status == "not_started" and mode == "isolated":
                r.arrival_s = 0.0
            if ideal is not None and r.task_id in ideal:
                r.ideal_s = ideal[r.task_id]
        result = RunResult(
            label=label or mode, mode=mode,
            trace=trace_info(trace),
            server={"url": self.url, "model": self.server.model, "root": self.server.root,
                    "max_model_len": self.server.max_model_len, "sidecar": self.server.sidecar,
                    "cache_config": dict(self.server.cache_config),
                    "system_fingerprint": st.fingerprint},
            config=self._config_info(salt),
            run={"start_unix": st.t0_unix, "end_unix": t1_unix, "wall_s": t1 - st.t0,
                 "interrupted": self.stopping, "nonce": self.nonce,
                 "command": list(sys.argv)},
            tasks=st.results,
            server_metrics=metrics_delta(before, after),
        )
        if recorder is not None:
            await asyncio.sleep(0.5)  # let the last engine events through the sidecar
            await recorder.close()
            if recorder.error:
                result.notes.append(f"sidecar event stream: {recorder.error}")
            else:
                result.files["events"] = str(events_path)
        if "events" not in result.files and events_path is not None and cfg.events_file:
            await asyncio.sleep(0.5)  # the engine flushes its events file from a thread
            n = slice_events_file(cfg.events_file, events_path, st.t0_unix - 1.0, t1_unix + 1.0)
            result.files["events"] = str(events_path)
            result.notes.append(f"events.jsonl: {n} engine events from {cfg.events_file}")
        self._fill_cached(result)
        if self.poster is not None:
            result.notes.append(f"tool events posted to the sidecar so far in this invocation: "
                                f"{self.poster.posted} ({self.poster.failed} failed)")
        short = sum(1 for t in result.tasks for r in t.rounds
                    if r.output_tokens != r.planned_output_tokens)
        if short:
            result.notes.append(f"{short} rounds generated a different number of tokens than "
                                "asked: the server ignores min_tokens/ignore_eos")
        if result.server_metrics is not None:
            result.notes.append("server_metrics are /metrics deltas over the run: they include "
                                "any other client's requests in that time")
        return result.finalize(cfg.slacks)

    async def _metrics(self) -> dict[str, float] | None:
        assert self.client is not None
        text = await fetch_metrics_text(self.client, self.url)
        return parse_metrics(text) if text else None

    def _config_info(self, salt: str) -> dict[str, Any]:
        cfg = self.cfg
        assert self.pool is not None
        return {"token_range": list(cfg.token_range), "seed": cfg.seed, "salt": salt,
                "tool_cores": list(self.pool.cores), "tool_workers": self.pool.workers,
                "tool_burn": cfg.tool_burn, "request_timeout_s": cfg.request_timeout_s,
                "events_file": cfg.events_file, "slacks": list(cfg.slacks)}

    # -------------------------------------------------------------------------- one task

    async def _task(self, st: _RunState, task: Task, tr: TaskResult, wait: bool) -> None:
        c = st.counters
        try:
            if wait:
                delay = st.t0 + task.arrival_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            tr.status = "running"
            tr.start_s = time.monotonic() - st.t0
            if not wait:
                tr.arrival_s = tr.start_s
            c.active += 1
            try:
                await self._rounds(st, task, tr)
            finally:
                c.active -= 1
            if tr.rounds and tr.status in ("completed", "truncated"):
                tr.finish_s = tr.rounds[-1].end_s
        except CallError as e:
            tr.status = "error"
            tr.error = f"round {len(tr.rounds)}: {e}"
        except asyncio.CancelledError:
            if tr.status == "running":
                tr.status = "interrupted"
            raise
        except Exception as e:  # a bug or a broken tool pool: fail the task, keep the run
            tr.status = "error"
            tr.error = f"round {len(tr.rounds)}: {type(e).__name__}: {e}"
        finally:
            if self.poster is not None and tr.status in ("truncated", "error", "interrupted"):
                # the session never sent last_round: tell the sidecar it is over
                reason = {"truncated": "deleted", "error": "error"}.get(tr.status, "disconnect")
                self.poster.emit("session_end", session_id=job_id(task.task_id, st.mode),
                                 ts=time.time(), reason=reason)
            c.finished += 1
            if st.bar is not None:
                st.bar.update(1)
                self._postfix(st)

    async def _rounds(self, st: _RunState, task: Task, tr: TaskResult) -> None:
        assert self.server is not None and self.client is not None
        job = job_id(task.task_id, st.mode)
        script = TaskScript(task, st.space, job, self.server.max_model_len)
        skip = script.skip_reason()
        if skip is not None:
            tr.status, tr.error = "skipped", skip
            return
        while True:
            call = script.call()
            k, prompt, rnd = call.index, call.prompt, call.round
            rid = f"{job}.r{k}.{self.nonce}"
            body = completion_body(self.server.model, prompt, call.output_tokens,
                                   call.meta.to_extra_args(), rid)
            st.counters.inflight += 1
            try:
                res = await stream_completion(self.client, self.url, body, self.cfg.request_timeout_s)
            finally:
                st.counters.inflight -= 1
            st.fingerprint = st.fingerprint or res.system_fingerprint
            rr = RoundResult(
                index=k, prompt_tokens=len(prompt), output_tokens=len(res.token_ids),
                planned_output_tokens=call.output_tokens, submit_s=res.submit - st.t0,
                first_token_s=None if res.first_token is None else res.first_token - st.t0,
                end_s=res.end - st.t0, cached_tokens=res.cached_tokens,
                request_id=res.response_id or rid)
            tr.rounds.append(rr)
            st.counters.rounds += 1
            self._postfix(st)
            if res.prompt_tokens is not None and res.prompt_tokens != len(prompt):
                raise CallError(f"the server counted {res.prompt_tokens} prompt tokens for a "
                                f"{len(prompt)}-token prompt (token-id prompts not honoured?)")
            if call.last:
                tr.status = "completed"
                return
            cut = script.after(res.token_ids)
            if cut is not None:
                # stop after the last round that fits, without its tool (as the generator cuts)
                tr.status, tr.error = "truncated", cut
                return
            timing = await self._tool(st, job, k, rnd)
            rr.tool, rr.tool_cpu_bound, rr.tool_duration_s = rnd.tool, rnd.cpu_bound, rnd.tool_duration_s
            rr.tool_enqueue_s = timing.enqueue - st.t0
            rr.tool_start_s = timing.start - st.t0
            rr.tool_end_s = timing.end - st.t0

    async def _tool(self, st: _RunState, job: str, k: int, rnd: Round) -> ToolTiming:
        """Run round ``k``'s tool; post its CPU-plane events when a sidecar listens."""
        assert self.pool is not None and rnd.tool is not None
        poster, tool, call_id = self.poster, rnd.tool, f"{job}.r{k}"

        def unix(mono: float) -> float:
            return st.t0_unix + (mono - st.t0)

        began: list[float] = []

        def started(mono: float) -> None:
            began.append(mono)
            if poster is not None:
                poster.emit("tool_start", session_id=job, ts=unix(mono), tool=tool, round=k,
                            call_id=call_id, cpu_bound=rnd.cpu_bound)
            self._postfix(st)

        if poster is not None:
            poster.emit("tool_enqueue", session_id=job, ts=time.time(), tool=tool, round=k,
                        call_id=call_id)
        status, ran = "interrupted", 0.0
        try:
            timing = await self.pool.run(rnd.tool_duration_s, rnd.cpu_bound, on_start=started)
            status, ran = ("ok" if timing.completed else "interrupted"), timing.run_s
            return timing
        finally:
            if poster is not None:
                now = time.monotonic()
                if status == "interrupted" and began:
                    ran = now - began[0]
                poster.emit("tool_end", session_id=job, ts=unix(now), tool=tool, round=k,
                            call_id=call_id, status=status, duration_s=max(0.0, ran))

    # ----------------------------------------------------------------------- bookkeeping

    def _postfix(self, st: _RunState) -> None:
        if st.bar is None:
            return
        c, p = st.counters, self.pool
        st.bar.set_postfix_str(
            f"active={c.active} llm={c.inflight} rounds={c.rounds} "
            f"tools={p.running if p else 0}+{p.waiting if p else 0}q", refresh=False)

    def _fill_cached(self, result: RunResult) -> None:
        """Cached tokens: from usage details when the server sent them, else from the
        engine's ``gpu_1st_token`` events (matched by request id, then by session+round)."""
        rounds = [r for t in result.tasks for r in t.rounds]
        if any(r.cached_tokens is not None for r in rounds):
            result.cached_tokens_source = "usage"
            return
        path = result.files.get("events")
        evs = [e for e in read_events(path) if e.get("kind") == "gpu_1st_token"] if path else []
        if not evs:
            result.notes.append(
                "cached tokens unknown: the server does not report usage.prompt_tokens_details "
                "(start vLLM with --enable-prompt-tokens-details) and no engine events were "
                "available (--events-file or the sidecar's stream)")
            return
        by_rid: dict[str, int] = {}
        by_round: dict[tuple[str, int], int] = {}
        for e in evs:
            rid = str(e.get("request_id") or "")
            # engine ids are "<response id>-<choice>-<8 hex>"
            base = rid.rsplit("-", 2)[0] if rid.count("-") >= 2 else rid
            by_rid[base] = int(e.get("cached_tokens") or 0)
            if e.get("session_id") is not None and e.get("round") is not None:
                by_round[(str(e["session_id"]), int(e["round"]))] = int(e.get("cached_tokens") or 0)
        hit = 0
        for t in result.tasks:
            for r in t.rounds:
                v = by_rid.get(r.request_id or "")
                if v is None:
                    v = by_round.get((job_id(t.task_id, result.mode), r.index))
                if v is not None:
                    r.cached_tokens = v
                    hit += 1
        if hit:
            result.cached_tokens_source = "events"
            result.notes.append(f"cached tokens from engine gpu_1st_token events ({hit}/"
                                f"{len(rounds)} rounds matched): the server did not report "
                                "usage.prompt_tokens_details")
        else:
            result.notes.append("cached tokens unknown: no engine event matched a round")


def job_id(task_id: str, mode: str) -> str:
    """The session id a task runs under: the task id, suffixed in the isolated run so that
    the server never mistakes an ideal-run session for the measured run's."""
    return task_id if mode == "load" else f"{task_id}@ideal"


def trace_info(trace: Trace) -> dict[str, Any]:
    """The ``trace`` block of ``results.json`` (also the simulator's)."""
    from .ideal import trace_digest

    h = trace.header
    return {"regime": h.regime, "num_tasks": len(trace), "seed": h.seed,
            "params": dict(h.params), "sha256": trace_digest(dumps_trace(trace)),
            "rounds": sum(t.num_rounds for t in trace)}


def _progress(enabled: bool, total: int, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="task", dynamic_ncols=True, file=sys.stderr,
                mininterval=0.5)
