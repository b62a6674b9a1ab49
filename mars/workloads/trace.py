"""Agent traces: the objects the replay client consumes and their versioned JSONL file format.

A trace describes *what* each agent task does, never *how* the server responded: per task an
arrival time, a shared prefix, a task context and a list of rounds (LLM output length, then the
tool that runs, how long it runs and how many tokens it returns). Prompt lengths are not
stored: they are derived (:func:`prompt_lengths`), which makes the append-only property hold by
construction. Round ``k``'s prompt is exactly round ``k-1``'s prompt plus its output, its
observation and its template tokens, as with a real agent whose history only grows, so
prefix caching and KV retention see what they would see with real agents.

File format (``docs/workloads.md`` is the reference)::

    {"schema":"mars-trace","version":1,"regime":"ILR-1","seed":0,"num_tasks":2,"params":{...}}
    {"task_id":"ILR-1-s0-00000","arrival_s":3.1,"prefix_tokens":6000,"task_tokens":812,
     "rounds":[{"output_tokens":97,"tool":"terminal.run","tool_duration_s":0.52,
                "observation_tokens":140,"template_tokens":10}, ...,
               {"output_tokens":64,"tool":null,"tool_duration_s":0.0,
                "observation_tokens":0,"template_tokens":0}]}

Readers reject a malformed file with :class:`TraceError` naming the file and line, e.g.
``trace.jsonl:7: rounds[2].output_tokens must be >= 1``: traces are hand-edited and
imported from elsewhere, and a replay that dies an hour in on a bad field wastes a GPU slot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

from .tools import is_cpu_bound

SCHEMA_NAME = "mars-trace"
SCHEMA_VERSION = 1


class TraceError(ValueError):
    """A trace file or object breaks the schema; the message names the place (file:line)."""


@dataclass(frozen=True, slots=True)
class Round:
    """One LLM call of a task and the tool that runs after it.

    The last round of a task has ``tool=None`` and zero duration, observation and template:
    the task ends when its output is complete.
    """

    output_tokens: int
    tool: str | None = None
    tool_duration_s: float = 0.0
    #: tokens the tool's result adds to the context (capped at 8K by the generator)
    observation_tokens: int = 0
    #: chat-template tokens that wrap the output and observation (role headers, separators)
    template_tokens: int = 0

    @property
    def appended_tokens(self) -> int:
        """How much longer the next round's prompt is than this round's."""
        return self.output_tokens + self.observation_tokens + self.template_tokens

    @property
    def cpu_bound(self) -> bool:
        """Whether the replay burns CPU (rather than sleeps) for this round's tool."""
        return is_cpu_bound(self.tool)


@dataclass(frozen=True, slots=True)
class Task:
    """One agent session: the unit the paper's latency and goodput are measured on."""

    task_id: str
    #: seconds since the start of the run at which the task's first round is submitted
    arrival_s: float
    #: shared prefix (system prompt + tool schemas): identical content for every task of a trace
    prefix_tokens: int
    #: task-specific context (the issue statement): unique content per task
    task_tokens: int
    rounds: tuple[Round, ...]
    #: free-form provenance (pool index, imported session id); not used by the replay
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    def prompt_lengths(self) -> list[int]:
        return prompt_lengths(self)

    @property
    def prompt_volume(self) -> int:
        """Summed prompt tokens over all rounds (the paper's "request-level prompt volume")."""
        return sum(prompt_lengths(self))

    @property
    def max_context_tokens(self) -> int:
        """Largest prompt + output of any round: the context length the model must support."""
        return max(p + r.output_tokens for p, r in zip(prompt_lengths(self), self.rounds))

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.rounds)

    @property
    def tool_time_s(self) -> float:
        return sum(r.tool_duration_s for r in self.rounds)


def prompt_lengths(task: Task) -> list[int]:
    """Prompt length of every round: ``P_0 = prefix + task``, ``P_k = P_{k-1} + appended_{k-1}``."""
    p = task.prefix_tokens + task.task_tokens
    out = []
    for r in task.rounds:
        out.append(p)
        p += r.appended_tokens
    return out


