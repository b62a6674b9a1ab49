"""Summary statistics of a trace: what ``mars workloads stats`` prints.

Used to check a generated or imported trace against its intended shape before spending GPU
time on it (mean prompt volume vs. the regime target, tool mix, the context length the
model must support, the arrival rate the replay will impose).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mars.workloads.goodput import Summary, summarize

from .tools import is_cpu_bound
from .trace import Trace, prompt_lengths


@dataclass(frozen=True, slots=True)
class ToolStats:
    name: str
    count: int
    #: share of all tool calls
    fraction: float
    mean_duration_s: float
    mean_observation_tokens: float
    cpu_bound: bool


@dataclass(frozen=True, slots=True)
class TraceStats:
    regime: str
    tasks: int
    rounds: int
    rounds_per_task: Summary
    #: summed prompt tokens per task (the paper's request-level prompt volume)
    prompt_volume: Summary
    #: prompt tokens per round
    prompt_tokens: Summary
    output_tokens: Summary
    task_tokens: Summary
    #: distinct shared-prefix lengths (one value for a generated trace)
    prefix_tokens: tuple[int, ...]
    #: largest prompt + output of any round: the model's context must be at least this
    max_context_tokens: int
    total_output_tokens: int
    tool_calls: int
    tool_time_s: float
    cpu_bound_tool_time_s: float
    tools: tuple[ToolStats, ...]
    first_arrival_s: float
    last_arrival_s: float
    #: (tasks - 1) / (last - first arrival); NaN with fewer than two tasks
    arrival_rate: float
    #: interesting header parameters (target volume, theta, scale, time_scale)
    header: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for k in self.__dataclass_fields__:
            v = getattr(self, k)
            if isinstance(v, Summary):
                v = v.to_dict()
            elif k == "tools":
                v = [
                    {f: getattr(t, f) for f in t.__dataclass_fields__}
                    for t in v
                ]
            elif isinstance(v, tuple):
                v = list(v)
            d[k] = v
        return d


_HEADER_KEYS = (
    "target_mean_prompt_volume",
    "sample_mean_prompt_volume",
    "context_limit",
    "rate",
    "theta",
    "effective_pool_size",
    "scale",
    "time_scale",
    "arrivals",
    "source",
)


def trace_stats(trace: Trace) -> TraceStats:
    tasks = trace.tasks
    n_rounds = [t.num_rounds for t in tasks]
    volumes: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    max_ctx = 0
    per_tool: dict[str, list[float]] = {}  # name -> [count, duration, observation]
    for t in tasks:
        ps = prompt_lengths(t)
        volumes.append(sum(ps))
        prompts.extend(ps)
        for p, r in zip(ps, t.rounds):
            outputs.append(r.output_tokens)
            max_ctx = max(max_ctx, p + r.output_tokens)
            if r.tool is not None:
                acc = per_tool.setdefault(r.tool, [0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += r.tool_duration_s
                acc[2] += r.observation_tokens
    calls = int(sum(a[0] for a in per_tool.values()))
    tools = tuple(
        ToolStats(
            name=name,
            count=int(c),
            fraction=c / calls,
            mean_duration_s=d / c,
            mean_observation_tokens=o / c,
            cpu_bound=is_cpu_bound(name),
        )
        for name, (c, d, o) in sorted(per_tool.items(), key=lambda kv: -kv[1][0])
    )
    tool_time = sum(a[1] for a in per_tool.values())
    cpu_time = sum(a[1] for name, a in per_tool.items() if is_cpu_bound(name))
    arrivals = [t.arrival_s for t in tasks]
    first = min(arrivals) if arrivals else float("nan")
    last = max(arrivals) if arrivals else float("nan")
    span = last - first
    rate = (len(tasks) - 1) / span if len(tasks) >= 2 and span > 0 else float("nan")
    params = trace.header.params
    return TraceStats(
        regime=trace.header.regime,
        tasks=len(tasks),
        rounds=sum(n_rounds),
        rounds_per_task=summarize(n_rounds),
        prompt_volume=summarize(volumes),
        prompt_tokens=summarize(prompts),
        output_tokens=summarize(outputs),
        task_tokens=summarize(t.task_tokens for t in tasks),
        prefix_tokens=tuple(sorted({t.prefix_tokens for t in tasks})),
        max_context_tokens=max_ctx,
        total_output_tokens=sum(outputs),
        tool_calls=calls,
        tool_time_s=tool_time,
        cpu_bound_tool_time_s=cpu_time,
        tools=tools,
        first_arrival_s=first,
        last_arrival_s=last,
        arrival_rate=rate,
        header={k: params[k] for k in _HEADER_KEYS if k in params},
    )


def _fmt_summary(s: Summary, unit: str = "", digits: int = 0) -> str:
    f = f"{{:,.{digits}f}}"
    return (
        f"mean {f.format(s.mean)}{unit}  p50 {f.format(s.p50)}  p90 {f.format(s.p90)}  "
        f"p99 {f.format(s.p99)}  max {f.format(s.max)}"
    )


def format_stats(s: TraceStats) -> str:
    """Human-readable report."""
    lines = [
        f"regime            {s.regime}",
        f"tasks             {s.tasks}",
        f"rounds            {s.rounds}  ({_fmt_summary(s.rounds_per_task, digits=1)})",
        f"prompt volume     {_fmt_summary(s.prompt_volume)}  tokens/task",
    ]
    target = s.header.get("target_mean_prompt_volume")
    full = s.header.get("sample_mean_prompt_volume")
    if target and full:
        scale = s.header.get("scale", 1.0)
        note = f" (this trace is scaled down {scale:g}x)" if scale != 1 else ""
        lines.append(
            f"  full scale      mean {full:,.0f} vs regime target {target:,.0f} "
            f"({100 * (full / target - 1):+.1f}%){note}"
        )
    lines += [
        f"prompt/round      {_fmt_summary(s.prompt_tokens)}",
        f"output/round      {_fmt_summary(s.output_tokens, digits=1)}",
        f"task context      {_fmt_summary(s.task_tokens)}",
        f"shared prefix     {', '.join(str(p) for p in s.prefix_tokens)}",
        f"max context       {s.max_context_tokens:,} tokens (prompt + output)",
        f"output total      {s.total_output_tokens:,} tokens",
        f"arrivals          {s.first_arrival_s:.1f} .. {s.last_arrival_s:.1f} s, {s.arrival_rate:.4g} tasks/s",
        f"tool calls        {s.tool_calls}, {s.tool_time_s:,.1f} s total, "
        f"{s.cpu_bound_tool_time_s:,.1f} s CPU-bound",
        f"  {'tool':<18} {'count':>7} {'share':>7} {'mean s':>9} {'mean obs':>9}  kind",
    ]
    for t in s.tools:
        lines.append(
            f"  {t.name:<18} {t.count:>7} {100 * t.fraction:>6.1f}% {t.mean_duration_s:>9.3f} "
            f"{t.mean_observation_tokens:>9.1f}  {'cpu' if t.cpu_bound else 'light'}"
        )
    extra = {k: v for k, v in s.header.items() if not k.endswith("mean_prompt_volume")}
    if extra:
        lines.append("header            " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()))
    return "\n".join(lines)
