"""Placement across several engines in a real ``mars sidecar`` process, in front of stand-in
engines (plain HTTP servers that answer completions and say which sessions they served):
the queue-full, dead-engine and per-call paths, which need engines that can be stopped and
started at will. The same sidecar in front of two real (emulated-GPU) vLLM engines is in
tests/test_sidecar_engines.py."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

httpx = pytest.importorskip("httpx")

from mars.launch import free_port  # noqa: E402
from mars.protocol.events import parse_event  # noqa: E402
from mars.sidecar.process import SidecarProcess  # noqa: E402


class FakeEngine:
    """An OpenAI-shaped server on a fixed port that records the session of every call."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.sessions: list[str] = []
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeEngine":
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": []})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                engine.sessions.append(body.get("vllm_xargs", {}).get("job_id"))
                self._send(200, {"id": "c", "object": "text_completion", "choices": [
                    {"index": 0, "text": "ok", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _call(url: str, sid: str, rnd: int = 0, last: bool = False, timeout: float = 30):
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 1,
        "vllm_xargs": {"job_id": sid, "round": rnd, "last_round": last}})


def _placement(sc: SidecarProcess) -> dict:
    return sc.state()["placement"]


def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _publish_pools(pubs, free, batch_share=None) -> None:
    """Each stand-in engine's start and a pool of 1,000 blocks with ``free[r]`` free (and
    the share of its decode step that grows with the batch, ``batch_share[r]``)."""
    now = time.time()
    for r, pub in enumerate(pubs):
        pub.publish({"kind": "scheduler_start", "ts": now, "scheduler_cls": "fake",
                     "policy": "mars", "total_blocks": 1000, "block_size": 16, "pid": 1})
        pub.publish({"kind": "kv_snapshot", "ts": now, "total_blocks": 1000,
                     "free_blocks": free[r], "used_blocks": 1000 - free[r],
                     "running": 1, "waiting": 0,
                     **({"batch_share": batch_share[r]} if batch_share else {})})


@pytest.fixture
def engines():
    es = [FakeEngine().start(), FakeEngine().start()]
    yield es
    for e in es:
        e.stop()


def _sidecar(engines, tmp_path, *args: str) -> SidecarProcess:
    """Not started: ``with`` starts and stops it."""
    return SidecarProcess(",".join(e.url for e in engines), args=[
        "--engine-events", "none", "--events-file", str(tmp_path / "events.jsonl"), *args])


def test_a_refused_call_leaves_no_placement_behind(engines, tmp_path):
    """One slot and one queue place per engine: the fifth session finds both queues full
    and gets 429, and is then not counted on the engine that refused it."""
    with _sidecar(engines, tmp_path, "--max-window", "1", "--max-queue", "1",
                  "--admission-timeout", "60") as sc, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert _call(sc.url, "s1").status_code == 200  # engine 0's slot
        assert _call(sc.url, "s2").status_code == 200  # engine 1's: it had fewer sessions
        assert (engines[0].sessions, engines[1].sessions) == (["s1"], ["s2"])
        waiting = [pool.submit(_call, sc.url, sid, 0, False, 60) for sid in ("s3", "s4")]
        assert _until(lambda: sum(e["queued"] for e in _placement(sc)["engines"]) == 2)
        before = [e["placed"] for e in _placement(sc)["engines"]]
        assert before == [2, 2]
        r = _call(sc.url, "s5")
        assert r.status_code == 429, r.text
        assert [e["placed"] for e in _placement(sc)["engines"]] == before
        # a slot comes free on each engine: the queued sessions run where they were placed
        for sid in ("s1", "s2"):
            assert httpx.delete(sc.url + f"/v1/mars/sessions/{sid}", timeout=10).status_code == 200
        assert [f.result(timeout=60).status_code for f in waiting] == [200, 200]
        assert sorted(engines[0].sessions + engines[1].sessions) == ["s1", "s2", "s3", "s4"]
        assert len(engines[0].sessions) == len(engines[1].sessions) == 2
        assert _placement(sc)["moves"] == 0


def test_a_dead_engines_call_is_served_elsewhere_and_the_engine_comes_back(engines, tmp_path):
    with _sidecar(engines, tmp_path) as sc:
        assert _call(sc.url, "a").status_code == 200
        assert _call(sc.url, "b").status_code == 200
        assert (engines[0].sessions, engines[1].sessions) == (["a"], ["b"])
        engines[1].stop()
        r = _call(sc.url, "b", 1)
        assert r.status_code == 200, r.text  # the same call, served by engine 0
        assert engines[0].sessions == ["a", "b"]
        pl = _placement(sc)
        assert pl["moves"] == 1 and [e["alive"] for e in pl["engines"]] == [True, False]
        metrics = httpx.get(sc.url + "/metrics").text
        assert "mars_sidecar_session_moves_total 1.0" in metrics
        # each engine's gauges under its label: both sessions hold a slot on engine 0 now
        assert 'mars_sidecar_sessions_active{engine="0"} 2.0' in metrics
        assert 'mars_sidecar_sessions_active{engine="1"} 0.0' in metrics
        assert 'mars_sidecar_upstream_up{engine="1"} 0.0' in metrics
        # the session stays on engine 0 from now on
        assert _call(sc.url, "b", 2).status_code == 200
        assert engines[0].sessions == ["a", "b", "b"]
        # engine 1 starts again on its port: the probe finds it, new sessions go there
        engines[1] = FakeEngine(engines[1].port).start()
        assert _until(lambda: all(e["alive"] for e in _placement(sc)["engines"]))
        assert _call(sc.url, "c").status_code == 200
        assert engines[1].sessions == ["c"]
        assert _placement(sc)["moves"] == 1
        # both engines down: a clear 503 once each was tried
        engines[0].stop()
        engines[1].stop()
        r = _call(sc.url, "d")
        assert r.status_code == 503 and "unavailable" in r.text, r.text
        assert [e["alive"] for e in _placement(sc)["engines"]] == [False, False]
    # the merged stream: every event valid, engine-tagged, the move on engine 1's plane
    evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    for ev in evs:
        parse_event(ev)
    moved = [e for e in evs if e["kind"] == "session_end" and e["reason"] == "moved"]
    # b left engine 1 when it died; d was tried on engine 1, then on engine 0
    assert [(e["session_id"], e["engine"]) for e in moved] == [("b", 1), ("d", 1)]
    assert all(e.get("engine") in (0, 1) for e in evs if e["kind"] == "window_update")


def test_a_per_call_placer_switches_sessions_and_counts_it(engines, tmp_path):
    with _sidecar(engines, tmp_path, "--placement", "round_robin") as sc:
        for rnd in range(4):
            assert _call(sc.url, "x", rnd).status_code == 200
        assert (engines[0].sessions, engines[1].sessions) == (["x", "x"], ["x", "x"])
        pl = _placement(sc)
        assert pl["switches"] == 3 and pl["moves"] == 0
        # the session holds a slot on the engine of its latest call only
        assert [e["admitted"] for e in pl["engines"]] == [0, 1]
    evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    switched = [e["engine"] for e in evs if e["kind"] == "session_end"
                and e["reason"] == "switched"]
    assert switched == [0, 1, 0]


def test_each_engine_has_its_own_window_from_its_own_events(engines, tmp_path):
    """Engine 0's events say its KV pool is nearly full, engine 1's that it is nearly empty:
    engine 0's control plane tightens its KV cap and window, engine 1's does not, and a new
    session goes to engine 1."""
    from mars.stream.publisher import EventPublisher

    eps = [f"ipc://{tmp_path}/engine-{r}.ipc" for r in range(2)]
    pubs = [EventPublisher(endpoint=ep) for ep in eps]
    free = (20, 900)

    def publish() -> None:
        _publish_pools(pubs, free, batch_share=(0.7, 0.25))

    sc = SidecarProcess(",".join(e.url for e in engines), args=[
        "--engine-events", ",".join(eps), "--events-file", str(tmp_path / "events.jsonl")])
    try:
        with sc:
            def seen() -> bool:
                publish()  # (a subscriber misses what was published before it connected)
                util = [e["signals"]["kv_utilisation"] for e in _placement(sc)["engines"]]
                return None not in util and util == pytest.approx([0.98, 0.1])
            assert _until(seen), _placement(sc)["engines"]
            # each engine's own decision (the control step runs on the sidecar's timer)
            assert _until(lambda: (lambda es: es[0]["kv_cap"] is not None
                                   and es[0]["kv_cap"] < es[1]["kv_cap"]
                                   and es[0]["budget"] < es[1]["budget"])(
                _placement(sc)["engines"])), _placement(sc)["engines"]
            assert _call(sc.url, "new").status_code == 200
            assert (engines[0].sessions, engines[1].sessions) == ([], ["new"])
            metrics = dict(line.rsplit(" ", 1) for line in
                           httpx.get(sc.url + "/metrics").text.splitlines()
                           if line.startswith("mars_sidecar_kv_utilisation{"))
            assert {k: float(v) for k, v in metrics.items()} == pytest.approx({
                'mars_sidecar_kv_utilisation{engine="0"}': 0.98,
                'mars_sidecar_kv_utilisation{engine="1"}': 0.1})
            # each engine's fitted batch share, from its own snapshots (and no host tier:
            # no engine share)
            text = httpx.get(sc.url + "/metrics").text
            shares = dict(line.rsplit(" ", 1) for line in text.splitlines()
                          if line.startswith("mars_sidecar_engine_batch_share{"))
            assert {k: float(v) for k, v in shares.items()} == pytest.approx({
                'mars_sidecar_engine_batch_share{engine="0"}': 0.7,
                'mars_sidecar_engine_batch_share{engine="1"}': 0.25})
            assert "mars_sidecar_engine_share{" not in text
    finally:
        for pub in pubs:
            pub.close()


def test_a_queued_session_moves_to_the_engine_that_can_admit_it(engines, tmp_path):
    """MARS placement's late binding, served: with both pools nearly full, a new session
    waits at engine 0's door (a session admitted there holds off the packer's progress
    rule); when engine 1 reports room, the waiting call moves with its session to engine 1
    and is served there, and the stream says so (``session_end`` ``requeued`` on engine 0,
    ``session_admit`` on engine 1)."""
    from mars.stream.publisher import EventPublisher

    eps = [f"ipc://{tmp_path}/engine-{r}.ipc" for r in range(2)]
    pubs = [EventPublisher(endpoint=ep) for ep in eps]
    free = [900, 900]

    def publish() -> None:
        _publish_pools(pubs, free)

    def utilisation() -> list:
        return [e["signals"]["kv_utilisation"] for e in _placement(sc)["engines"]]

    sc = SidecarProcess(",".join(e.url for e in engines), args=[
        "--engine-events", ",".join(eps), "--events-file", str(tmp_path / "events.jsonl")])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        with sc:
            assert _until(lambda: publish() or utilisation() == pytest.approx([0.1, 0.1]))
            # one session admitted on each engine, open (not their last rounds)
            assert _call(sc.url, "h0").status_code == 200
            assert _call(sc.url, "h1").status_code == 200
            assert (engines[0].sessions, engines[1].sessions) == (["h0"], ["h1"])
            free[:] = [20, 20]
            assert _until(lambda: publish() or utilisation() == pytest.approx([0.98, 0.98]))
            waiting = pool.submit(_call, sc.url, "late", 0, True)
            assert _until(lambda: [e["queued"] for e in _placement(sc)["engines"]] == [1, 0])
            assert not waiting.done()
            free[1] = 900  # engine 1 has room now; engine 0 still has none
            assert _until(lambda: publish() or waiting.done(), timeout_s=30)
            assert waiting.result().status_code == 200
            assert (engines[0].sessions, engines[1].sessions) == (["h0"], ["h1", "late"])
            assert "mars_sidecar_session_rebinds_total 1.0" in httpx.get(sc.url + "/metrics").text
            assert _placement(sc)["rebinds"] == 1 and _placement(sc)["moves"] == 0
        events = [json.loads(line) for line in
                  (tmp_path / "events.jsonl").read_text().splitlines()]
        late = [parse_event(e) for e in events if e.get("session_id") == "late"
                and e["kind"] in ("session_end", "session_admit")]
        late = [(e.kind, getattr(e, "reason", None), e.engine) for e in late]
        assert late == [("session_end", "requeued", 0), ("session_admit", None, 1),
                        ("session_end", "last_round", 1)], late
    finally:
        pool.shutdown(wait=False)
        for pub in pubs:
            pub.close()


@pytest.mark.parametrize("args,msg", [
    (["--upstream", "http://127.0.0.1:1,http://127.0.0.1:1"], "named twice"),
    (["--upstream", "http://127.0.0.1:1,"], "empty entry"),
    (["--upstream", "http://127.0.0.1:1,ftp://x"], "http(s) URL"),
    (["--upstream", "http://127.0.0.1:1,http://127.0.0.1:2", "--engine-events",
      "ipc:///tmp/x.ipc"], "give one per engine"),
    (["--upstream", "http://127.0.0.1:1,http://127.0.0.1:2", "--engine-events",
      "ipc:///tmp/x.ipc,ipc:///tmp/x.ipc"], "share one engine event endpoint"),
    (["--upstream", "http://127.0.0.1:1,http://127.0.0.1:2", "--data-parallel-size", "2"],
     "give one or the other"),
    (["--upstream", "http://127.0.0.1:1", "--data-parallel-size", "0"], ">= 1"),
    (["--upstream", "http://127.0.0.1:1", "--data-parallel-size", "2", "--engine-events",
      "ipc:///tmp/a.ipc,ipc:///tmp/b.ipc,ipc:///tmp/c.ipc"], "give one per engine"),
])
def test_bad_upstream_lists_are_refused_with_a_clear_line(args, msg):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mars.cli.sidecar", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_upstream_on_another_host_without_its_events_endpoint_is_warned(capsys):
    """Its engine events cannot come over the ipc socket derived here; a named endpoint (or
    none) is what the operator meant, and says nothing."""
    import argparse

    from mars.cli.sidecar import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--upstream", "http://127.0.0.1:1,http://10.0.0.2:8000"]))
    err = capsys.readouterr().err
    assert "http://10.0.0.2:8000 is not on this host" in err and "--engine-events" in err
    assert cfg.engines_events[1].startswith("ipc://")  # still served (a warning, not a refusal)
    config_from_args(parser.parse_args(["--upstream", "http://10.0.0.2:8000", "--engine-events",
                                        "tcp://10.0.0.2:5600"]))
    config_from_args(parser.parse_args(["--upstream", "http://localhost:8000"]))
    assert capsys.readouterr().err == ""
