"""The operator's metrics read off the unified stream (mars/sidecar/stream_metrics.py): what each
event adds, and label sets that stay bounded however many sessions, requests and tool names
pass (on the observer alone, and through a real sidecar over HTTP)."""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mars.sidecar.stream_metrics import StreamMetrics, round_class
from mars.launch import free_port

P = "mars_sidecar_"


def _metrics() -> tuple[StreamMetrics, CollectorRegistry]:
    reg = CollectorRegistry(auto_describe=False)
    return StreamMetrics(reg, P), reg


def test_each_event_lands_in_its_series():
    m, reg = _metrics()
    v = reg.get_sample_value
    m.observe({"kind": "gpu_1st_token", "request_id": "r1", "round": 0, "launch_delay_s": 0.3,
               "cached_tokens": 0, "prompt_tokens": 1000})
    m.observe({"kind": "gpu_1st_token", "request_id": "r2", "round": 7, "launch_delay_s": 0.04,
               "cached_tokens": 3800, "prompt_tokens": 4000})
    # a call aborted before its first token counts in neither: the hit rate is over served calls
    m.observe({"kind": "gpu_submit", "request_id": "r3", "round": 2, "prompt_tokens": 9000,
               "projected_blocks": 570})
    assert v(P + "prompt_tokens_total") == 5000 and v(P + "cached_tokens_total") == 3800
    assert v(P + "ttft_seconds_count", {"round": "0"}) == 1
    assert v(P + "ttft_seconds_sum", {"round": "4-15"}) == pytest.approx(0.04)
    assert v(P + "ttft_seconds_bucket", {"round": "4-15", "le": "0.05"}) == 1
    assert v(P + "ttft_seconds_count", {"round": "1-3"}) == 0

    m.observe({"kind": "preempt", "request_id": "r3", "blocks": 40})
    m.observe({"kind": "chunk_shrink", "request_id": "r4", "requested_tokens": 8192,
               "granted_tokens": 1024})
    m.observe({"kind": "pin", "session_id": "s", "blocks": 120, "tau_s": 9.0})
    m.observe({"kind": "unpin", "session_id": "s", "blocks": 120, "reason": "expired",
               "held_s": 9.0})
    m.observe({"kind": "pin", "session_id": "t", "blocks": 30, "tau_s": 9.0})
    m.observe({"kind": "unpin", "session_id": "t", "blocks": 30, "reason": "resumed",
               "held_s": 2.0})
    assert v(P + "preemptions_total") == 1 and v(P + "preempted_blocks_total") == 40
    assert v(P + "chunk_shrinks_total") == 1
    assert v(P + "pins_total") == 2 and v(P + "pinned_blocks_total") == 150
    assert v(P + "unpins_total", {"outcome": "expired"}) == 1
    assert v(P + "unpins_total", {"outcome": "resumed"}) == 1
    assert v(P + "unpins_total", {"outcome": "pressure"}) == 0
    assert v(P + "pin_held_seconds_sum", {"outcome": "expired"}) == 9.0

    m.observe({"kind": "tool_end", "session_id": "s", "tool": "pytest", "call_id": "c1",
               "duration_s": 12.0, "status": "timeout"})
    assert v(P + "tool_duration_seconds_count", {"status": "timeout"}) == 1
    for mode in ("increase", "increase", "hold"):
        m.observe({"kind": "window_update", "mode": mode})
    assert v(P + "window_updates_total", {"mode": "increase"}) == 2
    assert v(P + "window_updates_total", {"mode": "decrease"}) == 0


def test_round_classes():
    assert [round_class(r) for r in (None, "2", True, -1, 0, 1, 3, 4, 15, 16, 300)] == \
        ["none", "none", "none", "none", "0", "1-3", "1-3", "4-15", "4-15", "16+", "16+"]


