"""Replay results: the versioned ``results.json`` schema, its summary, and ``mars report``.

Every later claim (MARS vs. FCFS vs. the baselines) is a comparison of these files, so the
file keeps the raw per-round observations, not only aggregates: a new metric can be computed
from an old run. ``docs/replay.md`` documents every field.

Times inside a run are seconds relative to the run start (``run.start_unix`` maps them to
Unix time, the clock of the event stream). Non-finite numbers are written as ``null``
(strict JSON); readers get ``NaN`` back where a number is expected.

Definitions (the paper's, §2.1 and §6.2):

* a task's **latency** is from its (scheduled) arrival to the end of its last LLM round;
* **TTFT** of a round is from submitting it to the first generated token seen by the client;
* **round latency** is from submitting it to the end of its stream;
* **cached fraction** of a round is the server's prefix-cache hit over its prompt tokens;
* **tool wait** is how long a CPU-bound tool queued for a tool core;
* **recomputed context** of a round (≥ 1) is the part of the context its session had already
  computed (the previous round's prompt and output) that was not in the prefix cache when
  the round started: KV evicted during the tool call and prefilled again. Recomputation after
  a preemption *inside* a round is not in it; the server's preemption count is shown beside;
* **goodput** (Eq. 1-2) is the rate of tasks completing within ``slack x`` their ideal
  (isolated, concurrency 1) latency, for slack 2, 3, 5 (``mars.workloads.goodput``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mars.workloads.goodput import DEFAULT_SLACKS, TaskOutcome, evaluate, summarize

RESULTS_SCHEMA = "mars-replay-results"
RESULTS_VERSION = 1

#: task statuses; ``completed`` and ``truncated`` (stopped at the context limit after at
#: least one round, deterministically: the ideal run stops at the same round) count as done
DONE_STATUSES = ("completed", "truncated")
STATUSES = ("completed", "truncated", "skipped", "error", "interrupted", "not_started", "running")


class ResultsError(ValueError):
    """A results file is not readable as this schema; the message names the file."""


@dataclass(slots=True)
class RoundResult:
    """One LLM round as the client saw it, and the tool phase after it."""

    index: int
    #: prompt length sent (client side, exact)
    prompt_tokens: int
    #: generated tokens received
    output_tokens: int
    #: tokens the trace asked for (``output_tokens`` differs only if the server ignored it)
    planned_output_tokens: int
    submit_s: float
    first_token_s: float | None
    end_s: float
    #: prefix-cache hit (``usage.prompt_tokens_details`` or engine events); None if unknown
    cached_tokens: int | None = None
    request_id: str | None = None
    tool: str | None = None
    tool_cpu_bound: bool = False
    #: duration the trace recorded for the tool (after time compression)
    tool_duration_s: float = 0.0
    tool_enqueue_s: float | None = None
    tool_start_s: float | None = None
    tool_end_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.submit_s

    @property
    def latency_s(self) -> float:
        return self.end_s - self.submit_s

    @property
    def cached_fraction(self) -> float | None:
        if self.cached_tokens is None or self.prompt_tokens <= 0:
            return None
        return self.cached_tokens / self.prompt_tokens

    @property
    def tool_wait_s(self) -> float | None:
        if self.tool_enqueue_s is None or self.tool_start_s is None:
            return None
        return max(0.0, self.tool_start_s - self.tool_enqueue_s)

    @property
    def tool_run_s(self) -> float | None:
        if self.tool_start_s is None or self.tool_end_s is None:
            return None
        return max(0.0, self.tool_end_s - self.tool_start_s)


@dataclass(slots=True)
class TaskResult:
    task_id: str
    #: scheduled arrival (load run) or actual start (isolated run), run-relative seconds
    arrival_s: float
    planned_rounds: int
    status: str = "not_started"
    start_s: float | None = None
    #: end of the last LLM round that ran; None unless the task is done
    finish_s: float | None = None
    rounds: list[RoundResult] = field(default_factory=list)
    ideal_s: float | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.status in DONE_STATUSES and self.finish_s is not None

    @property
    def latency_s(self) -> float | None:
        return self.finish_s - self.arrival_s if self.done else None  # type: ignore[operator]

    def outcome(self) -> TaskOutcome:
        return TaskOutcome(
            task_id=self.task_id, arrival_s=self.arrival_s,
            finish_s=self.finish_s if self.done else None, ideal_s=self.ideal_s,
            output_tokens=sum(r.output_tokens for r in self.rounds),
            prompt_tokens=sum(r.prompt_tokens for r in self.rounds))


@dataclass(slots=True)
class RunResult:
    """One replay run: what was replayed, against what, how, and what was observed."""

    label: str
    mode: str  # "load" (arrivals as in the trace) or "isolated" (one task at a time)
    trace: dict[str, Any]
    server: dict[str, Any]
    config: dict[str, Any]
    run: dict[str, Any]
    tasks: list[TaskResult]
    summary: dict[str, Any] = field(default_factory=dict)
    #: "usage" (server usage details), "events" (engine gpu_1st_token events) or None
    cached_tokens_source: str | None = None
    #: server-side counter deltas over the run (``/metrics``), None if unreadable
    server_metrics: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    schema: str = RESULTS_SCHEMA
    version: int = RESULTS_VERSION

    def finalize(self, slacks: Iterable[float] = DEFAULT_SLACKS) -> "RunResult":
        self.summary = summarize_run(self.tasks, slacks, self.server_metrics)
        return self

    def to_dict(self) -> dict[str, Any]:
        d = {
            "schema": self.schema, "version": self.version, "label": self.label,
            "mode": self.mode, "trace": self.trace, "server": self.server,
            "config": self.config, "run": self.run,
            "cached_tokens_source": self.cached_tokens_source,
            "server_metrics": self.server_metrics, "notes": list(self.notes),
            "files": dict(self.files), "summary": self.summary,
            "tasks": [_task_to_dict(t) for t in self.tasks],
        }
        return _finite(d)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<results>") -> "RunResult":
        if not isinstance(d, Mapping) or d.get("schema") != RESULTS_SCHEMA:
            raise ResultsError(f"{source}: not a mars replay results file (schema must be "
                               f"{RESULTS_SCHEMA!r})")
        if d.get("version") != RESULTS_VERSION:
            raise ResultsError(f"{source}: unsupported results version {d.get('version')!r} "
                               f"(this mars reads version {RESULTS_VERSION})")
        try:
            tasks = [_task_from_dict(t) for t in d["tasks"]]
            return cls(
                label=d["label"], mode=d["mode"], trace=dict(d["trace"]),
                server=dict(d["server"]), config=dict(d["config"]), run=dict(d["run"]),
                tasks=tasks, summary=dict(d.get("summary") or {}),
                cached_tokens_source=d.get("cached_tokens_source"),
                server_metrics=d.get("server_metrics"), notes=list(d.get("notes") or []),
                files=dict(d.get("files") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ResultsError(f"{source}: malformed results ({type(e).__name__}: {e})") from None


def _task_to_dict(t: TaskResult) -> dict[str, Any]:
    d = asdict(t)
    d["latency_s"] = t.latency_s
    return d


def _task_from_dict(d: Mapping[str, Any]) -> TaskResult:
    d = dict(d)
    d.pop("latency_s", None)
    rounds = [RoundResult(**r) for r in d.pop("rounds")]
    return TaskResult(rounds=rounds, **d)


def _finite(obj: Any) -> Any:
    """NaN/inf -> None, recursively: results files are strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.generic):
        return _finite(obj.item())
    return obj


