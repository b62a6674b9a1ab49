"""What a run's latency is made of, for comparing a real served run with ``mars sim``.

The simulator models the engine (vLLM's scheduler and KV manager on a step-time model), the
admission core and tools that take exactly their duration. A real run of the served stack
also pays its *host*: the HTTP path, the API server and the sidecar around each call, and
tools that overrun their planned time when the host's CPUs are busy (on a 2-core machine,
vLLM's CPU engine busy-polls both). Those are measured here from the run's own records --
the client's timestamps of each round (``results.json``) and the engine's of the same call
(``events.jsonl``) -- so a fidelity check can compare the engine with the engine and say how
much of the rest is the host. The same measure applies to a simulated run, where the part of
a round outside its engine call is only the wait for the step in progress to end (a request
joins the scheduler between steps, in both): subtracting it on both sides keeps the
comparison symmetric (with a host model, :mod:`mars.sim.host`, the simulated rounds carry its
delays too). Nothing here reads wall time or imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mars.workloads.results import RunResult


def engine_spans(events: Iterable[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """When each request was in the engine: ``gpu_submit`` (the scheduler took it) to
    ``gpu_end``, by the engine's request id."""
    start: dict[str, float] = {}
    out: dict[str, tuple[float, float]] = {}
    for e in events:
        kind, rid = e.get("kind"), e.get("request_id")
        if kind == "gpu_submit":
            start[rid] = e["ts"]
        elif kind == "gpu_end" and rid in start:
            out[rid] = (start.pop(rid), e["ts"])
    return out


def engine_calls(events: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Seconds each request spent in the engine, by the engine's request id."""
    return {rid: b - a for rid, (a, b) in engine_spans(events).items()}


def engine_call_seconds(events: Iterable[dict[str, Any]]) -> float:
    """The engine's own time over every call, summed (what ``mars sim`` models). Time two
    calls share counts for both, so the sum also depends on how calls happened to overlap
    (a long prefill landing in another call's decode is counted into both), which the
    host's timing decides in a real run: see :func:`solo_calls`."""
    return sum(engine_calls(events).values())


def engine_busy_seconds(events: Iterable[dict[str, Any]]) -> float:
    """Seconds in which the engine had at least one call in hand (the union of the calls'
    spans): time two calls share counts once."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(engine_spans(events).values()):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def round_spans(results: RunResult,
                events: Iterable[dict[str, Any]]) -> dict[tuple[str, int], tuple[float, float]]:
    """Each round's engine span, keyed by (task, round index): the key a real run and a
    simulated run of the same trace share (their request ids differ)."""
    spans = by_client_id(engine_spans(events))
    out: dict[tuple[str, int], tuple[float, float]] = {}
    for task in results.tasks:
        for i, r in enumerate(task.rounds):
            sp = spans.get(r.request_id) if r.request_id else None
            if sp is not None:
                out[(task.task_id, i)] = sp
    return out


def _alone(spans: dict[Any, tuple[float, float]]) -> set:
    """Keys whose span overlaps no other span."""
    order = sorted(spans, key=lambda k: spans[k])
    alone, reach = set(), float("-inf")  # reach: the latest end among earlier spans
    for i, k in enumerate(order):
        a, b = spans[k]
        nxt = spans[order[i + 1]][0] if i + 1 < len(order) else float("inf")
        if a >= reach and b <= nxt:
            alone.add(k)
        reach = max(reach, b)
    return alone


@dataclass(frozen=True, slots=True)
class SoloCalls:
    """The calls that had the engine to themselves in both runs, and their engine time."""

    calls: int
    seconds_a: float
    seconds_b: float


def solo_calls(a: tuple[RunResult, Iterable[dict[str, Any]]],
               b: tuple[RunResult, Iterable[dict[str, Any]]]) -> SoloCalls:
    """Engine time of the rounds that overlapped no other call in run ``a`` nor in run
    ``b`` (each a results / events pair of the same trace), summed per run. Such a call's
    time is its prefill and decode steps alone: what the step-time model and the engine's
    handling of one call predict, with nothing left to the chance of overlaps."""
    sa, sb = round_spans(*a), round_spans(*b)
    both = sorted(_alone(sa) & _alone(sb))
    return SoloCalls(len(both), sum(sa[k][1] - sa[k][0] for k in both),
                     sum(sb[k][1] - sb[k][0] for k in both))


@dataclass(frozen=True, slots=True)
class OutsideEngine:
    """The part of one task's latency spent neither in engine calls nor in tools' planned
    time (seconds)."""

    #: client-observed round time minus the engine's time for the same call, over the rounds
    #: (served: HTTP, API server, sidecar, and the wait for the step in progress)
    gaps_s: float
    #: tools' measured run time minus their planned duration (late timers on a busy host)
    tool_overrun_s: float
    #: rounds whose engine call was not found in the events (not counted above)
    unmatched: int = 0

    @property
    def total_s(self) -> float:
        return self.gaps_s + self.tool_overrun_s


def by_client_id(calls: dict[str, Any]) -> dict[str, Any]:
    """``calls`` reachable by the client's request id too: the served API derives the
    engine's id from the client's by appending ``-<n>-<hex>``; the simulator's are equal."""
    out = dict(calls)
    for rid, t in calls.items():
        out.setdefault(rid.rsplit("-", 2)[0], t)
    return out


def outside_engine(results: RunResult,
                   events: Iterable[dict[str, Any]]) -> dict[str, OutsideEngine]:
    """Per task of ``results``, the part of its latency outside its engine calls and its
    tools' planned time, from the engine's ``events`` of the same run."""
    calls = by_client_id(engine_calls(events))
    out: dict[str, OutsideEngine] = {}
    for task in results.tasks:
        fe = over = 0.0
        missing = 0
        for r in task.rounds:
            t = calls.get(r.request_id) if r.request_id else None
            if t is None:
                missing += 1
            else:
                fe += (r.end_s - r.submit_s) - t
            if r.tool_end_s is not None and r.tool_start_s is not None and r.tool_duration_s:
                over += (r.tool_end_s - r.tool_start_s) - r.tool_duration_s
        out[task.task_id] = OutsideEngine(fe, over, missing)
    return out


def engine_side_mean(results: RunResult, events: Iterable[dict[str, Any]]) -> float:
    """Mean latency of the completed tasks less the part outside the engine
    (:func:`outside_engine`); NaN when none completed."""
    out = outside_engine(results, events)
    done = [t for t in results.tasks if t.latency_s is not None]
    if not done:
        return float("nan")
    return sum(t.latency_s - out[t.task_id].total_s for t in done) / len(done)
