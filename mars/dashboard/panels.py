"""What the dashboard shows, as plain data: rows of panels, each a title, a unit and its PromQL.

The questions are an operator's (docs/sidecar.md, *Metrics*): how many sessions are admitted
and waiting and what bounds them, how the window moves, what the KV cache holds and which
pins are held and how they end, the tool cores, per-round time to first token, preemptions;
then vLLM's own engine metrics beside them. Every query here is run against a real Prometheus
scraping a real ``mars-vllm serve`` by the tests (tests/test_dashboard.py): it must parse and
return data. ``$__rate_interval`` is Grafana's rate window (the tests give it one).
"""

from __future__ import annotations

from dataclasses import dataclass

S = "mars_sidecar_"
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


def _q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def _quantiles(metric: str, by: str = "") -> tuple[Query, ...]:
    labels = f"le{', ' + by if by else ''}"
    tag = f"{{{{{by}}}}} " if by else ""
    return tuple(_q(f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{RATE})))",
                    f"{tag}p{int(q * 100)}") for q in (0.5, 0.95))


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Control plane (paper §4.2)", (
        Panel("Sessions admitted and waiting", "short",
              (_q(f"{S}sessions_active", "admitted"), _q(f"{S}sessions_queued", "queued"),
               _q(f"{S}requests_inflight", "requests in flight"))),
        Panel("Window and its caps", "short",
              (_q(f"{S}window", "AIMD window W"), _q(f"{S}window_budget", "budget"),
               _q(f"{S}cpu_cap", "CPU cap"), _q(f"{S}kv_cap", "KV cap")),
              "The budget is min(W, caps), clamped; the binding limit is the smallest"),
        Panel("What bounds admission", "short",
              (_q(f"{S}window_limit", "{{limit}}"),),
              "1 for the smallest of the window, the CPU cap and the KV cap (at each scrape)"),
        Panel("Window moves", "ops",
              (_q(f"sum by (mode) (rate({S}window_updates_total{RATE}))", "{{mode}}"),),
              "Window decisions published, by mode: every change, and the last decision "
              "again at each heartbeat"),
        Panel("Admission wait of new sessions", "s", _quantiles(f"{S}queue_wait_seconds")),
        Panel("Sessions ended, by reason", "ops",
              (_q(f"sum by (reason) (rate({S}sessions_ended_total{RATE}))", "{{reason}}"),)),
    )),
    ("KV cache and pins (paper §4.3)", (
        Panel("KV blocks", "short", (_q(f"{S}kv_blocks", "{{state}}"),)),
        Panel("Pins made and returned", "ops",
              (_q(f"rate({S}pins_total{RATE})", "pinned"),
               _q(f"sum by (outcome) (rate({S}unpins_total{RATE}))", "{{outcome}}"))),
        Panel("How long pins are held", "s", _quantiles(f"{S}pin_held_seconds", "outcome")),
        Panel("Prefix-cache hit rate", "percentunit",
              (_q(f"rate({S}cached_tokens_total{RATE}) / rate({S}prompt_tokens_total{RATE})",
                  "cached / prompt tokens"),)),
        Panel("Preemptions", "ops",
              (_q(f"rate({S}preemptions_total{RATE})", "calls"),
               _q(f"rate({S}preempted_blocks_total{RATE})", "blocks"),
               _q(f"rate({S}chunk_shrinks_total{RATE})", "chunks shrunk"))),
    )),
    ("Latency", (
        Panel("Time to first token, by round", "s", _quantiles(f"{S}ttft_seconds", "round")),
        Panel("Request duration at the sidecar", "s", _quantiles(f"{S}request_seconds")),
    )),
    ("Tools (the CPU plane)", (
        Panel("Tool calls running and waiting", "short",
              (_q(f"{S}active_tools", "running"), _q(f"{S}tools_queued", "waiting for a core"))),
        Panel("Tool load per core", "short", (_q(f"{S}cpu_load", "active tools / core"),)),
        Panel("Tool durations", "s", _quantiles(f"{S}tool_duration_seconds", "status")),
    )),
    ("Engine (vLLM's metrics)", (
        Panel("Requests in the engine", "short",
              (_q("sum(vllm:num_requests_running)", "running"),
               _q("sum(vllm:num_requests_waiting)", "waiting"))),
        Panel("KV cache usage", "percentunit", (_q("avg(vllm:kv_cache_usage_perc)", "used"),)),
        Panel("Tokens", "short",
              (_q(f"sum(rate(vllm:prompt_tokens_total{RATE}))", "prompt / s"),
               _q(f"sum(rate(vllm:generation_tokens_total{RATE}))", "generated / s"))),
        Panel("Engine time to first token", "s", _quantiles("vllm:time_to_first_token_seconds")),
        Panel("Engine preemptions", "ops",
              (_q(f"sum(rate(vllm:num_preemptions_total{RATE}))", "preemptions"),)),
    )),
)


def queries() -> list[str]:
    """Every PromQL expression of the dashboard, in order."""
    return [q.expr for _, panels in ROWS for p in panels for q in p.queries]