def write_results(result: RunResult, path: str | os.PathLike[str]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=1, allow_nan=False) + "\n")
    tmp.replace(p)


def read_results(path: str | os.PathLike[str]) -> RunResult:
    """Read ``results.json`` (or a run directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ResultsError(f"{p}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise ResultsError(f"{p}: not JSON ({e})") from None
    return RunResult.from_dict(d, str(p))


# ------------------------------------------------------------------------------- summary


def _summary(values: Iterable[float | None]) -> dict[str, float]:
    return summarize([v for v in values if v is not None]).to_dict()


def _by_round(tasks: Sequence[TaskResult], attr: str) -> list[dict[str, float]]:
    """Per round index: count, mean, P50, P90 of a round attribute (None values skipped)."""
    buckets: dict[int, list[float]] = {}
    for t in tasks:
        for r in t.rounds:
            v = getattr(r, attr)
            if v is not None:
                buckets.setdefault(r.index, []).append(float(v))
    out = []
    for k in sorted(buckets):
        s = summarize(buckets[k])
        out.append({"round": k, "count": s.count, "mean": s.mean, "p50": s.p50, "p90": s.p90})
    return out


def summarize_run(tasks: Sequence[TaskResult], slacks: Iterable[float] = DEFAULT_SLACKS,
                  server_metrics: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Aggregates of a run; everything is recomputable from ``tasks``."""
    slacks = tuple(float(s) for s in slacks)
    counts = {s: 0 for s in STATUSES}
    for t in tasks:
        counts[t.status] = counts.get(t.status, 0) + 1
    counts = {k: v for k, v in counts.items() if v or k in DONE_STATUSES}
    rounds = [r for t in tasks for r in t.rounds]
    later = [r for r in rounds if r.index >= 1]
    cached_later = [r for r in later if r.cached_tokens is not None]
    cached_all = [r for r in rounds if r.cached_tokens is not None]
    cpu_tools = [r for r in rounds if r.tool_cpu_bound and r.tool_start_s is not None]
    done = [t for t in tasks if t.done]

    out: dict[str, Any] = {
        "tasks": {"total": len(tasks), **counts},
        "rounds": len(rounds),
    }
    outcomes = [t.outcome() for t in tasks]
    if done:
        m = evaluate(outcomes, slacks)
        w = m.window.duration_s
        prompt = sum(r.prompt_tokens for t in done for r in t.rounds)
        out.update({
            "window_s": [m.window.start_s, m.window.end_s],
            "latency_s": m.latency.to_dict(),
            "throughput": {
                "tasks_per_s": m.request_throughput,
                "output_tokens_per_s": m.output_token_throughput,
                "prompt_tokens_per_s": prompt / w if w > 0 else math.nan,
            },
            "goodput": {
                f"{s:g}": {"goodput": g.goodput, "good": g.good, "evaluated": g.evaluated,
                           "missing_ideal": g.missing_ideal, "attainment": g.attainment}
                for s, g in m.goodput.items()
            },
        })
    else:
        out.update({"window_s": None, "latency_s": _summary([]), "throughput": None,
                    "goodput": None})
    judged = [t for t in done if t.ideal_s and t.ideal_s > 0 and math.isfinite(t.ideal_s)]
    out["ideal_latency_s"] = _summary(t.ideal_s for t in judged)
    out["slowdown"] = _summary(t.latency_s / t.ideal_s for t in judged)  # type: ignore[operator]
    out["round_latency_s"] = _summary(r.latency_s for r in rounds)
    out["ttft_s"] = _summary(r.ttft_s for r in rounds)
    out["ttft_by_round"] = _by_round(tasks, "ttft_s")
    out["cached_fraction"] = {
        "rounds_with_data": len(cached_all),
        "first_round_mean": _mean(r.cached_fraction for r in cached_all if r.index == 0),
        "later_rounds_mean": _mean(r.cached_fraction for r in cached_later),
        "later_rounds_token_weighted": (
            sum(r.cached_tokens for r in cached_later) / sum(r.prompt_tokens for r in cached_later)  # type: ignore[misc]
            if cached_later else math.nan),
    }
    out["cached_fraction_by_round"] = _by_round(tasks, "cached_fraction")
    out["recomputed_context_tokens"] = _recomputed_context(tasks)
    out["tool_wait_s"] = _summary(r.tool_wait_s for r in cpu_tools)
    out["tool_run_s"] = _summary(r.tool_run_s for r in cpu_tools)
    out["tool_stretch"] = _summary(
        r.tool_run_s / r.tool_duration_s for r in cpu_tools  # type: ignore[operator]
        if r.tool_duration_s > 0 and r.tool_run_s is not None)
    if server_metrics:
        sm = server_metrics
        srv: dict[str, float] = {}
        n = sm.get("vllm:e2e_request_latency_seconds_count", 0.0)
        if n > 0:
            srv["requests"] = n
            srv["mean_e2e_request_latency_s"] = sm["vllm:e2e_request_latency_seconds_sum"] / n
        n = sm.get("vllm:time_to_first_token_seconds_count", 0.0)
        if n > 0:
            srv["mean_ttft_s"] = sm["vllm:time_to_first_token_seconds_sum"] / n
        if "vllm:num_preemptions_total" in sm:
            srv["preemptions"] = sm["vllm:num_preemptions_total"]
        q = sm.get("vllm:prefix_cache_queries_total", 0.0)
        if q > 0:
            srv["prefix_cache_hit_rate"] = sm.get("vllm:prefix_cache_hits_total", 0.0) / q
        out["server"] = srv
    return out


