"""``mars-vllm serve`` under attack and failure, on the real stack (issue #13): the API key
guards the sidecar and the engine alike, the engine's gauges return to idle, an engine death
answers 503 + Retry-After and fails the command, no process outlives the server however it
ends, SIGTERM drains, and no socket file is left behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import psutil

from tests.conftest import engine_server, proc_label, read_events, wait_gone

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.engine

MODEL = "mars-tiny"
KEY = "sk-lifecycle"
AUTH = {"authorization": f"Bearer {KEY}"}
EVENTS_KEY = "sk-tools"


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]




def _ipc_path(srv) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"mars-engine-{srv.port}.ipc")


def _stream(url: str, job: str, max_tokens: int, on_chunk=None,
            usage: dict | None = None) -> tuple[int, list[dict], str]:
    """Stream a completion; returns (chunks, error events, finish reason). A chunk can carry
    several tokens (the API server merges what arrived together when it falls behind, as on
    two busy cores): ``usage``, when given, receives the server's token counts."""
    chunks, errors, finish = 0, [], ""
    with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=120, json={
            "model": MODEL, "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": usage is not None},
            "vllm_xargs": {"job_id": job}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                errors.append(data["error"])
                continue
            if not data.get("choices"):  # the usage chunk
                if usage is not None and data.get("usage"):
                    usage.update(data["usage"])
                continue
            chunks += 1
            finish = data["choices"][0].get("finish_reason") or finish
            if on_chunk is not None:
                on_chunk(chunks)
    return chunks, errors, finish


@pytest.fixture(scope="module")
def keyed():
    with engine_server(["--api-key", KEY, "--mars-events-api-key", EVENTS_KEY]) as srv:
        yield srv


def test_api_key_guards_sidecar_and_engine(keyed):
    url = keyed.url
    for path in ("/v1/mars/state", "/v1/mars/sessions", "/v1/models", "/metrics"):
        assert httpx.get(url + path, timeout=10).status_code == 401, path
        assert httpx.get(url + path, headers=AUTH, timeout=10).status_code == 200, path
    # the engine behind the sidecar has the key too (the sidecar is not the only guard)
    assert httpx.get(keyed.engine_url + "/v1/models", timeout=10).status_code == 401
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "vllm_xargs": {"job_id": "k"}}
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
    st = httpx.get(url + "/v1/mars/state", headers=AUTH, timeout=10).json()
    assert st["admitted"] == 0 and st["inflight"] == 0  # the 401 took no slot
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_every_control_endpoint_needs_its_key(keyed):
    """No key: the stream, a session's end and event posts are refused; the tool runners'
    key posts tool events only (not session_end, not generation, not the state)."""
    url, tools = keyed.url, {"authorization": f"Bearer {EVENTS_KEY}"}
    start = [{"kind": "tool_start", "ts": time.time(), "session_id": "k2", "tool": "bash"}]
    end = [{"kind": "session_end", "ts": time.time(), "session_id": "k2", "reason": "deleted"}]
    assert httpx.get(url + "/v1/mars/events/stream", timeout=10).status_code == 401
    assert httpx.delete(url + "/v1/mars/sessions/k", timeout=10).status_code == 401
    assert httpx.post(url + "/v1/mars/events", json=start, timeout=10).status_code == 401
    r = httpx.post(url + "/v1/mars/events", json=start, headers=tools, timeout=10)
    assert r.status_code == 200 and r.json() == {"accepted": 1}
    assert httpx.post(url + "/v1/mars/events", json=end, headers=tools,
                      timeout=10).status_code == 403
    assert httpx.get(url + "/v1/mars/state", headers=tools, timeout=10).status_code == 401
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "vllm_xargs": {"job_id": "k2"}}
    assert httpx.post(url + "/v1/completions", json=body, headers=tools,
                      timeout=60).status_code == 401
    assert httpx.post(url + "/v1/mars/events", json=end, headers=AUTH,
                      timeout=10).status_code == 200
    assert httpx.delete(url + "/v1/mars/sessions/nobody", headers=AUTH,
                        timeout=10).status_code == 404


