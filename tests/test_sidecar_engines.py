"""One sidecar in front of two engines (issue #34, the external load-balancing shape):
``mars sidecar --upstream URL1,URL2`` before two ``mars-vllm serve --no-sidecar`` servers on
the emulated GPU. What each engine served is read from that engine's own events."""

from __future__ import annotations

import zlib

import httpx
import pytest

from tests.conftest import read_events, wait_for_events

pytestmark = pytest.mark.engine

GPU, MODEL = "h100-nvl", "qwen3-coder-30b-a3b"
SERVED = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
SESSIONS = 6


@pytest.fixture(scope="module")
def stack():
    pytest.importorskip("vllm")
    from mars.launch import ServerProcess
    from mars.sidecar.process import SidecarProcess

    a = ServerProcess(args=["--emulate", f"{GPU}:{MODEL}", "--policy", "mars",
                            "--no-sidecar"]).start()
    try:
        b = ServerProcess(args=["--emulate", f"{GPU}:{MODEL}", "--policy", "mars",
                                "--no-sidecar"]).start()
    except BaseException:
        a.stop()
        raise
    sc = None
    try:
        sc = SidecarProcess(f"{a.url},{b.url}", args=["--placement", "mars"]).start()
        yield a, b, sc
    finally:
        if sc is not None:
            sc.stop()
        b.stop()
        a.stop()


def _round(url: str, sid: str, rnd: int, last: bool = False) -> httpx.Response:
    # each session its own context, growing by round (token ids in the vocabulary of the
    # embedded tokenizer the emulated model is served with)
    seed = zlib.crc32(sid.encode())
    base = [100 + (seed + i * 104729) % 800 for i in range(400)]
    prompt = base + [7] * (50 * rnd)
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": SERVED, "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
        "vllm_xargs": {"job_id": sid, "round": rnd, "last_round": last}})


def _sessions_by_engine(*servers) -> list[dict[str, set[int]]]:
    out = []
    for srv in servers:
        got: dict[str, set[int]] = {}
        for ev in read_events(srv.events_file, "gpu_submit"):
            if ev.get("session_id"):
                got.setdefault(ev["session_id"], set()).add(ev.get("round"))
        out.append(got)
    return out


def test_every_round_of_a_session_lands_on_one_engine_and_both_serve(stack):
    a, b, sc = stack
    sids = [f"dp-s{i}" for i in range(SESSIONS)]
    for rnd in range(3):
        for sid in sids:
            r = _round(sc.url, sid, rnd)
            assert r.status_code == 200, r.text
    wait_for_events(b.events_file, lambda e: e["kind"] == "gpu_end")
    on_a, on_b = _sessions_by_engine(a, b)
    # every session on exactly one engine, all three rounds there
    for sid in sids:
        assert (sid in on_a) != (sid in on_b), (sid, on_a, on_b)
        assert (on_a.get(sid) or on_b.get(sid)) == {0, 1, 2}
    # placement spread them: each engine serves some (equal engines, equal sessions)
    assert on_a and on_b, (on_a, on_b)
    st = sc.state()
    pl = st["placement"]
    assert pl["placement"] == "mars" and pl["moves"] == 0 and pl["switches"] == 0
    assert [e["rank"] for e in pl["engines"]] == [0, 1]
    assert all(e["alive"] for e in pl["engines"])
    # each engine's control plane admitted the sessions placed on it, no more
    assert {e["rank"]: e["admitted"] for e in pl["engines"]} == {0: len(on_a), 1: len(on_b)}
    view = httpx.get(sc.url + "/v1/mars/sessions", timeout=10).json()["sessions"]
    assert {s["session_id"]: s["engine"] for s in view} == {
        **{sid: 0 for sid in on_a}, **{sid: 1 for sid in on_b}}


def test_a_dead_engines_sessions_move_and_are_counted(stack):
    a, b, sc = stack
    on_a, on_b = _sessions_by_engine(a, b)
    moving = sorted(sid for sid in on_b if sid.startswith("dp-s"))
    assert moving, on_b
    b.stop()  # engine 1 gone
    for sid in moving:
        r = _round(sc.url, sid, 3)
        assert r.status_code == 200, r.text  # served by engine 0 instead, in the same call
    wait_for_events(a.events_file, lambda e: e["kind"] == "gpu_end" and
                    e.get("session_id") == moving[-1])
    now_a = _sessions_by_engine(a)[0]
    for sid in moving:
        assert 3 in now_a.get(sid, set()), (sid, now_a)
    pl = sc.state()["placement"]
    assert pl["moves"] == len(moving), pl
    assert [e["alive"] for e in pl["engines"]] == [True, False]
    metrics = httpx.get(sc.url + "/metrics", timeout=10).text
    assert f"mars_sidecar_session_moves_total {float(len(moving))}" in metrics
    # the sessions that stayed on engine 0 are not moved, and new ones go there
    r = _round(sc.url, "dp-new", 0)
    assert r.status_code == 200, r.text
    assert sc.state()["placement"]["moves"] == len(moving)


def test_bad_upstream_lists_are_refused_with_a_clear_line():
    import subprocess
    import sys

    for args, msg in (
            (["--upstream", "http://127.0.0.1:1,http://127.0.0.1:1"], "named twice"),
            (["--upstream", "http://127.0.0.1:1,"], "empty entry"),
            (["--upstream", "http://127.0.0.1:1,http://127.0.0.1:2", "--engine-events",
              "ipc:///tmp/x.ipc"], "one per upstream"),
            (["--upstream", "http://127.0.0.1:1,http://127.0.0.1:2", "--engine-events",
              "ipc:///tmp/x.ipc,ipc:///tmp/x.ipc"], "share one engine event endpoint"),
            (["--upstream", "http://127.0.0.1:1,ftp://x"], "http(s) URL")):
        r = subprocess.run([sys.executable, "-m", "mars.cli.sidecar", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