def _recomputed_context(tasks: Sequence[TaskResult]) -> int | None:
    """Context tokens sessions had computed before but found evicted at a round's start
    (None when the server reported no cached tokens)."""
    total, seen = 0, False
    for t in tasks:
        for prev, r in zip(t.rounds, t.rounds[1:]):
            if r.cached_tokens is None or prev.output_tokens is None:
                continue
            seen = True
            had = min(prev.prompt_tokens + prev.output_tokens, r.prompt_tokens)
            total += max(0, had - r.cached_tokens)
    return total if seen else None


def _mean(values: Iterable[float | None]) -> float:
    vs = [v for v in values if v is not None]
    return float(np.mean(vs)) if vs else math.nan


# -------------------------------------------------------------------------------- report


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) else math.nan


def _fmt(x: Any, digits: int = 2, pct: bool = False) -> str:
    v = _num(x)
    if not math.isfinite(v):
        return "–"
    if pct:
        return f"{100 * v:.1f}%"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def _fmt_int(x: Any) -> str:
    v = _num(x)
    return f"{v:,.0f}" if math.isfinite(v) else "–"


def _get(d: Mapping[str, Any] | None, *path: str) -> Any:
    cur: Any = d
    for p in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(p)
    return cur


def report_rows(r: RunResult, slacks: Sequence[float] = DEFAULT_SLACKS) -> list[tuple[str, str]]:
    """(metric, value) rows of one run, in report order."""
    s = r.summary
    t = s.get("tasks", {})
    done = sum(t.get(k, 0) for k in DONE_STATUSES)
    rows = [
        ("trace", f"{r.trace.get('regime', '?')} ×{t.get('total', 0)}"),
        ("mode", r.mode),
        ("tasks done / total", f"{done} / {t.get('total', 0)}"
         + (f" ({t['truncated']} truncated)" if t.get("truncated") else "")),
    ]
    bad = [f"{t[k]} {k}" for k in ("error", "interrupted", "not_started", "skipped") if t.get(k)]
    if bad:
        rows.append(("tasks not done", ", ".join(bad)))
    lat = s.get("latency_s") or {}
    rows += [
        ("latency mean (s)", _fmt(lat.get("mean"))),
        ("latency P50 (s)", _fmt(lat.get("p50"))),
        ("latency P90 (s)", _fmt(lat.get("p90"))),
        ("latency P95 (s)", _fmt(lat.get("p95"))),
        ("latency P99 (s)", _fmt(lat.get("p99"))),
        ("slowdown vs ideal, mean", _fmt(_get(s, "slowdown", "mean"))),
        ("TTFT mean (s)", _fmt(_get(s, "ttft_s", "mean"), 3)),
        ("TTFT P90 (s)", _fmt(_get(s, "ttft_s", "p90"), 3)),
        ("round latency mean (s)", _fmt(_get(s, "round_latency_s", "mean"), 3)),
        ("cached fraction, rounds ≥ 1", _fmt(_get(s, "cached_fraction", "later_rounds_token_weighted"),
                                             pct=True)),
        ("recomputed context (tokens)", _fmt_int(s.get("recomputed_context_tokens"))),
        ("preemptions (server)", _fmt_int(_get(s, "server", "preemptions"))),
        ("tool queue wait mean (s)", _fmt(_get(s, "tool_wait_s", "mean"), 3)),
        ("tool queue wait P95 (s)", _fmt(_get(s, "tool_wait_s", "p95"), 3)),
        ("throughput (tasks/s)", _fmt(_get(s, "throughput", "tasks_per_s"), 3)),
        ("output tokens/s", _fmt(_get(s, "throughput", "output_tokens_per_s"), 1)),
    ]
    gp = s.get("goodput") or {}
    for sl in slacks:
        g = gp.get(f"{float(sl):g}")
        if g is None:
            rows.append((f"goodput slack {sl:g} (tasks/s)", "–"))
            continue
        if not g.get("evaluated"):
            rows.append((f"goodput slack {sl:g} (tasks/s)", "– (no ideal times)"))
            continue
        extra = f" ({g['good']}/{g['evaluated']})"
        if g.get("missing_ideal"):
            extra += f", {g['missing_ideal']} w/o ideal"
        rows.append((f"goodput slack {sl:g} (tasks/s)", _fmt(g.get("goodput"), 3) + extra))
    return rows


def format_report(results: Sequence[RunResult], names: Sequence[str] | None = None,
                  slacks: Sequence[float] = DEFAULT_SLACKS) -> str:
    """A markdown table: one column per run, one row per metric."""
    if not results:
        raise ValueError("no results to report")
    names = list(names or [r.label for r in results])
    cols = [dict(report_rows(r, slacks)) for r in results]
    metrics = list(dict.fromkeys(k for r in results for k, _ in report_rows(r, slacks)))
    header = "| metric | " + " | ".join(_cell(n) for n in names) + " |"
    sep = "|---|" + "---:|" * len(names)
    lines = [header, sep]
    for m in metrics:
        lines.append(f"| {m} | " + " | ".join(_cell(c.get(m, "–")) for c in cols) + " |")
    return "\n".join(lines)


def _cell(s: str) -> str:
    return str(s).replace("|", "\\|")
