"""Sidecar tests that need no engine: request parsing, and a real sidecar process whose
upstream is a closed port (the "engine down" case) for the bad-input and 503 paths.

The engine-backed behaviour (pass-through, admission, faults with a real vLLM) is in
tests/test_sidecar.py.
"""

from __future__ import annotations

import json
import re
import threading
import time
from functools import partial

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from mars.launch import free_port  # noqa: E402
from mars.sidecar.request import BadRequest, parse_generate  # noqa: E402


# ---------------------------------------------------------------------------- identity
def test_job_id_wins_and_body_is_forwarded_byte_for_byte():
    body = b'{"model": "m", "prompt": "x",  "vllm_xargs": {"job_id": "j1", "round": 2}}'
    req = parse_generate(body, {"x-session-id": "hdr"})
    assert (req.session_id, req.source, req.round) == ("j1", "vllm_xargs", 2)
    assert req.body is body  # no re-serialisation when nothing is injected


@pytest.mark.parametrize("headers,body_sid,expected,source", [
    ({"x-session-id": "a", "x-litellm-session-id": "c"}, None, "a", "x-session-id"),
    ({"x-mars-session-id": "b", "x-litellm-session-id": "c"}, None, "b", "x-mars-session-id"),
    ({"x-litellm-session-id": "c"}, None, "c", "x-litellm-session-id"),
    ({"x-session-id": "a"}, "s", "s", "body"),
])
def test_fallback_ids_are_injected_into_vllm_xargs(headers, body_sid, expected, source):
    obj = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
           "vllm_xargs": {"next_tool": "bash"}}
    if body_sid:
        obj["session_id"] = body_sid
    req = parse_generate(json.dumps(obj).encode(), headers)
    assert (req.session_id, req.source) == (expected, source)
    sent = json.loads(req.body)
    assert sent["vllm_xargs"] == {"next_tool": "bash", "job_id": expected}
    sent["vllm_xargs"].pop("job_id")
    assert sent == obj  # nothing else changed


def test_no_identity_is_a_one_round_session():
    body = b'{"model": "m", "prompt": [1, 2, 3]}'
    req = parse_generate(body, {})
    assert req.session_id is None and req.body is body
    assert req.prompt_tokens == 3


@pytest.mark.parametrize("body,needle", [
    (b"", "empty"),
    (b"{nope", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"vllm_xargs": [1]}', "vllm_xargs must be a JSON object"),
    (b'{"vllm_xargs": {"job_id": ["x"]}}', "job_id"),
    (b'{"vllm_xargs": {"job_id": ""}}', "job_id"),
    (b'{"vllm_xargs": {"job_id": "a", "round": "two"}}', "round"),
    (b'{"vllm_xargs": {"job_id": "a", "last_round": "maybe"}}', "last_round"),
])
def test_bad_requests_are_rejected_with_a_message(body, needle):
    with pytest.raises(BadRequest) as exc:
        parse_generate(body, {})
    assert needle in str(exc.value)


# ---------------------------------------------------------------------------- engine down
@pytest.fixture(scope="module")
def down():
    """A sidecar whose upstream is a closed port: every forward fails to connect."""
    from mars.sidecar.process import SidecarProcess

    with SidecarProcess(f"http://127.0.0.1:{free_port()}",
                        ["--admission", "on", "--engine-events", "none", "--retry-after", "3",
                         "--max-body-bytes", str(1 << 20)]) as sc:
        yield sc


def _error(r) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    assert body["error"]["code"] == r.status_code
    return body["error"]