def test_engine_gauges_return_to_idle(keyed):
    """The engine snapshots its KV pool while it steps; once its last call ends it stops
    stepping, so it must publish the idle state then (or gauges keep the load forever)."""
    usage: dict = {}
    chunks, errors, finish = _stream(keyed.url, "idle-1", 300, usage=usage)
    assert usage.get("completion_tokens") == 300 and finish == "length" and not errors, \
        (chunks, usage, errors)

    def last_snapshot():
        snaps = read_events(keyed.events_file, "kv_snapshot")
        return snaps[-1] if snaps else None

    deadline = time.monotonic() + 60  # a bound, not a pace: it returns when published
    while time.monotonic() < deadline:
        snap = last_snapshot()
        if snap is not None and snap["running"] == 0:
            break
        time.sleep(0.1)
    assert snap is not None and snap["running"] == 0 and snap["waiting"] == 0, snap
    assert snap["used_blocks"] == snap["pinned_blocks"] == 0, snap
    sig = httpx.get(keyed.url + "/v1/mars/state", headers=AUTH, timeout=10).json()["signals"]
    assert sig["engine_running"] == 0, sig


def test_engine_death_is_503_and_a_failing_exit(keyed):
    """Kill the EngineCore with a stream and a buffered call in flight: both end with 503 +
    Retry-After (a stream whose headers went out: an SSE error event with code 503), the
    command exits 1, nothing is left running and the events socket file is gone.

    The EngineCore is stopped (SIGSTOP) before the calls are sent and killed once the
    sidecar has forwarded both: "in flight" is then certain, whatever the machine's load
    (on two busy cores vLLM's API server can take a call only after a running one ends).
    """
    procs = _tree(keyed.proc.pid)
    engine = [p for p in procs if "EngineCore" in proc_label(p)]
    assert engine, [p.name() for p in procs]
    got: dict[str, dict] = {}

    def call(name: str, stream: bool) -> None:
        try:
            with httpx.stream("POST", keyed.url + "/v1/completions", headers=AUTH, timeout=120,
                              json={"model": MODEL, "prompt": [5, 6], "max_tokens": 200,
                                    "stream": stream, "vllm_xargs": {"job_id": name}}) as r:
                body = r.read().decode()
                got[name] = {"status": r.status_code, "retry": r.headers.get("retry-after"),
                             "body": body}
        except Exception as exc:  # noqa: BLE001 - reported by the asserts
            got[name] = {"exc": repr(exc)}

    engine[0].suspend()
    threads = [threading.Thread(target=call, args=("death-b", False)),
               threading.Thread(target=call, args=("death-s", True))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if httpx.get(keyed.url + "/v1/mars/state", headers=AUTH).json()["inflight"] == 2:
            break
        time.sleep(0.05)
    engine[0].kill()
    for t in threads:
        t.join(60)
    b, st = got.get("death-b", {}), got.get("death-s", {})
    assert b.get("status") == 503 and b["retry"], got
    assert json.loads(b["body"])["error"]["code"] == 503
    assert "engine died" in b["body"]
    if st.get("status") == 200:  # the stream had started: an error event ends it
        errors = [json.loads(line[6:])["error"] for line in st["body"].splitlines()
                  if line.startswith('data: {"error"')]
        assert errors and errors[0]["code"] == 503 and "engine died" in errors[0]["message"], st
    else:
        assert st.get("status") == 503 and st["retry"], got
    assert keyed.proc.wait(timeout=60) == 1, keyed.tail()
    assert not wait_gone(procs, 15)
    assert not os.path.exists(_ipc_path(keyed))


def test_killed_server_leaves_no_orphans():
    """SIGKILL the ``mars-vllm serve`` process itself with a stream in flight: its
    EngineCore, the worker and the sidecar follow it within seconds (parent-death signals),
    not after draining the stream for --shutdown-timeout.

    The EngineCore is stopped (SIGSTOP) before the call: the stream is then certainly in
    flight when the server dies (on two busy cores the tiny model can produce a whole
    stream before the client reads its first chunk)."""
    with engine_server() as srv:
        procs = _tree(srv.proc.pid)
        assert len(procs) >= 3, [p.name() for p in procs]  # server, sidecar, engine, ...
        engine = [p for p in procs if "EngineCore" in proc_label(p)]
        assert engine, [p.name() for p in procs]
        engine[0].suspend()
        ended: list[str] = []

        def stream() -> None:
            try:  # the sidecar may still end the stream with its own 503 error event
                _, errors, finish = _stream(srv.url, "orphan-1", 15000)
                ended.append("complete" if finish == "length" and not errors else "cut")
            except Exception as exc:  # noqa: BLE001 - or the connection breaks
                ended.append(type(exc).__name__)

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and httpx.get(
                srv.url + "/v1/mars/state", timeout=10).json()["inflight"] < 1:
            time.sleep(0.05)
        # vLLM's ZeroMQ sockets are in the server's own folder (not /tmp), where the killed
        # processes leave them
        folder = os.path.dirname(srv.log_path)
        socks = [p for p in Path(folder).iterdir() if p.is_socket()]
        assert socks, os.listdir(folder)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(timeout=10)
        left = wait_gone(procs, 20)
        assert not left, (left, [(p.pid, p.name()) for p in procs])
        t.join(30)
        assert ended and ended[0] != "complete", ended
    # and stopping the server removed them
    assert [p for p in socks if p.exists()] == []


def test_sigterm_past_the_drain_bound_aborts_and_exits_0():
    """A stream longer than --shutdown-timeout is ended when the bound passes -- with an
    SSE error event (code 503) within seconds, not left hanging until the client's own
    timeout (vLLM alone left it hanging 60 s) -- and that is the requested shutdown, not an
    engine death: exit status 0."""
    with engine_server(["--shutdown-timeout", "1"]) as srv:
        procs = _tree(srv.proc.pid)
        t0: list[float] = []

        def on_chunk(n: int) -> None:
            if n == 20:
                srv.proc.send_signal(signal.SIGTERM)
                t0.append(time.monotonic())
                # stop reading for a while: the socket buffers fill, the server's writes
                # wait, and its event loop runs the shutdown (on two busy cores a stream
                # read as fast as it comes can keep vLLM's loop from it until the end)
                time.sleep(5)

        chunks, errors, _ = _stream(srv.url, "overrun-1", 15000, on_chunk)
        assert t0 and chunks < 15000, chunks
        assert errors and errors[0]["code"] == 503, errors
        assert "shutting down" in errors[0]["message"]
        assert time.monotonic() - t0[0] < 30  # ended by the server, not by a client timeout
        assert srv.proc.wait(timeout=60) == 0, srv.tail()
        assert not wait_gone(procs, 20)


def test_sigterm_drains_in_flight_streams():
    """SIGTERM to ``mars-vllm serve`` (what docker, Kubernetes and systemd with
    ``KillMode=mixed`` send): a stream already running is finished, not cut, within the
    drain bound, a new call meanwhile gets 503; the command exits 0 and leaves nothing
    behind."""
    with engine_server(["--shutdown-timeout", "60"]) as srv:
        procs = _tree(srv.proc.pid)
        sent: list[float] = []

        late: dict = {}

        def on_chunk(n: int) -> None:
            if n == 20:
                srv.proc.send_signal(signal.SIGTERM)
                sent.append(time.monotonic())
                time.sleep(1)  # (not reading: the server's loop is free to start the drain)
                # a new call while draining is refused, not answered with an empty "abort"
                r = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=30, json={
                    "model": MODEL, "prompt": [1, 2], "max_tokens": 3,
                    "vllm_xargs": {"job_id": "late"}})
                late.update(status=r.status_code, retry=r.headers.get("retry-after"),
                            text=r.text)

        chunks, errors, finish = _stream(srv.url, "drain-1", 1500, on_chunk)
        # finished at its max_tokens (chunks can merge tokens while the client pauses)
        assert sent and not errors and finish == "length", (chunks, errors, finish)
        assert late.get("status") == 503 and late["retry"], late
        assert srv.proc.wait(timeout=90) == 0, srv.tail()
        assert not wait_gone(procs, 20)
        assert not os.path.exists(_ipc_path(srv))
        # after the drain the public port is closed
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url + "/v1/models", timeout=2)