@dataclass(frozen=True, slots=True)
class TraceHeader:
    """First line of a trace file: what produced it, so a result can be traced back to it."""

    regime: str
    num_tasks: int
    seed: int | None = None
    #: generator (or importer) parameters, free-form JSON object
    params: Mapping[str, Any] = field(default_factory=dict)
    version: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class Trace:
    header: TraceHeader
    tasks: tuple[Task, ...]

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    @classmethod
    def build(
        cls,
        regime: str,
        tasks: Iterable[Task],
        seed: int | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> "Trace":
        """Make a trace whose header's ``num_tasks`` matches ``tasks``."""
        tasks = tuple(tasks)
        return cls(TraceHeader(regime, len(tasks), seed, dict(params or {})), tasks)


# --------------------------------------------------------------------------------- writing


def round_to_dict(r: Round) -> dict[str, Any]:
    return {
        "output_tokens": r.output_tokens,
        "tool": r.tool,
        "tool_duration_s": r.tool_duration_s,
        "observation_tokens": r.observation_tokens,
        "template_tokens": r.template_tokens,
    }


def task_to_dict(t: Task) -> dict[str, Any]:
    d: dict[str, Any] = {
        "task_id": t.task_id,
        "arrival_s": t.arrival_s,
        "prefix_tokens": t.prefix_tokens,
        "task_tokens": t.task_tokens,
        "rounds": [round_to_dict(r) for r in t.rounds],
    }
    if t.meta:
        d["meta"] = dict(t.meta)
    return d


def header_to_dict(h: TraceHeader) -> dict[str, Any]:
    return {
        "schema": SCHEMA_NAME,
        "version": h.version,
        "regime": h.regime,
        "seed": h.seed,
        "num_tasks": h.num_tasks,
        "params": dict(h.params),
    }


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def dumps_trace(trace: Trace) -> str:
    """The trace as JSONL text. Validates first: an invalid trace is never written."""
    validate_trace(trace)
    lines = [_dumps(header_to_dict(trace.header))]
    lines.extend(_dumps(task_to_dict(t)) for t in trace.tasks)
    return "\n".join(lines) + "\n"


def write_trace(trace: Trace, path: str | PathLike[str]) -> None:
    Path(path).write_text(dumps_trace(trace))


# --------------------------------------------------------------------------------- reading


class _Bad(Exception):
    """A field-level problem; the caller prefixes the location."""


_ROUND_KEYS = ("output_tokens", "tool", "tool_duration_s", "observation_tokens", "template_tokens")
_TASK_KEYS = ("task_id", "arrival_s", "prefix_tokens", "task_tokens", "rounds")
_HEADER_KEYS = ("schema", "version", "regime", "seed", "num_tasks", "params")


def _int(v: Any, name: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad(f"{name} must be an integer (got {v!r})")
    if v < minimum:
        raise _Bad(f"{name} must be >= {minimum} (got {v})")
    return v


def _num(v: Any, name: str, minimum: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(f"{name} must be a number (got {v!r})")
    v = float(v)
    if not math.isfinite(v):
        raise _Bad(f"{name} must be finite (got {v})")
    if v < minimum:
        raise _Bad(f"{name} must be >= {minimum:g} (got {v:g})")
    return v


def _keys(d: Any, name: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    where = f"{name}: " if name else ""
    if not isinstance(d, dict):
        raise _Bad(f"{name or 'line'} must be a JSON object (got {type(d).__name__})")
    for k in required:
        if k not in d:
            raise _Bad(f"{where}missing field '{k}'")
    extra = [k for k in d if k not in required and k not in optional]
    if extra:
        raise _Bad(f"{where}unknown field '{extra[0]}'")


def _round_from_dict(d: Any, i: int, last: bool) -> Round:
    name = f"rounds[{i}]"
    _keys(d, name, _ROUND_KEYS)
    out = _int(d["output_tokens"], f"{name}.output_tokens", 1)
    tool = d["tool"]
    if tool is not None and (not isinstance(tool, str) or not tool):
        raise _Bad(f"{name}.tool must be a non-empty string or null (got {tool!r})")
    dur = _num(d["tool_duration_s"], f"{name}.tool_duration_s", 0.0)
    obs = _int(d["observation_tokens"], f"{name}.observation_tokens", 0)
    tmpl = _int(d["template_tokens"], f"{name}.template_tokens", 0)
    r = Round(out, tool, dur, obs, tmpl)
    _check_round(r, i, last)
    return r


def _check_round(r: Round, i: int, last: bool) -> None:
    """Checks shared by files and in-memory objects."""
    name = f"rounds[{i}]"
    if last:
        if r.tool is not None:
            raise _Bad(f"{name}.tool must be null: the last round ends the task (got {r.tool!r})")
        if r.tool_duration_s != 0 or r.observation_tokens != 0 or r.template_tokens != 0:
            raise _Bad(
                f"{name}: the last round must have tool_duration_s, observation_tokens and "
                "template_tokens 0"
            )
    elif r.tool is None:
        raise _Bad(f"{name}.tool must be a tool name: only the last round has no tool")


def _task_from_dict(d: Any) -> Task:
    _keys(d, "", _TASK_KEYS, ("meta",))
    tid = d["task_id"]
    if not isinstance(tid, str) or not tid:
        raise _Bad(f"task_id must be a non-empty string (got {tid!r})")
    arrival = _num(d["arrival_s"], "arrival_s", 0.0)
    prefix = _int(d["prefix_tokens"], "prefix_tokens", 0)
    task = _int(d["task_tokens"], "task_tokens", 0)
    if prefix + task < 1:
        raise _Bad("prefix_tokens + task_tokens must be >= 1")
    rounds = d["rounds"]
    if not isinstance(rounds, list) or not rounds:
        raise _Bad("rounds must be a non-empty list")
    n = len(rounds)
    rs = tuple(_round_from_dict(r, i, i == n - 1) for i, r in enumerate(rounds))
    meta = d.get("meta", {})
    if not isinstance(meta, dict):
        raise _Bad("meta must be a JSON object")
    return Task(tid, arrival, prefix, task, rs, meta)


def _header_from_dict(d: Any) -> TraceHeader:
    if not isinstance(d, dict) or d.get("schema") != SCHEMA_NAME:
        raise _Bad(f'not a mars trace: the first line must be a header with "schema": "{SCHEMA_NAME}"')
    ver = d.get("version")
    if ver != SCHEMA_VERSION:
        raise _Bad(f"unsupported trace version {ver!r} (this mars reads version {SCHEMA_VERSION})")
    _keys(d, "header", _HEADER_KEYS)
    regime = d["regime"]
    if not isinstance(regime, str):
        raise _Bad(f"header: regime must be a string (got {regime!r})")
    seed = d["seed"]
    if seed is not None:
        seed = _int(seed, "header: seed", 0)
    num = _int(d["num_tasks"], "header: num_tasks", 0)
    params = d["params"]
    if not isinstance(params, dict):
        raise _Bad("header: params must be a JSON object")
    return TraceHeader(regime, num, seed, params, ver)


def loads_trace(text: str, source: str = "<trace>") -> Trace:
    """Parse and validate trace text; errors read ``source:LINE: problem``."""
    return parse_trace_lines(text.splitlines(), source)


def read_trace(path: str | PathLike[str]) -> Trace:
    """Read and validate a trace file; errors read ``PATH:LINE: problem``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason})") from None
    return parse_trace_lines(text.splitlines(), str(path))


def parse_trace_lines(lines: Iterable[str], source: str = "<trace>") -> Trace:
    header: TraceHeader | None = None
    header_line = 0
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    prev_arrival = -math.inf
    lineno = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _Bad(f"invalid JSON: {e.msg} (column {e.colno})") from None
            if header is None:
                header, header_line = _header_from_dict(obj), lineno
                continue
            t = _task_from_dict(obj)
            if t.task_id in seen:
                raise _Bad(f"task_id {t.task_id!r} repeats the task on line {seen[t.task_id]}")
            if t.arrival_s < prev_arrival:
                raise _Bad(
                    f"arrival_s {t.arrival_s:g} is before the previous task's ({prev_arrival:g}): "
                    "tasks must be sorted by arrival"
                )
        except _Bad as e:
            raise TraceError(f"{source}:{lineno}: {e}") from None
        seen[t.task_id] = lineno
        prev_arrival = t.arrival_s
        tasks.append(t)
    if header is None:
        raise TraceError(f"{source}:1: empty file: expected a {SCHEMA_NAME} header line")
    if header.num_tasks != len(tasks):
        raise TraceError(
            f"{source}:{header_line}: header says num_tasks={header.num_tasks} but the file has "
            f"{len(tasks)} tasks (truncated or edited file?)"
        )
    return Trace(header, tuple(tasks))


def validate_trace(trace: Trace) -> None:
    """Check an in-memory trace against the same rules the reader applies.

    Errors name the task (``task 3 (ILR-1-s0-00003): rounds[2]...``) since there is no line.
    """
    h = trace.header
    if h.num_tasks != len(trace.tasks):
        raise TraceError(f"header: num_tasks={h.num_tasks} but the trace has {len(trace.tasks)} tasks")
    seen: set[str] = set()
    prev = -math.inf
    for i, t in enumerate(trace.tasks):
        try:
            # Round-tripping through the dict form reuses the reader's checks exactly.
            _task_from_dict(task_to_dict(t))
            if t.task_id in seen:
                raise _Bad(f"task_id {t.task_id!r} repeats an earlier task")
            if t.arrival_s < prev:
                raise _Bad(f"arrival_s {t.arrival_s:g} is before the previous task's ({prev:g})")
        except _Bad as e:
            raise TraceError(f"task {i} ({t.task_id!r}): {e}") from None
        seen.add(t.task_id)
        prev = t.arrival_s