def test_upstream_down_is_503_with_retry_after(down):
    for _ in range(2):  # and again: nothing leaks between attempts
        r = httpx.post(down.url + "/v1/chat/completions", timeout=10,
                       headers={"x-session-id": "s-down"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert "unavailable" in _error(r)["message"]
    r = httpx.post(down.url + "/v1/completions", timeout=10, json={"model": "m", "prompt": "x"})
    assert r.status_code == 503
    r = httpx.get(down.url + "/v1/models", timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    st = down.state()
    assert st["upstream"]["up"] is False and st["inflight"] == 0
    # the one-round session ended with its request; the named one keeps its slot (an agent
    # retries) until it ends or idles out
    assert st["admitted"] == 1 and st["queued"] == 0
    assert httpx.delete(down.url + "/v1/mars/sessions/s-down").status_code == 200
    assert down.state()["admitted"] == 0
    assert httpx.delete(down.url + "/v1/mars/sessions/s-down").status_code == 404
    health = httpx.get(down.url + "/v1/mars/health").json()
    assert health["status"] == "ok" and health["upstream_up"] is False


def test_malformed_generation_request_is_400_not_forwarded(down):
    r = httpx.post(down.url + "/v1/chat/completions", content=b"{bad json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in _error(r)["message"]
    r = httpx.post(down.url + "/v1/completions", json={"prompt": "x", "vllm_xargs": "j"})
    assert r.status_code == 400 and _error(r)["param"] == "vllm_xargs"


@pytest.mark.parametrize("payload,needle", [
    (b"not json", "malformed JSON"),
    (b"", "empty"),
    (b'"a string"', "list"),
    (json.dumps([{"kind": "tool_start", "ts": 1.0, "session_id": "s", "tool": "bash",
                  "surprise": 1}]).encode(), "surprise"),
    (json.dumps([{"kind": "tool_end", "ts": 1.0, "session_id": "s", "tool": "bash"}]).encode(),
     "tool_end.duration_s: Field required"),
    (json.dumps([{"kind": "no_such_kind", "ts": 1.0}]).encode(), "kind"),
    # non-finite numbers never enter the control state (they used to poison the EMAs)
    (b'[{"kind": "tool_end", "ts": 1.0, "session_id": "s", "tool": "bash", '
     b'"duration_s": Infinity}]', "tool_end.duration_s: Input should be a finite number"),
    (b'[{"kind": "tool_start", "ts": NaN, "session_id": "s", "tool": "bash"}]',
     "tool_start.ts: Input should be a finite number"),
    # nor huge ones: a 400-digit count overflowed every control step; a far-future ts kept
    # a fake tool call open for ever
    (b'[{"kind": "tool_num", "ts": 1.0, "active": 1' + b"0" * 400 + b'}]',
     "tool_num.active: Input should be less than or equal to"),
    (b'[{"kind": "tool_end", "ts": 1.0, "session_id": "s", "tool": "bash", '
     b'"duration_s": 1e300}]', "tool_end.duration_s: Input should be less than or equal to"),
    (b'[{"kind": "tool_start", "ts": 1e300, "session_id": "s", "tool": "bash"}]',
     "tool_start.ts: Input should be less than or equal to"),
    (b'[{"kind": "tool_start", "ts": 5e10, "session_id": "s", "tool": "bash"}]',
     "tool_start.ts: 4"),  # "...: 4xxxxxxxxx s ahead of the sidecar's clock"
    (b'[{"kind": "tool_start", "ts": 1.0, "session_id": "s", "tool": "bash", '
     b'"round": 1' + b"0" * 30 + b'}]', "tool_start.round: Input should be less than"),
    # names are echoed in JSON: a lone surrogate made GET /v1/mars/sessions unencodable
    (b'[{"kind": "tool_start", "ts": 1.0, "session_id": "\\ud800", "tool": "bash"}]',
     "tool_start.session_id: Input should be a valid string"),
    (json.dumps([{"kind": "session_end", "ts": 1.0, "session_id": "x" * 300,
                  "reason": "deleted"}]).encode(), "session_end.session_id: String should"),
    (json.dumps([{"kind": "kv_snapshot", "ts": 1.0, "total_blocks": 1, "free_blocks": 1,
                  "used_blocks": 0}]).encode(), "cannot be posted"),
    # the reasons of a session going on at another engine are the sidecar's own: posted,
    # they ended a session and left its placement behind
    (json.dumps([{"kind": "session_end", "ts": 1.0, "session_id": "s",
                  "reason": "requeued"}]).encode(), "are the sidecar's own"),
])
def test_malformed_events_are_400_and_counted(down, payload, needle):
    r = httpx.post(down.url + "/v1/mars/events", content=payload,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert needle in _error(r)["message"]
    metrics = httpx.get(down.url + "/metrics").text
    assert "mars_sidecar_events_rejected_total" in metrics
    assert httpx.get(down.url + "/v1/mars/health").status_code == 200
    assert httpx.get(down.url + "/v1/mars/state").status_code == 200  # still serialisable
    assert httpx.get(down.url + "/v1/mars/sessions").status_code == 200


def test_tool_events_reach_state_and_stream(down):
    got: list[dict] = []

    def listen():
        with httpx.stream("GET", down.url + "/v1/mars/events/stream",
                          params={"kind": "tool_start,tool_end", "max_events": 2,
                                  "timeout": 20}, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))

    t = threading.Thread(target=listen)
    t.start()
    deadline = time.monotonic() + 10
    while down.state()["stream"]["subscribers"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    now = time.time()
    start = {"kind": "tool_start", "ts": now, "session_id": "agent-1", "tool": "bash",
             "call_id": "c1"}
    r = httpx.post(down.url + "/v1/mars/events", json=[start])
    assert r.status_code == 200 and r.json() == {"accepted": 1}
    assert down.state()["signals"]["active_tools"] == 1
    end = {"kind": "tool_end", "ts": now + 0.5, "session_id": "agent-1", "tool": "bash",
           "call_id": "c1", "duration_s": 0.5}
    assert httpx.post(down.url + "/v1/mars/events", json=end).status_code == 200  # one object
    t.join(timeout=30)
    assert [e["kind"] for e in got] == ["tool_start", "tool_end"]
    sig = down.state()["signals"]
    assert sig["active_tools"] == 0 and sig["tool_duration_ema_s"] == pytest.approx(0.5)
    assert "mars_sidecar_tool_duration_ema_seconds 0.5" in httpx.get(down.url + "/metrics").text


def test_bad_stream_query_is_400(down):
    r = httpx.get(down.url + "/v1/mars/events/stream", params={"max_events": "lots"})
    assert r.status_code == 400 and "max_events" in _error(r)["message"]


def test_hostile_bodies_get_4xx_and_the_sidecar_keeps_serving(down):
    """Deep nesting, lone surrogates and oversized bodies are the client's error (4xx with a
    message), never a 500, and nothing is admitted for them."""
    deep = b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(down.url + "/v1/completions", content=deep,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in _error(r)["message"]
    r = httpx.post(down.url + "/v1/mars/events", content=b"[" * 100_000 + b"]" * 100_000,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in _error(r)["message"]
    # a lone surrogate in a body the sidecar must rewrite (session from the header)
    r = httpx.post(down.url + "/v1/completions", content=b'{"prompt": "\\ud800 hi"}',
                   headers={"content-type": "application/json", "x-session-id": "sur"})
    assert r.status_code == 400 and "surrogate" in _error(r)["message"], r.text
    # ... and in a session id, which the sidecar echoes in its JSON (sessions, events)
    r = httpx.post(down.url + "/v1/completions",
                   content=b'{"prompt": "x", "vllm_xargs": {"job_id": "\\udc00"}}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and _error(r)["param"] == "vllm_xargs.job_id", r.text
    assert httpx.get(down.url + "/v1/mars/sessions").status_code == 200
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    r = httpx.post(down.url + "/v1/completions", content=big,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in _error(r)["message"]
    r = httpx.post(down.url + "/v1/mars/events", content=big,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    st = httpx.get(down.url + "/v1/mars/state").json()
    assert st["admitted"] == 0 and st["queued"] == 0
    assert httpx.get(down.url + "/v1/mars/health").status_code == 200


def _tool_events(n: int) -> bytes:
    return json.dumps([{"kind": "tool_start", "session_id": f"s{i}", "tool": "bash", "ts": 1.0}
                       for i in range(n)]).encode()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_large_bodies_are_parsed_in_a_child_process(loop):
    """Bodies of the threshold and more are parsed by a child process, with the results,
    the errors (with their parameter) and the rewritten body of an on-loop parse; a child
    that dies, idle or half-way through a body with another one queued, is replaced and
    both bodies still parsed; a body too complex for the child's memory is refused. On the
    sidecar's loop (uvloop) and on asyncio's."""
    import asyncio
    import os
    import signal

    from mars.protocol.events import EventError
    from mars.sidecar.body_parser import BodyParser, BodyTooComplex
    from mars.sidecar.request import parse_event_batch

    limit = 64 << 10
    tokens = json.dumps({"model": "m", "prompt": list(range(30_000)),
                         "vllm_xargs": {"job_id": "j", "round": 4}}).encode()
    text = json.dumps({"model": "m", "prompt": "é" * limit}).encode()
    bad = json.dumps({"prompt": "x" * limit, "vllm_xargs": {"job_id": "a", "round": "two"}})
    events = _tool_events(2000)
    restarts: list[int] = []

    async def run() -> None:
        p = BodyParser(threshold_bytes=limit, on_restart=lambda: restarts.append(1))
        try:
            small = await p.generate(b'{"prompt": [1, 2]}', {}, 4.0)
            assert small.prompt_tokens == 2 and p.pid is None  # on the loop
            got = await p.generate(tokens, {}, 4.0)
            child = p.pid
            assert child is not None and child != os.getpid()
            assert (got.session_id, got.round, got.prompt_tokens) == ("j", 4, 30_000)
            assert got.body is tokens  # unchanged: never copied back
            got = await p.generate(text, {"x-session-id": "h"}, 4.0)
            assert got == parse_generate(text, {"x-session-id": "h"}, 4.0)
            with pytest.raises(BadRequest) as exc:
                await p.generate(bad.encode(), {}, 4.0)
            assert exc.value.param == "vllm_xargs.round"
            deep = b'{"prompt": "x", "extra": ' + b"[" * limit + b"]" * limit + b"}"
            with pytest.raises(BadRequest, match="nested too deeply"):
                await p.generate(deep, {}, 4.0)
            with pytest.raises(EventError, match="nested too deeply"):
                await p.events(b"[" * limit + b"]" * limit)
            with pytest.raises(EventError, match="exceeds"):
                await p.events(_tool_events(10_001))
            assert [e.model_dump() for e in await p.events(events)] == \
                [e.model_dump() for e in parse_event_batch(events)]
            assert p.pid == child and not restarts  # errors do not cost the child
            os.kill(child, signal.SIGKILL)  # idle child gone: the next body starts another
            assert (await p.generate(tokens, {}, 4.0)).round == 4
            child = p.pid
            assert child is not None and len(restarts) == 1
            os.kill(child, signal.SIGSTOP)  # held: both parses below are certainly pending
            pending = [asyncio.ensure_future(p.generate(tokens, {}, 4.0)) for _ in range(2)]
            await asyncio.sleep(0.2)
            assert not any(f.done() for f in pending)
            os.kill(child, signal.SIGKILL)
            done = await asyncio.wait_for(asyncio.gather(*pending), 60)
            assert [r.round for r in done] == [4, 4]
            assert p.pid not in (None, child) and len(restarts) == 2
        finally:
            await p.aclose()
        # a body whose parse needs more memory than the child may have: 413, child lives on
        p = BodyParser(threshold_bytes=limit)
        p.memory_bytes = 64 << 20
        try:
            with pytest.raises(BodyTooComplex):
                await p.generate(b'{"prompt": [' + b"{}," * (4 << 20) + b'{}]}', {}, 4.0)
            child = p.pid
            assert (await p.generate(tokens, {}, 4.0)).round == 4 and p.pid == child
        finally:
            await p.aclose()
        with pytest.raises(Exception, match="shutting down"):
            await p.generate(tokens, {}, 4.0)

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(run())
    else:
        asyncio.run(run())


def _children(pid: int, needle: str) -> list[int]:
    """Live children of ``pid`` whose command line contains ``needle``."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and needle in cmd:
            found.append(int(entry))
    return found


def _written(pid: int) -> int:
    """Bytes ``pid`` has written so far, to anything (``/proc/PID/io``)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_large_body_does_not_hold_the_event_loop(down):
    """While a large body is being parsed -- its parser process held stopped, so the parse
    certainly lasts -- the sidecar answers probes, small requests and event posts; the large
    request completes once the parser goes on."""
    import os
    import signal

    big = json.dumps({"model": "m", "prompt": list(range(100_000)),
                      "vllm_xargs": {"job_id": "big", "round": 0}}).encode()
    assert 256 << 10 <= len(big) < 1 << 20  # parsed off the loop, under the fixture's limit
    post = partial(httpx.post, down.url + "/v1/completions", content=big, timeout=60,
                   headers={"content-type": "application/json"})
    assert post().status_code == 503  # parsed, then the (down) engine: the parser runs
    parsers = _children(down.proc.pid, "mars.sidecar.body_parser")
    assert len(parsers) == 1, parsers
    os.kill(parsers[0], signal.SIGSTOP)
    result: list = []
    t = threading.Thread(target=lambda: result.append(post()))
    before = _written(down.proc.pid)
    try:
        t.start()
        # the parse is in flight once the sidecar has handed the parser a good part of the
        # body (it writes nothing else near that size meanwhile)
        assert _wait_for(lambda: _written(down.proc.pid) - before >= 48 << 10, 30), \
            "the sidecar never handed the body to its parser"
        assert httpx.get(down.url + "/v1/mars/health", timeout=10).status_code == 200
        r = httpx.post(down.url + "/v1/mars/events", timeout=10, content=_tool_events(2))
        assert r.status_code == 200 and r.json() == {"accepted": 2}
        r = httpx.post(down.url + "/v1/completions", timeout=10, json={"prompt": "x"})
        assert r.status_code == 503  # a small request went all the way to the upstream
        assert not result and t.is_alive()  # the large one is still being parsed
    finally:
        os.kill(parsers[0], signal.SIGCONT)
        t.join(60)
    assert result and result[0].status_code == 503, result


# ---------------------------------------------------------------------------- access
def test_required_access_follows_vllms_guarded_prefixes():
    from mars.sidecar.auth import Access, Authenticator, required_access

    assert required_access("POST", "/v1/chat/completions", False) is Access.API
    assert required_access("GET", "/v1/mars/state", False) is Access.API
    assert required_access("DELETE", "/v1/mars/sessions/a/b", False) is Access.API
    assert required_access("POST", "/v1/mars/events", False) is Access.EVENTS
    assert required_access("GET", "/v1/mars/events/stream", False) is Access.API
    assert required_access("GET", "/metrics", False) is Access.API
    assert required_access("GET", "/metrics", True) is Access.OPEN
    for path in ("/health", "/ping", "/version", "/v1/mars/health"):
        assert required_access("GET", path, False) is Access.OPEN
    # deny by default: routes vLLM leaves open outside /v1 are closed here
    for path in ("/invocations", "/tokenize", "/metrics/", "/metricsX", "/docs", "/load"):
        assert required_access("POST", path, False) is Access.API, path
    assert required_access("GET", "/metrics/", True) is Access.OPEN
    assert required_access("OPTIONS", "/v1/completions", False) is Access.OPEN
    auth = Authenticator.from_keys(["k1", "k2"], ["ev"])
    assert auth.allows("POST", "/v1/completions", "Bearer k2")
    assert auth.allows("POST", "/v1/completions", "bearer k1")
    assert not auth.allows("POST", "/v1/completions", "Bearer ev")  # events key: events only
    assert not auth.allows("POST", "/v1/completions", "Bearer k")
    assert not auth.allows("POST", "/v1/completions", "Basic k1")
    assert not auth.allows("POST", "/v1/completions", None)
    assert auth.allows("POST", "/v1/mars/events", "Bearer ev")
    assert auth.allows("POST", "/v1/mars/events", "Bearer k1")
    assert not auth.allows("POST", "/v1/mars/events", "Bearer nope")
    assert Authenticator.from_keys().allows("GET", "/v1/mars/state", None)
    # an events key alone closes the events endpoint only (the API stays as vLLM's would be)
    only_ev = Authenticator.from_keys([], ["ev"])
    assert only_ev.allows("GET", "/v1/mars/state", None)
    assert not only_ev.allows("POST", "/v1/mars/events", None)


@pytest.fixture(scope="module")
def keyed():
    """A sidecar with an API key and a separate tool-runner key (keys from the environment,
    the way ``mars-vllm serve`` hands them over), upstream down."""
    from mars.sidecar.process import SidecarProcess

    with SidecarProcess(f"http://127.0.0.1:{free_port()}",
                        ["--admission", "on", "--engine-events", "none", "--max-window", "2"],
                        env={"MARS_SIDECAR_API_KEYS": "sk-one\nsk-two",
                             "MARS_EVENTS_API_KEY": "ev-key"}) as sc:
        yield sc


def _state(sc, key="sk-one") -> dict:
    r = httpx.get(sc.url + "/v1/mars/state", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_every_endpoint_needs_the_key_and_a_401_takes_no_slot(keyed):
    url = keyed.url
    bad = [{}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer ev-key"},
           {"authorization": "sk-one"}]
    calls = [("POST", "/v1/chat/completions", {"model": "m", "messages": [
                 {"role": "user", "content": "hi"}], "vllm_xargs": {"job_id": "intruder"}}),
             ("POST", "/v1/completions", {"model": "m", "prompt": "x",
                                          "vllm_xargs": {"job_id": "intruder-2"}}),
             ("GET", "/v1/mars/state", None), ("GET", "/v1/mars/sessions", None),
             ("GET", "/v1/mars/events/stream?max_events=1&timeout=1", None),
             ("DELETE", "/v1/mars/sessions/victim", None), ("GET", "/metrics", None),
             ("GET", "/metrics/", None), ("GET", "/v1/models", None),
             ("POST", "/invocations", {"model": "m", "prompt": "x"}),
             ("POST", "/tokenize", {"model": "m", "prompt": "x"})]
    for headers in bad:
        for method, path, body in calls:
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer"
            assert "API key" in _error(r)["message"]
    # tool events: the tool-runner key or an API key, nothing else
    ev = [{"kind": "tool_start", "session_id": "victim", "ts": 1.0, "tool": "bash"}]
    assert httpx.post(url + "/v1/mars/events", json=ev).status_code == 401
    assert httpx.post(url + "/v1/mars/events", json=ev,
                      headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(url + "/v1/mars/events", json=ev,
                      headers={"authorization": "Bearer ev-key"}).status_code == 200
    assert httpx.post(url + "/v1/mars/events", json=[],
                      headers={"authorization": "Bearer sk-two"}).status_code == 200
    # a tool-runner key cannot end sessions (not even through a session_end event)
    end = [{"kind": "session_end", "session_id": "victim", "ts": 2.0, "reason": "deleted"}]
    r = httpx.post(url + "/v1/mars/events", json=end, headers={"authorization": "Bearer ev-key"})
    assert r.status_code == 403 and "API key" in _error(r)["message"]
    assert httpx.post(url + "/v1/mars/events", json=end,
                      headers={"authorization": "Bearer sk-one"}).status_code == 200
    # the probe stays open, and the 401s left nothing behind: no session, no queue entry
    assert httpx.get(url + "/v1/mars/health").status_code == 200
    st = _state(keyed)
    assert st["admitted"] == 0 and st["queued"] == 0 and st["inflight"] == 0
    metrics = httpx.get(url + "/metrics", headers={"authorization": "Bearer sk-two"}).text
    assert "mars_sidecar_unauthorized_total" in metrics
    # with the key, a request is admitted (the upstream is down: 503 after admission)
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"},
                   headers={"authorization": "Bearer sk-two", "x-session-id": "a/b"})
    assert r.status_code == 503
    assert _state(keyed)["admitted"] == 1
    # a session id with '/' can be ended (percent-encoded or not)
    r = httpx.delete(url + "/v1/mars/sessions/a%2Fb", headers={"authorization": "Bearer sk-one"})
    assert r.status_code == 200 and r.json()["session_id"] == "a/b", r.text
    assert _state(keyed)["admitted"] == 0


def test_open_metrics_is_an_explicit_choice():
    from mars.sidecar.process import SidecarProcess

    with SidecarProcess(f"http://127.0.0.1:{free_port()}",
                        ["--engine-events", "none", "--api-key", "k", "--open-metrics",
                         "--no-upstream-metrics"]) as sc:
        assert httpx.get(sc.url + "/metrics").status_code == 200
        assert httpx.get(sc.url + "/v1/mars/state").status_code == 401


def test_keys_come_from_flags_then_the_environment(monkeypatch):
    """vLLM's ``$VLLM_API_KEY`` guards the sidecar as it guards vLLM; ``mars-vllm serve`` hands
    its keys over in ``$MARS_SIDECAR_API_KEYS`` (newline-separated); a flag wins over both."""
    import argparse

    from mars.cli.sidecar import add_arguments, config_from_args

    def cfg(*argv: str):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return config_from_args(p.parse_args(["--upstream", "http://127.0.0.1:1", *argv]))

    for var in ("VLLM_API_KEY", "MARS_SIDECAR_API_KEYS", "MARS_EVENTS_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert cfg().api_keys == () and cfg().events_api_keys == ()
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert cfg().api_keys == ("from-vllm",)
    monkeypatch.setenv("MARS_SIDECAR_API_KEYS", "a\nb")
    assert set(cfg().api_keys) == {"a", "b"}
    monkeypatch.setenv("MARS_EVENTS_API_KEY", "ev")
    assert cfg().events_api_keys == ("ev",)
    assert cfg("--api-key", "flag").api_keys == ("flag",)


def test_the_simulator_configures_the_sidecar_as_its_command_line_does():
    """``mars sim`` builds the sidecar's configuration without the parser; what the control
    plane reads of it must be what ``mars sidecar`` makes of the flags ``mars-vllm serve``
    passes (the admission switch, the tool cores, the engine's block size)."""
    import argparse
    import dataclasses
    import json

    from mars.cli.sidecar import add_arguments, config_from_args
    from mars.sim.control import sidecar_config

    for admission, cores, block in ((True, 4, 16), (False, 8, 32), (True, 3, 128)):
        p = argparse.ArgumentParser()
        add_arguments(p)
        served = config_from_args(p.parse_args([
            "--upstream", "http://127.0.0.1:1", "--admission", "on" if admission else "off",
            "--admission-config", json.dumps({"packing": {"block_size": block}}),
            "--tool-cores", str(cores)]))
        sim = sidecar_config(admission, cores, block)
        assert sim.admission_config == served.admission_config
        assert sim.admission_config.packing.block_size == block
        assert sim.admission_config.pressure.tool_cores == cores
        skip = {"upstream", "engine_events", "upstreams", "engines_events", "api_keys",
                "events_api_keys"}
        assert {f.name: getattr(sim, f.name) for f in dataclasses.fields(sim)
                if f.name not in skip} == {f.name: getattr(served, f.name)
                                           for f in dataclasses.fields(served)
                                           if f.name not in skip}


@pytest.mark.parametrize("field,value,message", [
    ("step_interval_s", 0.0, "step_interval_s must be > 0 and finite"),
    ("idle_timeout_s", float("nan"), "idle_timeout_s must be > 0 and finite"),
    ("upstream_client", "curl", "upstream_client must be 'fast' or 'httpx'"),
    ("drain_timeout_s", -1.0, "drain_timeout_s must be >= 0"),
    ("max_body_bytes", 0, "max_body_bytes must be >= 1"),
    ("api_keys", ("a key",), "API keys must not contain whitespace"),
    ("sse_queue", 0, "sse_queue >= 1"),
])
def test_the_config_refuses_bad_values(field, value, message):
    """Every check of SidecarConfig runs (a property once defined in the middle of
    __post_init__ made the checks after it unreachable, and none of these was refused)."""
    from mars.sidecar.config import SidecarConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        SidecarConfig(upstream="http://127.0.0.1:1", **{field: value})


def test_the_config_drops_empty_api_keys():
    from mars.sidecar.config import SidecarConfig

    cfg = SidecarConfig(upstream="http://127.0.0.1:1", api_keys=("", "k"),
                        events_api_keys=("",))
    assert cfg.api_keys == ("k",) and cfg.events_api_keys == ()