def test_taken_public_port_fails_at_once_before_the_engine_loads():
    """The public port is bound by ``mars-vllm serve`` itself, before the engine: a taken
    port is one clear line and status 1 within seconds. (The sidecar used to bind it after
    the engine had loaded, failed, and left the engine serving nobody: a harness waiting
    for the port waited its whole start-up timeout.)"""
    import socket
    import subprocess

    from mars.launch import _bin, clean_environ

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([_bin("mars-vllm"), "serve", "--host", "127.0.0.1", "--port",
                            str(port)], capture_output=True, text=True, timeout=120,
                           env=clean_environ())
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"mars-vllm: cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "EngineCore" not in r.stderr  # failed before any engine started


def test_a_dead_sidecar_takes_the_server_down(monkeypatch):
    """The sidecar is the server's front door: if it dies, the engine alone behind it serves
    nobody, so the command ends with status 1 and leaves no process behind.

    The harness picks the server's ports; here the first pick is a port already taken (as
    another server starting on the same machine can take it between the pick and the bind):
    the server says so at once and the harness starts it again on fresh ports."""
    import socket

    from mars import launch

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: next(picks, None) or real())
    with taken, engine_server() as srv:
        assert srv.port != taken.getsockname()[1]
        log = open(srv.log_path).read()
        assert log.count("cannot listen on") == 1 and "Address already in use" in log
        procs = _tree(srv.proc.pid)
        (sidecar,) = [p for p in procs if "mars.cli.sidecar" in proc_label(p)]
        sidecar.kill()
        assert srv.proc.wait(timeout=60) == 1, srv.tail()
        assert "the sidecar exited with status -9" in srv.tail(200)
        assert not wait_gone(procs, 20)
        assert not os.path.exists(_ipc_path(srv))


