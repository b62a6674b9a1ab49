"""``mars demo``: the README's "run the main job" command on the embedded default.

Starts ``mars-vllm serve`` on the embedded tiny model (CPU), sends a chat request and a
tool-call request through real HTTP, prints what came back, and stops the server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def run_demo(args: argparse.Namespace) -> int:
    import httpx

    from mars.launch import ServerProcess

    print("mars demo: starting `mars-vllm serve` on the embedded tiny model (CPU) ...",
          flush=True)
    t0 = time.monotonic()
    with ServerProcess(args=["--policy", args.policy, "--max-model-len", "32768"]) as srv:
        print(f"  server up at {srv.url} in {time.monotonic() - t0:.1f}s "
              f"(engine events: {srv.events_file})", flush=True)
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "mars-tiny", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16, "vllm_xargs": {"job_id": "demo", "round": 0}})
        r.raise_for_status()
        body = r.json()
        print("  chat answer (random weights, so noise):",
              json.dumps(body["choices"][0]["message"]["content"]),
              f"usage={body['usage']}", flush=True)
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "mars-tiny", "tool_choice": "required", "max_tokens": 128,
            "messages": [{"role": "user", "content": "List the files."}],
            "tools": [{"type": "function", "function": {
                "name": "terminal", "description": "Run a shell command.",
                "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                               "required": ["command"]}}}],
            "vllm_xargs": {"job_id": "demo", "round": 1}})
        r.raise_for_status()
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        print(f"  tool call: {call['name']}({call['arguments']})", flush=True)
    print("mars demo: done", flush=True)
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="serve the embedded tiny model and answer requests",
                       description=__doc__)
    p.add_argument("--policy", default="fcfs", help="engine policy (default: %(default)s)")
    p.set_defaults(func=run_demo)


if __name__ == "__main__":
    from mars.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
