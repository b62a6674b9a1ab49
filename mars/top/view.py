"""Draws a :class:`mars.top.model.TopModel` with rich: the control plane on top (window, caps,
what binds, the last decision and why), the engine's KV and the tool cores under it, then one
row per session, and the latest preemptions. Plain text where colour is not available (a pipe,
``--once``), so the same frame reads over SSH, in a log and in a test.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mars.top.model import TopModel


def _num(x: Any, fmt: str = "{:g}") -> str:
    return "–" if x is None else fmt.format(x)


def _bar(parts: list[tuple[int, str]], total: int, width: int = 24) -> Text:
    """A horizontal bar of ``parts`` (count, style) over ``total`` cells' worth."""
    t = Text()
    if total <= 0:
        return t.append("·" * width, "dim")
    used = 0
    for n, style in parts:
        w = min(width - used, round(width * n / total))
        t.append("█" * w, style)
        used += w
    return t.append("·" * max(0, width - used), "dim")


def header(m: TopModel, url: str) -> Table:
    s = m.state
    sig = s.get("signals") or {}
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold")
    g.add_column()
    adm = s.get("admission", "?")
    g.add_row("mars top", Text(f"{url}  admission {adm}  up "
                               f"{_num(s.get('uptime_s'), '{:.0f}')} s  events {m.events_seen}  "
                               f"stream {m.stream_status}"))
    if adm == "on":
        g.add_row("window", f"W {_num(s.get('window'), '{:.2f}')}  budget {_num(s.get('budget'))}"
                            f"  CPU cap {_num(s.get('cpu_cap'), '{:.1f}')}"
                            f"  KV cap {_num(s.get('kv_cap'), '{:.1f}')}"
                            f"  binding: {m.binding() or '–'}")
        g.add_row("decision", Text(f"{s.get('mode') or '–'}: {s.get('reason') or '–'}"))
    g.add_row("sessions", f"admitted {_num(s.get('admitted'))}  queued {_num(s.get('queued'))}"
                          f"  requests in flight {_num(s.get('inflight'))}")
    total = int(sig.get("total_blocks") or 0)
    used, pinned = int(sig.get("used_blocks") or 0), int(sig.get("pinned_blocks") or 0)
    kv = _bar([(used - min(pinned, used), "green"), (min(pinned, used), "magenta")], total)
    kv.append(f"  used {used}  pinned {pinned}  free {_num(sig.get('free_blocks'))}"
              f" of {total} blocks")
    g.add_row("KV", kv)
    loading = sig.get("engine_loading")
    share = sig.get("batch_share")
    g.add_row("engine", f"running {_num(sig.get('engine_running'))}  waiting "
                        f"{_num(sig.get('engine_waiting'))}"
                        + (f" (loading from host {loading})" if loading else "")
                        + f"  preemptions (recent) "
                        f"{_num(sig.get('preemptions'))}"
                        + (f"  batch share {share:.2f}" if share is not None else ""))
    if s.get("host_blocks"):
        # the host tier (vLLM's KV offloading): what each admitted context is charged
        g.add_row("host tier", f"{s['host_blocks']} blocks  engine share "
                               f"{_num(s.get('engine_share'), '{:.2f}')}  contexts charged "
                               f"{s.get('charge') or '–'}")
    cores = sig.get("tool_cores")
    g.add_row("tools", f"running {_num(sig.get('active_tools'))} on "
                       f"{_num(cores)} cores (load {_num(sig.get('cpu_load'), '{:.2f}')})  "
                       f"slowdown {_num(sig.get('tool_slowdown'), '{:.2f}')}")
    return g


def sessions(m: TopModel, now: float, limit: int = 30) -> Table:
    rows = m.rows(now)
    t = Table(title=f"sessions ({len(rows)}; sort {m.sort}, show {m.filter})",
              title_justify="left", expand=False)
    # short headers and no wrapping: a row stays one line on an 80-column terminal, and the
    # session id (what an operator looks for) is the last to be cut
    for col, just, width in (("session", "left", 20), ("state", "left", 7),
                             ("flight", "right", 0), ("reqs", "right", 0),
                             ("ctx blk", "right", 0), ("pin τ", "right", 9), ("tool", "left", 4),
                             ("age", "right", 0), ("preempt", "right", 0)):
        t.add_column(col, justify=just, no_wrap=True, min_width=width or None)
    style = {"running": "green", "in tool": "yellow", "pinned": "magenta", "queued": "red"}
    for r in rows[:limit]:
        pin = "–" if r.pin_left_s is None else f"{r.pin_blocks}b {r.pin_left_s:+.0f}s"
        # ids and tool names are the clients' strings: Text, never parsed as rich markup
        t.add_row(Text(r.session_id), Text(r.state, style.get(r.state, "")), str(r.inflight),
                  str(r.requests), str(r.kv_blocks), pin, Text(r.tool or "–"), f"{r.age_s:.0f}",
                  str(r.preemptions))
    if len(rows) > limit:
        t.caption = f"... and {len(rows) - limit} more"
    return t


def frame(m: TopModel, url: str, now: float) -> Group:
    parts: list[Any] = [header(m, url), sessions(m, now)]
    if m.recent_preemptions:
        parts.append(Text("preempted lately: " + ", ".join(  # a Text: ids are not markup
            f"{sid} ({blocks} blk, {now - ts:.0f}s ago)"
            for ts, sid, blocks in m.recent_preemptions)))
    parts.append(Text("keys: s sort  f filter  q quit", style="dim"))
    return Group(*parts)