def test_a_sidecar_dead_during_start_up_fails_the_command(tmp_path):
    """The sidecar killed while the engine is still starting (vLLM importing, the model
    loading): the command exits 1, like a sidecar failure later on, not -15 (the watcher's
    SIGTERM used to find no handler yet), and leaves no process behind."""
    import subprocess

    from mars.launch import _bin, clean_environ, free_port

    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([_bin("mars-vllm"), "serve", "--host", "127.0.0.1",
                                 "--port", str(free_port())], stdout=out,
                                stderr=subprocess.STDOUT, env=clean_environ(),
                                start_new_session=True)
    try:
        sidecar = None
        deadline = time.monotonic() + 120
        while sidecar is None and proc.poll() is None and time.monotonic() < deadline:
            sidecar = next((p for p in _tree(proc.pid)[1:]
                            if "mars.cli.sidecar" in proc_label(p)), None)
            time.sleep(0.05)
        assert sidecar is not None, log.read_text()[-3000:]
        procs = {p.pid: p for p in _tree(proc.pid)}
        sidecar.kill()
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            # every process the server had until it exited (engine processes may start late)
            try:
                procs.update((p.pid, p) for p in _tree(proc.pid))
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.1)
        assert proc.wait(timeout=5) == 1, log.read_text()[-3000:]
        text = log.read_text()
        assert "the sidecar exited with status -9" in text, text[-3000:]
        assert "Application startup complete" not in text  # it died during start-up
        assert not wait_gone(list(procs.values()), 20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_group_sigterm_drains_like_a_sigterm_to_the_server():
    """SIGTERM to the whole process group (Ctrl-C in a terminal, ``kill -TERM -PGID``): the
    same drain as SIGTERM to the server. The stream in flight finishes; the sidecar, which
    dies of the signal once its own drain is over, is not a failed sidecar (no failure line,
    no second signal into the engine's teardown); exit status 0; nothing left behind. vLLM's
    worker used to hear the group's signal and exit at once: an engine death mid-drain."""
    with engine_server(["--shutdown-timeout", "60"]) as srv:
        procs = _tree(srv.proc.pid)
        engine = [p for p in procs if p.name().startswith("VLLM::")]  # EngineCore, Worker
        assert len(engine) >= 2 and all(os.getpgid(p.pid) != srv.proc.pid for p in engine), \
            [(p.pid, p.name(), os.getpgid(p.pid)) for p in procs]
        sent: list[float] = []

        def on_chunk(n: int) -> None:
            if n == 20:
                os.killpg(srv.proc.pid, signal.SIGTERM)
                sent.append(time.monotonic())
                time.sleep(1)  # (not reading: the server's loop is free to start the drain)

        chunks, errors, finish = _stream(srv.url, "group-drain-1", 1500, on_chunk)
        assert sent and not errors and finish == "length", (chunks, errors, finish)
        assert srv.proc.wait(timeout=90) == 0, srv.tail()
        log = srv.tail(400)
        assert "the sidecar exited with status" not in log, log[-3000:]
        assert "the sidecar was stopped" not in log, log[-3000:]
        assert "engine died" not in log, log[-3000:]
        assert not wait_gone(procs, 20)
