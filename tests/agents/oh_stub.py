"""A scripted OpenAI-compatible endpoint on loopback, for testing the agent side offline.

It stands in for the mars server *only* in the tests of this package (the real end-to-end
test, ``test_e2e.py``, needs ``MARS_TEST_URL``): the tools the agent runs are the real
OpenHands tools; the stub just answers each chat completion with the next tool call of a
script and records every request (body and headers) and every event batch posted to
``/v1/mars/events``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_SCRIPT: list[tuple[str, dict[str, Any]]] = [
    ("terminal", {"command": "echo hello mars > hello.txt && cat hello.txt"}),
    ("file_editor", {"command": "view", "path": "hello.txt"}),
    ("task_tracker", {"command": "plan", "task_list": [{"title": "say hello", "notes": "", "status": "done"}]}),
    ("terminal", {"command": "ls"}),
]


class StubOpenAI:
    def __init__(self, script: list[tuple[str, dict[str, Any]]] | None = None, *,
                 delay_s: float = 0.0, events_status: int = 200, model: str = "stub-model",
                 fail_event_posts: int = 0) -> None:
        self.script = list(DEFAULT_SCRIPT if script is None else script)
        self.delay_s = delay_s
        self.events_status = events_status
        #: the first this many event posts get 503 (a sidecar briefly down)
        self.fail_event_posts = fail_event_posts
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.event_posts = 0
        #: per event post: (its authorization header, the kinds it carried)
        self.event_auth: list[tuple[str | None, list[str]]] = []
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _json(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": stub.model, "object": "model"}]})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                if self.path == "/v1/mars/events":
                    with stub._lock:
                        stub.event_posts += 1
                        stub.event_auth.append((self.headers.get("authorization"),
                                                [e.get("kind") for e in body]))
                        status = stub.events_status
                        if stub.fail_event_posts > 0:
                            stub.fail_event_posts -= 1
                            status = 503
                        if status == 200:
                            stub.events.extend(body)
                    self._json(status, {"accepted": len(body)})
                    return
                if self.path != "/v1/chat/completions":
                    self._json(404, {"error": "not found"})
                    return
                with stub._lock:
                    stub.requests.append({"body": body, "headers": {k.lower(): v for k, v in self.headers.items()}})
                if stub.delay_s:
                    time.sleep(stub.delay_s)
                rnd = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
                name, args = stub.script[rnd] if rnd < len(stub.script) else ("finish", {"message": "done"})
                args = {**args, "summary": f"step {rnd}", "security_risk": "LOW"}
                call = {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)}}
                usage = {"prompt_tokens": 100 + rnd, "completion_tokens": 10, "total_tokens": 110 + rnd}
                rid = f"chatcmpl-{uuid.uuid4().hex[:8]}"
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("cache-control", "no-cache")
                    self.send_header("connection", "close")
                    self.end_headers()

                    def chunk(delta: dict, finish: str | None = None, use: dict | None = None) -> None:
                        obj = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                               "model": stub.model,
                               "choices": [] if use else [{"index": 0, "delta": delta, "finish_reason": finish}]}
                        if use:
                            obj["usage"] = use
                        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                        self.wfile.flush()

                    chunk({"role": "assistant", "content": ""})
                    chunk({"tool_calls": [{"index": 0, **call}]})
                    chunk({}, finish="tool_calls")
                    chunk({}, use=usage)
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self._json(200, {
                    "id": rid, "object": "chat.completion", "created": int(time.time()), "model": stub.model,
                    "choices": [{"index": 0, "finish_reason": "tool_calls",
                                 "message": {"role": "assistant", "content": None, "tool_calls": [call]}}],
                    "usage": usage,
                })

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "StubOpenAI":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def xargs(self) -> list[dict[str, Any]]:
        return [r["body"].get("vllm_xargs") or (r["body"].get("extra_body") or {}).get("vllm_xargs")
                for r in self.requests]
