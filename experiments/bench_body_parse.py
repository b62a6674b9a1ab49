"""How long a huge request body holds the sidecar's event loop (benchmark, not a test).

A real sidecar process in front of a stand-in engine that reads each body whole and answers a
small completion (the sidecar parses, admits and forwards the body: all it does with one),
probed on ``GET /v1/mars/health`` back to back from another process while large bodies are
posted. The longest probe while a body is in flight is how long
every other client waited. Two sidecars side by side in one run: bodies parsed on the loop
(``--offload-parse-bytes`` above any body) and in the child process (the default). First,
in this process, the reason it is a process: how long the loop is held when the same parse
runs on it or in a thread (``asyncio.to_thread``: the JSON decoder keeps the GIL).

    .venv/bin/python experiments/bench_body_parse.py [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socketserver
import statistics
import subprocess
import sys
import threading
import time

import httpx

from mars.sidecar.process import SidecarProcess

MB = 1 << 20


class _Engine(socketserver.ThreadingTCPServer):
    """Reads a request whole (Content-Length) and answers a small JSON completion."""

    daemon_threads = allow_reuse_address = True

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = self.rfile.readline()
                    if not line:
                        return
                    head += line
                n = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                          if h.lower().startswith(b"content-length:")), 0)
                self.rfile.read(n)
                out = b'{"choices": [{"text": "ok"}]}'
                self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(out), out))


def bodies() -> dict[str, tuple[bytes, dict[str, str]]]:
    text = "hello world " * (50 * MB // 12)
    return {
        "50 MB text prompt, job_id in vllm_xargs": (
            json.dumps({"model": "m", "prompt": text,
                        "vllm_xargs": {"job_id": "a", "round": 0}}).encode(), {}),
        "5 M token ids (44 MB), job_id in vllm_xargs": (
            json.dumps({"model": "m", "prompt": list(range(5_000_000)),
                        "vllm_xargs": {"job_id": "b", "round": 0}}).encode(), {}),
        "50 MB text prompt, session from X-Session-ID (body rewritten)": (
            json.dumps({"model": "m", "prompt": text}).encode(), {"x-session-id": "c"}),
    }


PROBE = """
import json, sys, threading, time, httpx
url, lat, stop = sys.argv[1], [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with httpx.Client(timeout=30) as c:
    while not stop.is_set():
        t, w = time.perf_counter(), time.time()
        c.get(url + "/v1/mars/health")
        lat.append((w, time.perf_counter() - t))
print(json.dumps(lat))
"""


def probe_while(url: str, work) -> tuple[list[float], float]:
    """Probe latencies (s) while ``work()`` runs, and how long it ran. The prober is a
    process of its own: in this one it would wait for the GIL behind the poster."""
    prober = subprocess.Popen([sys.executable, "-c", PROBE, url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # started and probing
    w0, t0 = time.time(), time.perf_counter()
    work()
    took = time.perf_counter() - t0
    out, _ = prober.communicate("", timeout=60)
    # the probes sent while the work ran (or waiting when it began)
    return [d for w, d in json.loads(out) if w0 - d <= w <= w0 + took], took


def loop_held(parse, body: bytes, headers: dict[str, str], in_thread: bool) -> float:
    """Longest gap (s) between 1-ms ticks of this process's event loop while ``body`` is
    parsed on the loop or in a thread."""
    import asyncio

    async def run() -> float:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last - 0.001)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        gaps.clear()
        if in_thread:
            await asyncio.to_thread(parse, body, headers)
        else:
            parse(body, headers)
        await asyncio.sleep(0.01)
        done.set()
        await ticker
        return max(gaps)

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="posts per body and mode")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    modes = {"on the event loop": ["--offload-parse-bytes", str(1 << 40)],
             "child process (default)": []}
    from mars.sidecar.request import parse_generate

    print("| body | parsed in this process | longest loop stall (ms), each parse |\n"
          "|---|---|---|")
    for name, (body, headers) in bodies().items():
        for label, in_thread in (("on the event loop", False), ("in a thread", True)):
            held = [loop_held(parse_generate, body, headers, in_thread)
                    for _ in range(args.repeat)]
            print(f"| {name} | {label} | {' / '.join(f'{x * 1e3:.0f}' for x in held)} |",
                  flush=True)
    print()
    engine = _Engine(("127.0.0.1", 0), _Engine.Handler)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    upstream = f"http://127.0.0.1:{engine.server_address[1]}"
    rows = []
    with SidecarProcess(upstream, ["--engine-events", "none", *modes["on the event loop"]]) \
            as on_loop, SidecarProcess(upstream, ["--engine-events", "none"]) as child:
        servers = {"on the event loop": on_loop, "child process (default)": child}
        for name, (body, headers) in bodies().items():
            for mode, sc in servers.items():
                worst, medians, posts = [], [], []
                with httpx.Client(timeout=120) as c:
                    for _ in range(args.repeat):
                        status = []
                        lat, took = probe_while(sc.url, lambda: status.append(c.post(
                            sc.url + "/v1/completions", content=body,
                            headers={"content-type": "application/json", **headers}
                        ).status_code))
                        assert status == [200], status
                        worst.append(max(lat))
                        medians.append(statistics.median(lat))
                        posts.append(took)
                row = {"body": name, "mode": mode, "bytes": len(body),
                       "worst_probe_ms": [round(x * 1e3, 1) for x in worst],
                       "median_probe_ms": round(statistics.median(medians) * 1e3, 2),
                       "post_s": round(statistics.median(posts), 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| body | parsed | longest probe wait (ms), each post | median probe (ms) "
          "| post (s) |\n|---|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['body']} | {r['mode']} | "
              f"{' / '.join(f'{x:.0f}' for x in r['worst_probe_ms'])} | "
              f"{r['median_probe_ms']:.2f} | {r['post_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
