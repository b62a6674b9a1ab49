"""``mars top``: the model on plain events, one frame of a real sidecar, and the live view in a
tmux pane as a person runs it (keys, quitting, a sidecar that goes away). Its run against a
real engine under a replay is in tests/test_replay_engine.py (that module's server)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from mars.launch import free_port
from mars.top.model import FILTERS, SORTS, TopModel
from tests.tmux import mars_top


def _state(**kw):
    return {"admission": "on", "window": 8.0, "budget": 8, "cpu_cap": 3.0, "kv_cap": 12.0,
            "binding": "cpu", "mode": "hold", "reason": "healthy 1/3", "admitted": 2, "queued": 1, "inflight": 1,
            "signals": {"total_blocks": 100, "used_blocks": 60, "pinned_blocks": 20,
                        "free_blocks": 40, "active_tools": 1, "tool_cores": 2}, **kw}


SESSIONS = [{"session_id": "a", "state": "admitted", "inflight": 1, "requests": 3, "age_s": 30},
            {"session_id": "b", "state": "admitted", "inflight": 0, "requests": 2, "age_s": 50},
            {"session_id": "c", "state": "admitted", "inflight": 0, "requests": 1, "age_s": 5},
            {"session_id": "d", "state": "queued", "inflight": 0, "requests": 0, "age_s": 2}]


def test_the_model_joins_polled_sessions_with_the_stream():
    m = TopModel()
    m.poll(_state(), SESSIONS)
    assert m.binding() == "CPU cap"
    m.event({"kind": "gpu_submit", "session_id": "a", "request_id": "r1", "prompt_tokens": 900,
             "projected_blocks": 57, "ts": 100.0})
    m.event({"kind": "tool_start", "session_id": "b", "tool": "pytest", "ts": 100.0})
    m.event({"kind": "pin", "session_id": "c", "blocks": 20, "tau_s": 12.0, "ts": 100.0})
    m.event({"kind": "preempt", "session_id": "a", "request_id": "r1", "blocks": 9, "ts": 101.0})
    rows = {r.session_id: r for r in m.rows(now=104.0)}
    assert {k: r.state for k, r in rows.items()} == \
        {"a": "running", "b": "in tool", "c": "pinned", "d": "queued"}
    assert rows["a"].kv_blocks == 57 and rows["a"].preemptions == 1
    assert rows["b"].tool == "pytest" and rows["c"].pin_left_s == 8.0
    assert list(m.recent_preemptions) == [(101.0, "a", 9)]
    # the tool ends, the pin comes back: both rows go idle
    m.event({"kind": "tool_end", "session_id": "b", "tool": "pytest", "duration_s": 3, "ts": 103})
    m.event({"kind": "unpin", "session_id": "c", "blocks": 20, "reason": "resumed", "ts": 103})
    assert {r.session_id: r.state for r in m.rows(now=104.0)}["b"] == "idle"
    assert {r.session_id: r.pin_left_s for r in m.rows(now=104.0)}["c"] is None
    # keys: the sort and the filter cycle through every choice and come back
    assert [r.session_id for r in m.rows(104.0)][0] == "a"  # most KV first
    for _ in SORTS:
        m.next_sort()
    assert m.sort == "context"
    m.next_filter()
    assert m.filter == FILTERS[1] and [r.session_id for r in m.rows(104.0)] == ["a"]
    # what the stream said of a session goes with it: at its end, or once the sidecar no
    # longer lists it (unless it still holds a pin, which the engine will return)
    m.event({"kind": "session_end", "session_id": "a", "reason": "last_round", "ts": 105})
    assert "a" not in m._stream
    m.event({"kind": "gpu_submit", "session_id": "b", "request_id": "r9", "prompt_tokens": 9,
             "projected_blocks": 1, "ts": 105})
    m.event({"kind": "pin", "session_id": "d", "blocks": 4, "tau_s": 30.0, "ts": 105.0})
    m.poll(_state(), [SESSIONS[2]])
    assert set(m._stream) == {"c", "d"}  # b: no longer listed, no pin


def test_a_tool_running_before_the_view_joined_shows_from_the_sidecars_count():
    """The stream tells a tool's name from its tool_start on; a view started mid-tool learns
    only the sidecar's count of the session's running tools, and shows the row in a tool."""
    m = TopModel()
    m.poll(_state(), [{**SESSIONS[1], "tools": 1}, {**SESSIONS[2], "tools": 0}])
    rows = {r.session_id: r for r in m.rows(now=1.0)}
    assert (rows["b"].state, rows["b"].tool) == ("in tool", "?")
    assert (rows["c"].state, rows["c"].tool) == ("idle", None)
    m.event({"kind": "tool_start", "session_id": "c", "tool": "bash", "ts": 1.0})
    assert {r.session_id: r.tool for r in m.rows(now=1.0)}["c"] == "bash"


def test_the_view_draws_client_strings_as_text_never_markup():
    """Session ids and tool names are any client string: ``[/x]`` must not break a frame."""
    from rich.console import Console

    from mars.top.view import frame

    m = TopModel()
    m.poll(_state(), [{"session_id": "a[/x]", "state": "admitted", "inflight": 0},
                      {"session_id": "[red]b", "state": "admitted", "inflight": 0}])
    m.event({"kind": "tool_start", "session_id": "a[/x]", "tool": "[bold]t[/]", "ts": 1.0})
    m.event({"kind": "preempt", "session_id": "[red]b", "blocks": 2, "ts": 1.0})
    c = Console(width=160, record=True)
    c.print(frame(m, "http://h[/]:1", 2.0))
    text = c.export_text()
    assert "a[/x]" in text and "[red]b" in text and "[bold]t[/]" in text and "h[/]" in text


def test_the_header_shows_the_host_tier_and_the_batch_share():
    """With a host tier the header says its size, the engine share each admitted context is
    charged at and how the last step charged them; the engine row, the batch's share of a
    decode step. Without one, neither."""
    from rich.console import Console

    from mars.top.view import header

    def text(state) -> str:
        m = TopModel()
        m.poll(state, [])
        c = Console(width=160, record=True)
        c.print(header(m, "http://h:1"))
        return c.export_text()

    sig = {**_state()["signals"], "batch_share": 0.66}
    on = text(_state(host_blocks=87381, engine_share=0.61, charge="whole", signals=sig))
    assert "host tier" in on and "87381 blocks" in on and "engine share 0.61" in on
    assert "contexts charged whole" in on and "batch share 0.66" in on
    off = text(_state())
    assert "host tier" not in off and "batch share" not in off


def test_answers_not_from_a_sidecar_are_one_clear_line():
    for state, sessions in (([], []), ({}, {"sessions": [1]}), ({}, [{"id": "x"}])):
        with pytest.raises(ValueError):
            TopModel().poll(state, sessions)


def _top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mars.cli", "top", *args],
                          capture_output=True, text=True, timeout=60,
                          env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})


def test_no_server_is_one_clear_line():
    r = _top("--url", f"http://127.0.0.1:{free_port()}", "--once")
    assert r.returncode == 1 and r.stderr.startswith("mars top: no answer from http://127.0.0.1:")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _sidecar():
    from mars.sidecar.process import SidecarProcess

    return SidecarProcess(f"http://127.0.0.1:{free_port()}",
                          ["--admission", "on", "--engine-events", "none"])


def test_once_prints_a_frame_of_a_real_sidecar():
    with _sidecar() as sc:
        httpx.post(sc.url + "/v1/chat/completions", timeout=10,  # upstream down: 503, but the
                   headers={"x-session-id": "agent-7"},        # named session keeps its slot
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        r = _top("--url", sc.url, "--once")
    assert r.returncode == 0, r.stderr
    assert f"mars top  {sc.url}  admission on" in r.stdout
    assert "agent-7" in r.stdout and "binding: " in r.stdout and "admitted 1" in r.stdout


def test_svg_is_one_frame_of_a_real_sidecar_as_an_image(tmp_path):
    """``--svg``: what the README's screenshot is made of -- a well-formed SVG whose text is
    the frame (the admission state, a session it admitted); a path it cannot write, and
    --svg with --once, are one clear line each."""
    import html
    import re
    import xml.etree.ElementTree as ET

    out = tmp_path / "top.svg"
    with _sidecar() as sc:
        httpx.post(sc.url + "/v1/chat/completions", timeout=10,
                   headers={"x-session-id": "agent-7"},
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        r = _top("--url", sc.url, "--svg", str(out), "--interval", "0.2")
        assert r.returncode == 0 and f"wrote {out}" in r.stderr, r.stderr
        root = ET.parse(out).getroot()
        bad = _top("--url", sc.url, "--svg", str(tmp_path / "missing" / "top.svg"),
                   "--interval", "0.1")
    assert root.tag.endswith("svg")
    text = html.unescape("".join(re.findall(r">([^<]*)</text>", out.read_text())))
    text = text.replace("\xa0", " ")
    assert "admission on" in text and "admitted 1" in text and "agent-7" in text, text
    assert bad.returncode == 1 and bad.stderr.startswith("mars top: cannot write "), bad.stderr
    assert "Traceback" not in bad.stderr
    both = _top("--url", sc.url, "--svg", str(out), "--once")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_live_view_keys_and_a_sidecar_that_goes_away(tmp_path):
    """In a tmux pane: the stream's tool events show, the keys sort and filter, and when the
    sidecar stops, the view ends with one line saying so (status 1, no traceback)."""
    sc = _sidecar().__enter__()
    try:
        with mars_top(sc.url, tmp_path, "--interval", "0.3") as pane:
            pane.wait_for("stream live")  # subscribed: the hub replays nothing to late comers
            httpx.post(sc.url + "/v1/chat/completions", timeout=10,
                       headers={"x-session-id": "agent-9"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            httpx.post(sc.url + "/v1/mars/events", timeout=10, json=[
                {"kind": "tool_start", "ts": time.time(), "session_id": "agent-9",
                 "tool": "pytest", "call_id": "c1"}])
            screen = pane.wait_for("in tool")
            assert "agent-9" in screen and "pytest" in screen
            pane.keys("s")
            pane.wait_for("sort age")
            pane.keys("f")
            pane.wait_for("show running")
            assert "agent-9" not in pane.capture().split("show running")[1]
            pane.keys("f")
            pane.wait_for("show in tool")
            sc.__exit__(None, None, None)
            assert pane.exit_code() == 1
            err = pane.stderr()
            assert err.startswith("mars top: no answer from ") and "Traceback" not in err
    finally:
        sc.__exit__(None, None, None)


@pytest.mark.parametrize("key", ["q", "C-c"])
def test_q_and_ctrl_c_quit_cleanly_and_give_the_terminal_back(tmp_path, key):
    with _sidecar() as sc, mars_top(sc.url, tmp_path) as pane:
        pane.wait_for("keys: s sort")
        pane.keys(key)
        assert pane.exit_code() == 0 and pane.stderr() == ""
        assert pane.terminal_restored()
