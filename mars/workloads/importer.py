"""Import recorded agent trajectories into the trace schema.

Real agent runs (OpenHands with our instrumented tools, or any harness that logs its LLM
calls) record per call how long the prompt was, how much the model wrote, and which tool ran
next for how long. This module turns such a recording into a :class:`~.trace.Trace`, so the
replay can drive the server with real shapes instead of synthetic ones.

Input format: JSONL, one LLM call per line (``docs/workloads.md`` is the reference)::

    {"session_id": "django-1234", "call_index": 0, "start_s": 1718000000.0,
     "prompt_tokens": 6900, "output_tokens": 85,
     "tool": "terminal.run", "tool_duration_s": 0.8, "observation_tokens": 140}

- required: ``session_id`` (string), ``prompt_tokens`` (int >= 1), ``output_tokens`` (int >= 1)
- optional: ``call_index`` (int >= 0; order within the session, default file order; give it
  for all calls of a session or none), ``tool`` (name of the tool run *after* this call;
  null/absent: none), ``tool_duration_s`` (>= 0, default 0), ``observation_tokens`` (int >= 0;
  default: derived), ``start_s`` (submission time in any epoch; arrivals use the first call's)
- other fields are ignored, so richer logs import as they are.

Derivation, per session: the first prompt splits into a shared prefix (``prefix_tokens``,
default 0 because a recording cannot tell which tokens are shared) and the task context.
Between consecutive calls the prompt growth ``P[k+1] - P[k] - output[k]`` is split into
template tokens (up to ``template_tokens``, default 10) and observation tokens, or, when the
recording gives ``observation_tokens``, into exactly that observation and the rest as template.
The schema is append-only, so a recording whose context shrank (history condensation, stripped
reasoning) is rejected naming the line, unless ``clamp=True`` (growth clamped to 0, counted).
The last call of a session ends its task: a tool recorded after it is dropped (counted). A
non-final call without a tool gets the tool name ``"unknown"`` (light: the replay sleeps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from os import PathLike
from pathlib import Path
from typing import Any

from .generator import poisson_arrivals
from .importers import detect_format, records_from
from .trace import Round, Task, Trace, TraceError, TraceHeader, prompt_lengths

UNKNOWN_TOOL = "unknown"
#: how a context that shrank (condensed history, stripped reasoning) is handled: an error
#: naming the line; ``clamp`` (growth 0: later prompts come out longer than recorded by what
#: was condensed away); ``split`` (the calls from the condensation on become a new task
#: ``<session>~2``: prompts exact, the prefix-cache continuity and the tool before the
#: condensation are lost)
CONDENSED_MODES = ("error", "clamp", "split")


@dataclass(frozen=True, slots=True)
class ImportResult:
    trace: Trace
    sessions: int
    calls: int
    #: transitions whose prompt shrank and were clamped to zero growth (``clamp=True`` only)
    clamped: int
    #: non-final calls without a tool, given the tool name ``"unknown"``
    untooled: int
    #: condensations that started a new task (``condensed="split"`` only)
    split: int
    #: tools recorded after a session's last call, dropped
    dropped_final_tools: int
    #: arrivals came from ``start_s`` (True) or a seeded Poisson process (False)
    used_timestamps: bool


@dataclass(frozen=True, slots=True)
class _Call:
    line: int
    session: str
    index: int | None
    prompt: int
    output: int
    tool: str | None
    duration: float
    observation: int | None
    start: float | None


def _bad(source: str, line: int, msg: str) -> TraceError:
    return TraceError(f"{source}:{line}: {msg}")


def _get_int(d: dict, key: str, minimum: int, source: str, line: int, required: bool) -> int | None:
    if key not in d or d[key] is None:
        if required:
            raise _bad(source, line, f"missing field '{key}'")
        return None
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(source, line, f"{key} must be an integer (got {v!r})")
    if v < minimum:
        raise _bad(source, line, f"{key} must be >= {minimum} (got {v})")
    return v


def _get_num(d: dict, key: str, source: str, line: int, minimum: float | None) -> float | None:
    if key not in d or d[key] is None:
        return None
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(source, line, f"{key} must be a finite number (got {v!r})")
    if minimum is not None and v < minimum:
        raise _bad(source, line, f"{key} must be >= {minimum:g} (got {v:g})")
    return float(v)


def _parse_call(d: Any, source: str, line: int) -> _Call:
    if not isinstance(d, dict):
        raise _bad(source, line, f"a call must be a JSON object (got {type(d).__name__})")
    sid = d.get("session_id")
    if isinstance(sid, int) and not isinstance(sid, bool):
        sid = str(sid)
    if not isinstance(sid, str) or not sid:
        raise _bad(source, line, f"session_id must be a non-empty string (got {sid!r})")
    tool = d.get("tool")
    if tool is not None and (not isinstance(tool, str) or not tool):
        raise _bad(source, line, f"tool must be a non-empty string or null (got {tool!r})")
    return _Call(
        line=line,
        session=sid,
        index=_get_int(d, "call_index", 0, source, line, required=False),
        prompt=_get_int(d, "prompt_tokens", 1, source, line, required=True),  # type: ignore[arg-type]
        output=_get_int(d, "output_tokens", 1, source, line, required=True),  # type: ignore[arg-type]
        tool=tool,
        duration=_get_num(d, "tool_duration_s", source, line, 0.0) or 0.0,
        observation=_get_int(d, "observation_tokens", 0, source, line, required=False),
        start=_get_num(d, "start_s", source, line, None),
    )


def import_records(
    records: Iterable[tuple[int, Any]] | Iterable[Any],
    *,
    source: str = "<recording>",
    prefix_tokens: int = 0,
    template_tokens: int = 10,
    clamp: bool = False,
    rate: float = 0.2,
    seed: int = 0,
    regime: str = "imported",
    time_origin: float | None = None,
    condensed: str | None = None,
) -> ImportResult:
    """Build a trace from call records (dicts, or ``(line, dict)`` pairs as from
    :func:`read_recording`; bare dicts are numbered from 1).

    Arrivals: when every session's first call has ``start_s``, arrivals are those times
    relative to ``time_origin`` (default: the earliest of them); otherwise a Poisson process at ``rate`` seeded with ``seed``
    assigns them in order of each session's first appearance.
    """
    if prefix_tokens < 0 or template_tokens < 0:
        raise ValueError("prefix_tokens and template_tokens must be >= 0")
    condensed = condensed or ("clamp" if clamp else "error")
    if condensed not in CONDENSED_MODES:
        raise ValueError(f"condensed must be one of {', '.join(CONDENSED_MODES)}")
    clamp = condensed == "clamp"
    numbered: list[tuple[int, Any]] = []
    for i, r in enumerate(records, start=1):
        if isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], int):
            numbered.append(r)
        else:
            numbered.append((i, r))

    sessions: dict[str, list[_Call]] = {}
    for line, d in numbered:
        c = _parse_call(d, source, line)
        sessions.setdefault(c.session, []).append(c)
    if not sessions:
        raise TraceError(f"{source}: no calls to import")

    clamped = untooled = dropped = splits = 0
    built: list[tuple[float | None, Task]] = []
    ordered: list[tuple[str, list[_Call]]] = []
    for sid, calls in sessions.items():
        indexed = [c.index is not None for c in calls]
        if any(indexed) and not all(indexed):
            c = calls[indexed.index(not indexed[0])]
            raise _bad(source, c.line, f"session {sid!r}: call_index must be given for all its calls or none")
        if all(indexed):
            calls = sorted(calls, key=lambda c: c.index)  # type: ignore[arg-type, return-value]
            for a, b in zip(calls, calls[1:]):
                if a.index == b.index:
                    raise _bad(source, b.line, f"session {sid!r}: call_index {b.index} repeats line {a.line}")
        if condensed != "split":
            ordered.append((sid, calls))
            continue
        # a condensed history starts a new task at the first call after the condensation
        seg, n = [calls[0]], 1
        for a, b in zip(calls, calls[1:]):
            if b.prompt < a.prompt + a.output:
                ordered.append((sid if n == 1 else f"{sid}~{n}", seg))
                seg, n = [], n + 1
                splits += 1
            seg.append(b)
        ordered.append((sid if n == 1 else f"{sid}~{n}", seg))
    for sid, calls in ordered:
        first = calls[0]
        prefix = min(prefix_tokens, first.prompt)
        rounds: list[Round] = []
        for k, c in enumerate(calls):
            if k == len(calls) - 1:
                if c.tool is not None:
                    dropped += 1
                rounds.append(Round(c.output))
                continue
            nxt = calls[k + 1]
            growth = nxt.prompt - c.prompt - c.output
            if growth < 0:
                if not clamp:
                    raise _bad(
                        source,
                        nxt.line,
                        f"session {sid!r}: prompt_tokens {nxt.prompt} is shorter than the previous "
                        f"call's prompt + output ({c.prompt + c.output}): the context was not "
                        "append-only (condensed history?); import with --condensed split or "
                        "clamp to accept it (docs/workloads.md §3)",
                    )
                clamped += 1
                growth = 0
            if c.observation is not None:
                obs = c.observation
                tmpl = growth - obs
                if tmpl < 0:
                    if not clamp:
                        raise _bad(
                            source,
                            c.line,
                            f"observation_tokens {obs} exceeds the prompt growth to the next call ({growth})",
                        )
                    obs, tmpl = growth, 0
            else:
                tmpl = min(template_tokens, growth)
                obs = growth - tmpl
            tool = c.tool
            if tool is None:
                untooled += 1
                tool = UNKNOWN_TOOL
            rounds.append(Round(c.output, tool, c.duration, obs, tmpl))
        task = Task(sid, 0.0, prefix, first.prompt - prefix, tuple(rounds))
        built.append((first.start, task))

    used_ts = all(start is not None for start, _ in built)
    if used_ts:
        t0 = min(start for start, _ in built) if time_origin is None else time_origin  # type: ignore[type-var]
        if any(start < t0 for start, _ in built):  # type: ignore[operator]
            raise ValueError(f"time_origin {t0} is after a session's start_s")
        arrivals = [round(start - t0, 6) for start, _ in built]  # type: ignore[operator]
    else:
        arrivals = [round(a, 6) for a in poisson_arrivals(rate, seed, num_tasks=len(built)).tolist()]
    tasks = [
        Task(t.task_id, a, t.prefix_tokens, t.task_tokens, t.rounds)
        for a, (_, t) in zip(arrivals, built)
    ]
    tasks.sort(key=lambda t: t.arrival_s)  # stable: ties keep first-appearance order
    params = {
        "importer": "mars.workloads.importer",
        "source": source,
        "prefix_tokens": prefix_tokens,
        "template_tokens": template_tokens,
        "arrivals": "timestamps" if used_ts else "poisson",
        "rate": None if used_ts else rate,
        "condensed": condensed,
        "clamped": clamped,
        "split": splits,
        "untooled": untooled,
        "dropped_final_tools": dropped,
        "scale": 1.0,
        "time_scale": 1.0,
    }
    trace = Trace(TraceHeader(regime, len(tasks), None if used_ts else seed, params), tuple(tasks))
    return ImportResult(
        trace=trace,
        sessions=len(tasks),
        calls=len(numbered),
        clamped=clamped,
        untooled=untooled,
        split=splits,
        dropped_final_tools=dropped,
        used_timestamps=used_ts,
    )


def import_file(path: str | PathLike[str], fmt: str = "recording", **kwargs: Any) -> ImportResult:
    """:func:`import_records` on a recording file, or on any log format of
    :mod:`mars.workloads.importers` (``fmt``: ``auto``, ``recording``, ``openai-log``,
    ``swe-agent``, ``openhands``); errors name ``PATH:LINE``."""
    if fmt == "auto":
        fmt = detect_format(Path(path))
    records, source = records_from(path, fmt)
    kwargs.setdefault("regime", "imported")
    result = import_records(records, source=source, **kwargs)
    params = dict(result.trace.header.params, format=fmt)
    trace = Trace(replace(result.trace.header, params=params), result.trace.tasks)
    return replace(result, trace=trace)


def trace_to_records(trace: Trace) -> list[dict[str, Any]]:
    """The inverse direction: a trace as importer input (one record per round).

    Useful to check the importer (import of the export reproduces the trace's rounds) and to
    hand a trace to tools that expect per-call logs. ``start_s`` is the task's arrival.
    """
    out: list[dict[str, Any]] = []
    for t in trace.tasks:
        for k, (p, r) in enumerate(zip(prompt_lengths(t), t.rounds)):
            rec: dict[str, Any] = {
                "session_id": t.task_id,
                "call_index": k,
                "prompt_tokens": p,
                "output_tokens": r.output_tokens,
                "tool": r.tool,
                "tool_duration_s": r.tool_duration_s,
                "observation_tokens": r.observation_tokens,
            }
            if k == 0:
                rec["start_s"] = t.arrival_s
            out.append(rec)
    return out