def test_fields_of_the_wrong_type_count_as_nothing():
    """Engine events reach the sidecar unvalidated: the observer must not stop on one."""
    m, reg = _metrics()
    for ev in ({"kind": "gpu_1st_token", "launch_delay_s": None, "prompt_tokens": "x"},
               {"kind": "gpu_1st_token", "launch_delay_s": -1, "prompt_tokens": -5,
                "cached_tokens": [1]},
               {"kind": "preempt", "blocks": -3}, {"kind": "pin", "blocks": None},
               {"kind": "unpin", "reason": ["expired"]}, {"kind": "unpin", "reason": "nope"},
               {"kind": "tool_end", "status": ["ok"], "duration_s": 1},
               {"kind": "tool_end", "status": "ok", "duration_s": "long"},
               {"kind": "window_update", "mode": None}, {"kind": None}, {}):
        m.observe(ev)
    v = reg.get_sample_value
    assert v(P + "prompt_tokens_total") == 0 and v(P + "preempted_blocks_total") == 0
    assert v(P + "preemptions_total") == 1 and v(P + "pins_total") == 1
    assert sum(v(P + "ttft_seconds_count", {"round": c}) for c in
               ("0", "1-3", "4-15", "16+", "none")) == 0


def _series(text: str) -> set[str]:
    return {line.split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}


def _session(m: StreamMetrics, rng: random.Random, i: int) -> None:
    sid = f"session-{i}"
    for r in range(1, rng.randint(2, 40)):
        rid = f"req-{i}-{r}"
        m.observe({"kind": "gpu_1st_token", "session_id": sid, "request_id": rid, "round": r,
                   "launch_delay_s": rng.random(), "cached_tokens": 90 * r,
                   "prompt_tokens": 100 * r})
        tool = f"tool-{rng.randrange(10**6)}"  # client-chosen names: never a label
        for kind in ("tool_enqueue", "tool_start", "tool_end"):
            m.observe({"kind": kind, "session_id": sid, "tool": tool, "call_id": f"c{r}",
                       "duration_s": rng.random(), "status": rng.choice(("ok", "error"))})
        m.observe({"kind": "pin", "session_id": sid, "blocks": r, "tau_s": 1.0})
        m.observe({"kind": "unpin", "session_id": sid, "blocks": r, "held_s": 0.5,
                   "reason": rng.choice(("resumed", "expired", "pressure", "finished"))})
    m.observe({"kind": "session_end", "session_id": sid, "reason": "last_round"})


def test_series_stay_flat_over_a_thousand_sessions():
    m, reg = _metrics()
    rng = random.Random(0)
    for i in range(20):
        _session(m, rng, i)
    early = _series(generate_latest(reg).decode())
    for i in range(20, 1000):
        _session(m, rng, i)
    late = _series(generate_latest(reg).decode())
    assert late == early
    assert not any(re.search(r"session-|req-|tool-", s) for s in late)


def test_a_served_sidecar_keeps_its_series_flat():
    """The whole /metrics of a real sidecar over HTTP: tool events of a thousand sessions,
    each tool named by its client, then each session ended."""
    from mars.sidecar.process import SidecarProcess

    with SidecarProcess(f"http://127.0.0.1:{free_port()}",
                        ["--admission", "on", "--engine-events", "none",
                         "--no-upstream-metrics"]) as sc:
        def post(n0: int, n1: int) -> None:
            batch = []
            for i in range(n0, n1):
                sid, tool = f"agent-{i}", f"tool-{i}"
                ev = {"session_id": sid, "tool": tool, "call_id": "c1", "ts": time.time()}
                batch += [{**ev, "kind": "tool_enqueue"}, {**ev, "kind": "tool_start"},
                          {**ev, "kind": "tool_end", "duration_s": 0.01}]
                batch.append({"kind": "session_end", "session_id": sid, "ts": time.time(),
                              "reason": "last_round"})
            r = httpx.post(sc.url + "/v1/mars/events", json=batch, timeout=30)
            assert r.status_code == 200 and r.json() == {"accepted": len(batch)}, r.text

        post(0, 10)
        # the window's gauges appear with the control plane's first decision (its timer's
        # first step): wait for it, so that both scrapes see the same families
        deadline = time.monotonic() + 30
        while sc.state()["window"] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sc.state()["window"] is not None
        early = httpx.get(sc.url + "/metrics", timeout=30).text
        for n0 in range(10, 1000, 165):
            post(n0, min(1000, n0 + 165))
        late = httpx.get(sc.url + "/metrics", timeout=30).text
        assert _series(late) == _series(early)
        assert "agent-" not in late and "tool-" not in late
        assert f'{P}tool_duration_seconds_count{{status="ok"}} 1000.0' in late
        assert f"{P}tools_queued 0.0" in late
        for lim in ("window", "cpu", "kv"):
            assert f'{P}window_limit{{limit="{lim}"}}' in late
