"""The agents of a simulated run: each task of a trace, round by round, in virtual time.

What the served stack does with ``mars replay --virtual-tool-cores N`` against
``mars-vllm serve --emulate GPU:MODEL --policy P``, step for step:

* a task arrives at its trace time (``load``) or when the previous one ended (``isolated``,
  the ideal latency goodput is relative to; other content salt, as the replay does);
* each round goes through the sidecar's admission core (:class:`~mars.sim.control.SimControl`)
  -- a new session may queue, a full queue is the sidecar's 429 -- then into vLLM's engine with
  the replay's exact prompt ids and output length (:class:`~mars.workloads.task_script.TaskScript`);
* between rounds the recorded tool runs on the virtual cores, with the replay's
  ``tool_enqueue`` / ``tool_start`` / ``tool_end`` events;
* results are :class:`~mars.workloads.results.RunResult` (``results.json``) and every event of
  the unified stream (``events.jsonl``), with run-relative times in *virtual* seconds.

Several engines of one model (``--engines N``, vLLM's data parallelism, issue #34): each is its
own emulated GPU with its own control plane (session window, packing room, KV state from its
own events, the host's tool cores shared with the others: ``cpu_budget``), and the
sidecar's placement policy
(:mod:`mars.policy.control.placement`) picks the engine of each session, from what each
engine's events show, as ``mars sidecar --upstream URL1,URL2,...`` does. Each engine then has
a clock of its own, the time its step in flight ends: the loop takes the earliest of the
timeline's next callback and the engines' times, so that a step is computed with everything
before it seen, and what it produced (outputs, events) is delivered at its end; a call that
reaches an engine while its step is in flight joins its next step, as on the card
(conservative discrete-event simulation: engines affect each other only through the sidecar,
which acts on the timeline). One engine runs exactly as before: its clock is the world's.

Liveness is checked, not assumed: a state where tasks wait and nothing runs or is due ends the
run with :class:`SimError`, and so does a KV pool that does not balance at the end.

Past 600 lines on purpose: the task loop, the engines' clocks and the liveness check act on one
timeline, and the order of what happens around a step (deliveries, callbacks, the next step) is
best read in one place. What has a job of its own is apart: the clock (:mod:`.clock`), the
sidecar (:mod:`.control`), the tool cores (:mod:`.tools`), host memory (:mod:`.host`).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from mars.policy.control.placement import (LEAVING, PLACERS, Call, EngineTracker,
                                           SessionRouter, Waiting, make_placer)
from mars.policy.control.pressure import CPU_BUDGETS, NodeTools
from mars.policy.registry import get_policy
from mars.policy.control.admission_core import SessionState
from mars.sim.clock import Timeline, VirtualClock
from mars.sim.control import QueueFull, SimControl, sidecar_config
from mars.sim.host import HostModel
from mars.sim.tools import VirtualCores
from mars.workloads.goodput import DEFAULT_SLACKS
from mars.workloads.prompts import DEFAULT_TOKEN_RANGE, TokenSpace
from mars.workloads.replay import job_id, trace_info
from mars.workloads.results import RoundResult, RunResult, TaskResult
from mars.workloads.task_script import RoundCall, TaskScript
from mars.workloads.trace import Task, Trace

#: the virtual clock's epoch: event times look like Unix times of 2023-11-14
SIM_EPOCH = 1_700_000_000.0


class SimError(RuntimeError):
    """The simulated system broke an invariant (liveness, KV conservation)."""


@dataclass(frozen=True)
class SimConfig:
    gpu: str
    model: str
    policy: str
    #: virtual CPU cores for CPU-bound tools (the sidecar's CPU cap is told the same)
    tool_cores: int = 8
    seed: int = 0
    salt: str = "run"
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE
    slacks: tuple[float, ...] = DEFAULT_SLACKS
    #: more ``mars-vllm serve`` arguments (e.g. ``--max-num-seqs 256``)
    engine_args: tuple[str, ...] = ()
    progress: bool = True
    #: a device profile file (``mars emulate calibrate``): emulate it instead of the shipped
    #: GPU x model (``gpu`` and ``model`` then only label the results)
    profile: str | None = None
    #: the served host's per-round delays and tool overrun (mars.sim.host; default none)
    host: HostModel = HostModel()
    #: engines of the model behind one sidecar (vLLM data parallelism), each an emulated GPU
    engines: int = 1
    #: how the sidecar places sessions on them (mars.policy.control.placement.PLACERS)
    placement: str = "mars"
    #: how their control planes count the host's tool cores
    #: (mars.policy.control.pressure.CPU_BUDGETS)
    cpu_budget: str = "node"
    #: the sidecar's ``--admission-config`` (a JSON object; empty: defaults)
    admission_config: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.engines, int) or self.engines < 1:
            raise ValueError(f"engines must be an integer >= 1, got {self.engines!r}")
        if self.placement not in PLACERS:
            raise ValueError(f"unknown placement {self.placement!r}; choose one of "
                             f"{', '.join(sorted(PLACERS))}")
        if self.cpu_budget not in CPU_BUDGETS:
            raise ValueError(f"unknown cpu budget {self.cpu_budget!r}; choose one of "
                             f"{', '.join(CPU_BUDGETS)}")

    @property
    def emulate(self) -> str:
        """What ``mars-vllm serve --emulate`` is given."""
        return self.profile or f"{self.gpu}:{self.model}"

    @property
    def target(self) -> str:
        """What is emulated, for labels."""
        if self.profile:
            return f"device profile {Path(self.profile).name} ({self.gpu} x {self.model})"
        return f"GPU {self.gpu} x {self.model}"


@dataclass(eq=False)
class _Lane:
    """One engine of the node and what drives it: its own control plane, its own clock (the
    world's with one engine), what its events say for placement."""

    rank: int
    engine: Any  # SimEngine (vLLM imported only when one is built)
    clock: VirtualClock
    tracker: EngineTracker
    control: SimControl | None = None
    #: engine events published before the control plane existed (its scheduler_start)
    early: list[dict[str, Any]] = field(default_factory=list)
    #: holds requests but scheduled nothing at its time: waits until the world moves
    stuck: bool = False


@dataclass(eq=False)
class _TaskRun:
    task: Task
    result: TaskResult
    script: TaskScript
    sid: str
    lane: _Lane | None = None
    call: RoundCall | None = None
    session: SessionState | None = None
    rid: str = ""
    submit: float = 0.0
    forward: float = 0.0
    first: float | None = None
    cached: int | None = None
    generated: list[int] = field(default_factory=list)


class Simulation:
    """One sidecar core per engine, one set of tool cores for the host, ``cfg.engines``
    engines (one unless told): runs traces one after another (the isolated run, then the
    load run, like ``mars replay --ideal auto``)."""

    def __init__(self, cfg: SimConfig, *, events_path: str | Path | None = None) -> None:
        from mars.engine.harness.sim_engine import SimEngine

        self.cfg = cfg
        self.clock = VirtualClock(SIM_EPOCH)
        self.timeline = Timeline()
        self._events_file = None
        self.events_recorded = 0
        n = cfg.engines
        self.multi = n > 1
        self._in_run = False
        self._event_seq = itertools.count()
        #: engine events published ahead of the world, by sequence number (several engines)
        self._undelivered: dict[int, tuple[_Lane, dict[str, Any]]] = {}
        self.lanes: list[_Lane] = []
        for rank in range(n):
            # one engine keeps the world's clock (exactly the single-engine simulator)
            clock = VirtualClock(SIM_EPOCH) if self.multi else self.clock
            lane = _Lane(rank, None, clock, EngineTracker(rank))
            self.lanes.append(lane)
            lane.engine = SimEngine(cfg.emulate, cfg.policy, clock=clock,
                                    sink=partial(self._engine_event, lane),
                                    extra_args=cfg.engine_args)
        self.router = SessionRouter(make_placer(cfg.placement))
        self._events_file = open(events_path, "w", encoding="utf-8") if events_path else None
        sc = sidecar_config(get_policy(cfg.policy).sidecar_admission, cfg.tool_cores,
                            self.lanes[0].engine.block_size,
                            json.loads(cfg.admission_config) if cfg.admission_config else None)
        sc = replace(sc, admission_config=sc.admission_config.per_engine(n, cfg.cpu_budget))
        for lane in self.lanes:
            lane.control = SimControl(
                sc, self.clock, self.timeline, admitted=self._admitted, failed=self._failed,
                record=self._record, running=lambda: self._unfinished > 0,
                engine=lane.rank if self.multi else None,
                on_ended=partial(self._session_ended, lane))
            for ev in lane.early:
                self._deliver(lane, ev)
            lane.early.clear()
        #: the host's tool cores, shared by the control planes (``cpu_budget`` "node")
        self._node: NodeTools | None = None
        if self.multi and cfg.cpu_budget == "node":
            self._node = NodeTools()
            for lane in self.lanes:
                lane.control.core.balance.share_host(self._node)
        #: the first engine and its control plane (the only ones with one engine)
        self.engine, self.control = self.lanes[0].engine, self.lanes[0].control
        self.cores = VirtualCores(cfg.tool_cores, self.timeline)
        self._live: dict[str, _TaskRun] = {}  # engine request id -> its task
        self._queued: dict[str, list[_TaskRun]] = {}  # session id -> rounds waiting for it
        self._unfinished = 0
        #: tools running (light or holding a core) and tasks not yet arrived: with neither,
        #: and no engine step, nothing but the sidecar can move (liveness)
        self._tools_running = 0
        self._arrivals_pending = 0
        #: rounds on the modeled host's way to or from the engine (liveness, like tools)
        self._in_host = 0
        self._on_task_end: Callable[[_TaskRun, float], None] = lambda tr, t: None
        self._t0 = SIM_EPOCH
        self._bar: Any = None
        self._rebind_steps = -1

    # ------------------------------------------------------------------ events
    def _record(self, ev: dict[str, Any]) -> None:
        self.events_recorded += 1
        if self._events_file is not None:
            self._events_file.write(json.dumps(ev, separators=(",", ":")) + "\n")

    def _engine_event(self, lane: _Lane, ev: dict[str, Any]) -> None:
        if lane.control is None:
            lane.early.append(ev)
        elif not self.multi:
            lane.control.publish(ev)
        elif not self._in_run:  # (an engine's shutdown: nothing else happens any more)
            self._deliver(lane, ev)
        else:
            # published during a step computed ahead of the world: seen when it happens
            k = next(self._event_seq)
            self._undelivered[k] = (lane, ev)
            self.timeline.at(max(ev["ts"], self.clock()), lambda t, k=k: self._due(k))

    def _due(self, k: int) -> None:
        got = self._undelivered.pop(k, None)
        if got is not None:
            self._deliver(*got)

    def _flush_events(self) -> None:
        """What engines published ahead of the world when the last task ended: recorded in
        time order, as one engine's events are."""
        for k in sorted(self._undelivered, key=lambda k: (self._undelivered[k][1]["ts"], k)):
            self._due(k)

    def _deliver(self, lane: _Lane, ev: dict[str, Any]) -> None:
        """An engine's event reaches the sidecar: its engine's tracker and control plane."""
        if self.multi:
            ev["engine"] = lane.rank
            lane.tracker.observe(ev)
            if ev.get("kind") == "kv_snapshot":
                self.router.placer.snapshot(lane.rank)
        lane.control.publish(ev)

    # ------------------------------------------------------------------ a run
    def run(self, trace: Trace, mode: str = "load", label: str | None = None,
            ideal: dict[str, float] | None = None) -> RunResult:
        cfg = self.cfg
        salt = cfg.salt if mode == "load" else cfg.salt + "/ideal"
        space = TokenSpace(cfg.seed, cfg.token_range[0], cfg.token_range[1], salt)
        self._t0 = t0 = self.clock()
        wall0 = time.monotonic()
        steps0 = self._steps()
        preempt0 = self._preempted()
        link0 = self._link_totals()
        moves0, switches0 = self.router.moves, self.router.switches
        rebinds0 = self.router.rebinds
        runs = [_TaskRun(t, TaskResult(t.task_id, t.arrival_s if mode == "load" else math.nan,
                                       t.num_rounds),
                         TaskScript(t, space, job_id(t.task_id, mode), self.engine.max_model_len),
                         job_id(t.task_id, mode)) for t in trace.tasks]
        self._unfinished = len(runs)
        self._bar = _progress(cfg.progress, len(runs), label or mode)
        if mode == "load":
            self._on_task_end = lambda tr, t: None
            self._arrivals_pending = len(runs)
            for r in runs:
                self.timeline.at(t0 + r.task.arrival_s, lambda t, r=r: self._start_task(r, t))
        else:
            pending = iter(runs)

            def next_task(_: _TaskRun | None, t: float) -> None:
                r = next(pending, None)
                if r is not None:
                    self.timeline.at(t, lambda tt, r=r: self._start_task(r, tt))

            self._on_task_end = next_task
            next_task(None, t0)
        self._in_run = True
        try:
            self._loop_engines() if self.multi else self._loop()
        finally:
            self._in_run = False
            self._flush_events()
            if self._bar is not None:
                self._bar.close()
        t1 = self.clock()
        for lane in self.lanes:
            ok, acc = lane.engine.kv_balanced()
            if not ok:
                raise SimError(f"KV blocks do not balance after the run"
                               f"{f' on engine {lane.rank}' if self.multi else ''}: {acc}")
        for r in runs:
            if ideal is not None and r.task.task_id in ideal:
                r.result.ideal_s = ideal[r.task.task_id]
        eng = self.engine
        result = RunResult(
            label=label or mode, mode=mode, trace=trace_info(trace),
            server={"url": f"sim://{cfg.gpu}:{cfg.model}", "model": eng.served_model,
                    "root": None, "max_model_len": eng.max_model_len, "sidecar": True,
                    "cache_config": {"block_size": eng.block_size,
                                     "num_gpu_blocks": eng.num_blocks,
                                     "enable_prefix_caching": True},
                    "system_fingerprint": None,
                    "emulated": {"gpu": cfg.gpu, "model": cfg.model, "simulated": True,
                                 "profile": cfg.profile},
                    **({"engines": cfg.engines, "placement": cfg.placement,
                        "cpu_budget": cfg.cpu_budget} if self.multi else {})},
            config={"token_range": list(cfg.token_range), "seed": cfg.seed, "salt": salt,
                    "tool_cores": [], "tool_workers": cfg.tool_cores, "tool_burn": "virtual",
                    "policy": cfg.policy, "engine_args": list(cfg.engine_args),
                    **({"admission_config": json.loads(cfg.admission_config)}
                       if cfg.admission_config else {}),
                    **({"host_model": cfg.host.as_dict()} if cfg.host.active else {}),
                    "slacks": list(cfg.slacks)},
            run={"start_unix": t0, "end_unix": t1, "wall_s": t1 - t0, "interrupted": False,
                 "simulated": True, "sim_wall_s": round(time.monotonic() - wall0, 3),
                 "engine_steps": self._steps() - steps0,
                 "scheduling": "async" if eng.async_scheduling else "sync",
                 **({"session_moves": self.router.moves - moves0,
                     "session_switches": self.router.switches - switches0,
                     "session_rebinds": self.router.rebinds - rebinds0}
                    if self.multi else {}),
                 **({"host_link": _link_delta(link0, self._link_totals())}
                    if link0 is not None else {}),
                 "command": list(sys.argv)},
            tasks=[r.result for r in runs],
            server_metrics={"vllm:num_preemptions_total":
                            float(self._preempted() - preempt0)},
        )
        result.cached_tokens_source = "usage"
        engines = f", {cfg.engines} engines, placement {cfg.placement}" if self.multi else ""
        result.notes.append(
            f"SIMULATED in virtual time: vLLM's engine on the EMULATED {cfg.target} "
            f"(step-time model){engines}; times are virtual seconds")
        return result.finalize(cfg.slacks)

    def _steps(self) -> int:
        return sum(lane.engine.pacer_stats.steps for lane in self.lanes)

    def _link_totals(self) -> dict[str, dict[str, float]] | None:
        """What every engine's host link moved so far (None: no engine offloads)."""
        got = [st for lane in self.lanes if (st := lane.engine.link_stats()) is not None]
        if not got:
            return None
        return {k: {d: sum(st[k][d] for st in got) for d in got[0][k]} for k in got[0]}

    def _preempted(self) -> int:
        return sum(lane.engine.counters()["preempted"] for lane in self.lanes)

    def _loop(self) -> None:
        clock, tl, eng, control = self.clock, self.timeline, self.engine, self.control
        #: since when nothing has run: no engine step, no tool, no arrival to come
        stalled_since: float | None = None
        # a state the sidecar's next steps could still resolve (a session queued this
        # instant is admitted at the next event-kicked or periodic step) is not a stall yet
        grace = 4 * control.sidecar.step_interval_s + 1.0
        while self._unfinished:
            now = clock()
            tl.run_due(now)
            control.settle(now)
            if not self._unfinished:
                break
            if eng.has_work:
                before = eng.progress
                outs = eng.step()
                if outs:
                    self._outputs(outs, clock())
                if eng.progress != before:
                    stalled_since = None
                    continue
                # the engine holds requests but scheduled nothing: only time can help
            wake = _after(now, eng.wake_at() if eng.has_work else None)
            # a KV load in flight is something running: its end lets the engine go on
            stalled_since = None if wake is not None else \
                self._stalled(now, stalled_since, grace)
            self._advance(_earliest(tl.next_due(), wake))

    def _loop_engines(self) -> None:
        """:meth:`_loop` for several engines, each on its own clock (the module docstring)."""
        clock, tl, lanes = self.clock, self.timeline, self.lanes
        stalled_since: float | None = None
        grace = 4 * lanes[0].control.sidecar.step_interval_s + 1.0
        while self._unfinished:
            now = clock()
            if tl.run_due(now):
                for lane in lanes:  # the world moved: what was stuck may go now
                    lane.stuck = False
            for lane in lanes:  # a KV transfer it waited for has landed
                if lane.stuck and (w := lane.engine.wake_at()) is not None and w <= now:
                    lane.stuck = False
            for lane in lanes:
                lane.control.settle(now)
            self._rebind(now)
            if not self._unfinished:
                break
            ready = [lane for lane in lanes if not lane.stuck and lane.engine.has_work]
            wake = _earliest(*(_after(now, ln.engine.wake_at()) for ln in lanes
                               if ln.stuck and ln.engine.has_work))
            nxt = _earliest(tl.next_due(), wake)
            if ready:
                # an idle engine's clock lags the world's: it starts when the world is there
                lane = min(ready, key=lambda ln: (max(ln.clock(), now), ln.rank))
                at = max(lane.clock(), now)
                if nxt is None or at < nxt:  # (a tie: the timeline's callbacks first)
                    clock.advance_to(at)
                    lane.clock.advance_to(at)
                    before = lane.engine.progress
                    outs = lane.engine.step()
                    if outs:
                        tl.at(lane.clock(), lambda t, outs=outs: self._outputs(outs, t))
                    if lane.engine.progress != before:
                        stalled_since = None
                    else:
                        # it holds requests but scheduled nothing: only the world can help
                        # (whatever the timeline runs next makes it try again)
                        lane.stuck = True
                    continue
            if wake is not None or any(ln.engine.has_work and ln.clock() > now
                                       for ln in lanes):
                stalled_since = None  # a step, or a KV transfer, is in flight
            else:
                stalled_since = self._stalled(now, stalled_since, grace)
            self._advance(nxt)

    def _stalled(self, now: float, since: float | None, grace: float) -> float | None:
        """Since when nothing has run (no engine step, no tool, no arrival or host delay to
        come), or None; a stall longer than ``grace`` is a liveness failure."""
        if self._tools_running or self._arrivals_pending or self._in_host:
            return None
        if since is None:
            return now
        if now - since > grace:
            raise self._stall(f"nothing has run for {now - since:.1f} s")
        return since

    def _advance(self, nxt: float | None) -> None:
        if nxt is None:
            raise self._stall("nothing is due")
        self.clock.advance_to(nxt)

    def _stall(self, what: str) -> SimError:
        queued = sum(lane.control.core.queued for lane in self.lanes)
        admitted = sum(lane.control.core.in_use for lane in self.lanes)
        engines = "; ".join(
            f"{f'engine {ln.rank} ' if self.multi else 'the engine '}"
            f"{'holds requests it does not schedule' if ln.engine.has_work else 'is idle'} "
            f"(running {len(ln.engine.scheduler.running)}, waiting "
            f"{len(ln.engine.scheduler.waiting)})" for ln in self.lanes)
        return SimError(
            f"liveness: {self._unfinished} tasks unfinished, {what}: {engines}; no tool "
            f"runs, no task is still to arrive (sessions queued: {queued}, admitted: "
            f"{admitted})")

    # ------------------------------------------------------------------ tasks
    def _start_task(self, r: _TaskRun, t: float) -> None:
        if self._arrivals_pending:  # load mode: one fewer arrival to come
            self._arrivals_pending -= 1
        tr = r.result
        tr.status = "running"
        tr.start_s = t - self._t0
        if math.isnan(tr.arrival_s):
            tr.arrival_s = tr.start_s
        reason = r.script.skip_reason()
        if reason is not None:
            tr.status, tr.error = "skipped", reason
            self._task_done(r, t)
            return
        self._submit(r, t)

    def _task_done(self, r: _TaskRun, t: float) -> None:
        tr = r.result
        if tr.rounds and tr.status in ("completed", "truncated"):
            tr.finish_s = tr.rounds[-1].end_s
        if tr.status in ("truncated", "error") and r.lane is not None:
            # the replay tells the sidecar the session is over (it never sent last_round)
            r.lane.control.end_session(r.sid, {"truncated": "deleted"}.get(tr.status, "error"),
                                       t)
        if self.multi:
            self.router.end(r.sid)
            for lane in self.lanes:
                lane.tracker.forget(r.sid)
        self._unfinished -= 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"virtual {t - self._t0:,.0f}s", refresh=False)
        self._on_task_end(r, t)

    def _fail(self, r: _TaskRun, msg: str, t: float) -> None:
        r.result.status = "error"
        r.result.error = f"round {len(r.result.rounds)}: {msg}"
        self._task_done(r, t)

    def _submit(self, r: _TaskRun, t: float) -> None:
        r.call = call = r.script.call()
        r.submit, r.first, r.cached, r.generated = t, None, None, []
        r.lane = lane = self._place(r, len(call.prompt), t)
        try:
            s = lane.control.arrive(r.sid, t, len(call.prompt))
        except QueueFull as exc:
            self._fail(r, f"HTTP 429: {exc}: retry later", t)
            return
        r.session = s
        if s.is_admitted:
            self._forward(r, t)
        else:
            self._queued.setdefault(s.id, []).append(r)

    def _place(self, r: _TaskRun, prompt_tokens: int, t: float) -> _Lane:
        """The engine of the session's call: the sidecar's placement (EngineSet.place)."""
        if not self.multi:
            return self.lanes[0]
        router, lanes = self.router, self.lanes
        known = router.engine_of(r.sid)
        if known is not None and router.placer.sticky:
            return lanes[known]
        call = Call(r.sid, prompt_tokens, {ln.rank: ln.tracker.cached_tokens(r.sid)
                                           for ln in lanes})
        d = router.route(call, [ln.tracker.load_with(
            ln.control.core.load_view(t), sessions=router.sessions_on(ln.rank)) for ln in lanes])
        if known is not None and known != d.rank:
            # a per-call placer sent the session away from its cached context: it leaves
            # that engine (between its calls, so it holds nothing in flight there)
            lanes[known].control.end_session(r.sid, "switched", t)
            lanes[known].tracker.forget(r.sid)
        return lanes[d.rank]

    def _rebind(self, now: float) -> None:
        """Queued sessions move to an engine that would admit them now (MARS placement's
        late binding, as the served EngineSet._rebind), after the control steps that could
        have changed who admits what."""
        lanes = self.lanes
        if not self.router.placer.rebinds_queued:
            return
        steps = sum(ln.control.core.steps for ln in lanes)
        if steps == self._rebind_steps:
            return
        self._rebind_steps = steps
        waiting = [Waiting(qs.session_id, ln.rank, qs.enqueued_at, qs.prompt_tokens,
                           qs.est_blocks)
                   for ln in lanes for qs in ln.control.core.queued_sessions()]
        if not waiting or not any(ln.control.core.would_admit(0, now) for ln in lanes):
            return
        loads = [ln.tracker.load_with(ln.control.core.load_view(now),
                                      sessions=self.router.sessions_on(ln.rank))
                 for ln in lanes]
        for mv in self.router.rebind(
                waiting, loads, lambda rank, blocks: lanes[rank].control.core.would_admit(
                    blocks, now)):
            src, dst = lanes[mv.source], lanes[mv.target]
            got = src.control.core.transfer_out(mv.session_id, now)
            if got is None:  # (cannot happen: it was queued there a moment ago)
                raise SimError(f"rebind: {mv.session_id} was not queued at engine {src.rank}")
            dst.control.take_queued(*got, now)
            self.router.rebound(mv.session_id, dst.rank)
            for r in self._queued.get(mv.session_id, []):
                r.lane = dst
            dst.control.settle(now)

    def _session_ended(self, lane: _Lane, sid: str, reason: str) -> None:
        """A session ended on ``lane`` (its last round, a deletion, idle reaping): forget
        where it was, unless it is leaving for another engine (as the served EngineSet)."""
        if not self.multi:
            return
        lane.tracker.forget(sid)
        if reason not in LEAVING and self.router.engine_of(sid) == lane.rank:
            self.router.end(sid)

    def _admitted(self, s: SessionState, now: float) -> None:
        for r in self._queued.pop(s.id, []):
            self._forward(r, now)

    def _failed(self, s: SessionState, reason: str, now: float) -> None:
        for r in self._queued.pop(s.id, []):
            self._fail(r, f"HTTP 503: {reason}", now)

    def _forward(self, r: _TaskRun, t: float) -> None:
        call = r.call
        assert call is not None and r.session is not None
        r.forward = t
        r.rid = f"{r.sid}.r{call.index}"
        ctl = r.lane.control
        ctl.forward(r.session, t, call.last)
        ctl.emit("request_start", session_id=r.sid, ts=t, request_id=r.rid, round=call.index)
        self._live[r.rid] = r
        delay = self.cfg.host.request_s
        if delay > 0:
            self._in_host += 1

            def arrive(_: float, r: _TaskRun = r) -> None:
                self._in_host -= 1
                self._add(r)
            self.timeline.at(t + delay, arrive)
        else:
            self._add(r)

    def _add(self, r: _TaskRun) -> None:
        """The call reaches its engine (an idle engine's clock comes up to the world's)."""
        lane, call = r.lane, r.call
        lane.clock.advance_to(self.clock())
        lane.engine.add(r.rid, call.prompt, call.output_tokens, call.meta.to_extra_args())

    def _outputs(self, outs, now: float) -> None:
        live = self._live
        back = self.cfg.host.response_s  # the client has a token this much later
        for o in outs:
            r = live.get(o.request_id)
            if r is None:
                continue
            if r.first is None and o.new_token_ids:
                r.first = now + back
            if o.cached_tokens is not None:
                r.cached = o.cached_tokens
            r.generated.extend(o.new_token_ids)
            if o.finished:
                del live[o.request_id]
                if back > 0:
                    self._in_host += 1

                    def received(t: float, r: _TaskRun = r) -> None:
                        self._in_host -= 1
                        self._round_done(r, t)
                    self.timeline.at(now + back, received)
                else:
                    self._round_done(r, now)

    def _round_done(self, r: _TaskRun, now: float) -> None:
        call, t0 = r.call, self._t0
        assert call is not None and r.session is not None
        rr = RoundResult(
            index=call.index, prompt_tokens=len(call.prompt), output_tokens=len(r.generated),
            planned_output_tokens=call.output_tokens, submit_s=r.submit - t0,
            first_token_s=None if r.first is None else r.first - t0, end_s=now - t0,
            cached_tokens=r.cached, request_id=r.rid)
        r.result.rounds.append(rr)
        # the sidecar times a call from its receipt, admission wait included
        ctl = r.lane.control
        ctl.emit("request_end", session_id=r.sid, ts=now, request_id=r.rid,
                 status=200, duration_s=now - r.submit)
        ctl.finish(r.session, "ok", now)
        if call.last:
            r.result.status = "completed"
            self._task_done(r, now)
            return
        reason = r.script.after(r.generated)
        if reason is not None:
            r.result.status, r.result.error = "truncated", reason
            self._task_done(r, now)
            return
        self._tool(r, call, rr, now)

    def _tool(self, r: _TaskRun, call: RoundCall, rr: RoundResult, now: float) -> None:
        rnd, ctl, t0 = call.round, r.lane.control, self._t0
        tool, call_id = rnd.tool, f"{r.sid}.r{call.index}"
        rr.tool, rr.tool_cpu_bound, rr.tool_duration_s = tool, rnd.cpu_bound, rnd.tool_duration_s
        rr.tool_enqueue_s = now - t0
        ctl.emit("tool_enqueue", session_id=r.sid, ts=now, tool=tool, round=call.index,
                 call_id=call_id)

        self._tools_running += 1

        def started(t: float) -> None:
            rr.tool_start_s = t - t0
            ctl.emit("tool_start", session_id=r.sid, ts=t, tool=tool, round=call.index,
                     call_id=call_id, cpu_bound=rnd.cpu_bound)
            self._host_changed(r.lane)

        def ended(t: float) -> None:
            self._tools_running -= 1
            rr.tool_end_s = t - t0
            ctl.emit("tool_end", session_id=r.sid, ts=t, tool=tool, round=call.index,
                     call_id=call_id, status="ok", duration_s=t - run.start)
            self._host_changed(r.lane)
            self._submit(r, t)

        # a busy host runs tools late (mars.sim.host); the planned duration is what is recorded
        took = (rnd.tool_duration_s or 0.0) * (1.0 + self.cfg.host.tool_overrun)
        run = self.cores.submit(now, took, rnd.cpu_bound, started, ended)

    def _host_changed(self, lane: _Lane) -> None:
        """A tool of ``lane``'s sessions started or ended: with the host's cores shared the
        other engines' control planes step on it too, as the served sidecar's do."""
        if self._node is not None:
            for other in self.lanes:
                if other is not lane and other.control is not None:
                    other.control.kick()

    def close(self) -> None:
        # the engines shut down together, after everything any of them did (their last
        # events are stamped then)
        end = max([self.clock()] + [lane.clock() for lane in self.lanes])
        for lane in self.lanes:
            lane.clock.advance_to(end)
        try:
            for lane in self.lanes:
                lane.engine.close()
        finally:
            if self._events_file is not None:
                self._events_file.close()


def _link_delta(a: dict, b: dict) -> dict[str, float]:
    """One run's transfers on the host link: GPU -> host ("store") and back ("load")."""
    return {f"{k}_{d}": round(b[k][d] - a[k][d], 6) for k in b for d in b[k]}


def _after(now: float, t: float | None) -> float | None:
    """``t`` if it is still to come."""
    return t if t is not None and t > now else None


def _earliest(*ts: float | None) -> float | None:
    got = [t for t in ts if t is not None]
    return min(got) if got else None


def _progress(enabled: bool, total: int, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="task", dynamic_ncols=True, file=sys.stderr,
                mininterval=0.5)
