"""Foundation: `mars-vllm serve` on the real vLLM CPU engine with the embedded tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from mars.protocol.sse import iter_sse_lines

from tests.conftest import read_events, wait_for_events

pytestmark = pytest.mark.engine

TOOLS = [{
    "type": "function",
    "function": {
        "name": "terminal",
        "description": "Run a shell command in the workspace.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]},
    },
}]


@pytest.fixture(scope="module")
def server(fcfs_server):
    return fcfs_server  # (shared with other modules: tests/conftest.py)


def test_chat_completion_is_openai_shaped(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "mars-tiny", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] > 0


def test_streaming_completion(server):
    chunks, done = [], False
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": "mars-tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "stream": True,
            "ignore_eos": True, "temperature": 0, "return_token_ids": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in iter_sse_lines(r.iter_bytes()):
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunks.append(json.loads(data))
    assert done
    assert all(c["object"] == "text_completion" for c in chunks)
    # the six tokens arrive as they are made, in as many chunks as the API server had time to
    # send (it merges a request's outputs when it falls behind: on busy cores, fewer), and
    # the usage chunk counts them
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert len(streamed) == 6, chunks
    assert any(c["choices"] and c["choices"][0]["text"] for c in chunks), chunks
    assert chunks[-1]["usage"]["completion_tokens"] == 6, chunks[-1]


def test_tool_choice_required_returns_parsed_call(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "mars-tiny", "messages": [{"role": "user", "content": "list the files"}],
        "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 0})
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls, r.text
    assert calls[0]["function"]["name"] == "terminal"
    args = json.loads(calls[0]["function"]["arguments"])
    assert isinstance(args, dict) and "command" in args


def test_our_scheduler_runs_and_sees_vllm_xargs(server):
    start = read_events(server.events_file, "scheduler_start")
    assert start, "the mars scheduler never announced itself"
    assert start[0]["scheduler_cls"] == "mars.engine.sched.scheduler.MarsScheduler"
    assert start[0]["policy"] == "fcfs"
    assert start[0]["block_size"] == 32  # CPU default applied

    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "mars-tiny", "prompt": [11, 12, 13], "max_tokens": 2,
        "vllm_xargs": {"job_id": "agent-7", "round": 3, "last_round": True,
                       "next_tool": "terminal.run"}})
    assert r.status_code == 200, r.text
    ends = wait_for_events(server.events_file,
                           lambda e: e["kind"] == "gpu_end" and e["session_id"] == "agent-7")
    assert ends and ends[0]["round"] == 3 and ends[0]["output_tokens"] == 2
    submits = [e for e in read_events(server.events_file, "gpu_submit")
               if e["session_id"] == "agent-7"]
    assert submits and submits[0]["prompt_tokens"] == 3 and submits[0]["projected_blocks"] == 1
    # the engine's request id is "<external id>-<suffix>": sessions come from metadata only
    assert submits[0]["request_id"] != "agent-7"


def test_session_header_is_a_fallback(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   headers={"X-Session-ID": "hdr-session"},
                   json={"model": "mars-tiny", "prompt": [21, 22], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert wait_for_events(server.events_file,
                           lambda e: e["kind"] == "gpu_end" and e["session_id"] == "hdr-session")


def test_engine_events_validate_against_schema(server):
    from mars.protocol.events import parse_event

    evs = read_events(server.events_file)
    assert {"scheduler_start", "gpu_submit", "gpu_1st_token", "gpu_end", "kv_snapshot"} <= {
        e["kind"] for e in evs}
    for ev in evs:
        parse_event(ev)


def test_bad_request_gets_clear_error_and_server_keeps_serving(server):
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": "mars-tiny", "prompt": [1], "max_tokens": -3})
    assert r.status_code == 400
    assert "max_tokens" in r.text
    ok = httpx.post(server.url + "/v1/completions", timeout=30,
                    json={"model": "mars-tiny", "prompt": [1], "max_tokens": 1})
    assert ok.status_code == 200


def test_cli_help_and_version():
    exe = [sys.executable, "-m", "mars.engine.serve.cli"]
    out = subprocess.run([*exe, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--policy" in out.stdout and "--mars-events-file" in out.stdout
    assert "--max-model-len" in out.stdout or "--help=all" in out.stdout
    ver = subprocess.run([*exe, "--version"], capture_output=True, text=True, timeout=60)
    assert ver.returncode == 0 and "vLLM 0.32.0" in ver.stdout
