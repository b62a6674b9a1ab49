"""Sidecar tests that need no engine: request parsing, and a real sidecar process whose
upstream is a closed port (the "engine down" case) for the bad-input and 503 paths.

The engine-backed behaviour (pass-through, admission, faults with a real vLLM) is in
tests/test_sidecar.py.
"""

from __future__ import annotations

import json
import threading
import time

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
    assert req.prompt_tokens(4.0) == 3


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
     "duration_s"),
    (json.dumps([{"kind": "no_such_kind", "ts": 1.0}]).encode(), "kind"),
    # non-finite numbers never enter the control state (they used to poison the EMAs)
    (b'[{"kind": "tool_end", "ts": 1.0, "session_id": "s", "tool": "bash", '
     b'"duration_s": Infinity}]', "duration_s"),
    (b'[{"kind": "tool_start", "ts": NaN, "session_id": "s", "tool": "bash"}]', "ts"),
    (json.dumps([{"kind": "kv_snapshot", "ts": 1.0, "total_blocks": 1, "free_blocks": 1,
                  "used_blocks": 0}]).encode(), "cannot be posted"),
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


def test_large_bodies_are_parsed_off_the_event_loop():
    """A large request body is parsed in a worker thread (the loop keeps serving the other
    clients meanwhile); a small one on the loop; errors come back as from a direct call."""
    import asyncio

    from mars.sidecar.app import OFF_LOOP_PARSE_BYTES, parse_off_loop

    seen: list[bool] = []

    def parse(body: bytes, tag: str) -> str:
        seen.append(threading.current_thread() is threading.main_thread())
        if body.startswith(b"!"):
            raise BadRequest("bad")
        return tag

    async def run() -> None:
        assert await parse_off_loop(parse, b"x" * 10, "small") == "small"
        assert await parse_off_loop(parse, b"x" * OFF_LOOP_PARSE_BYTES, "big") == "big"
        with pytest.raises(BadRequest):
            await parse_off_loop(parse, b"!" * OFF_LOOP_PARSE_BYTES, "bad")
        # a big real body: the same result as on the loop
        body = json.dumps({"prompt": "a" * OFF_LOOP_PARSE_BYTES}).encode()
        got = await parse_off_loop(parse_generate, body, {})
        assert got.body == parse_generate(body, {}).body

    asyncio.run(run())
    assert seen == [True, False, False]


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
