"""Does the emulated GPU keep up? The engine's own CPU time per step vs the modeled step time.

For each batch size N, one ``mars-vllm serve --emulate GPU:MODEL`` gets N concurrent long
decodes (non-streamed, forced lengths) and the engine's pacer totals (the ``emulated`` field of
its ``kv_snapshot`` events) are read over a window in which exactly N requests run. Printed per
N: the modeled step time, the engine's host CPU time per step (scheduling, output processing,
the executor's bookkeeping -- everything the emulation runs for real), their ratio, and the
share of steps that ended late because the host work did not fit under the modeled step. The
emulation is faithful while the ratio stays well below 1 and late steps stay rare.

    .venv/bin/python experiments/bench_emulation.py --running 16,64,256 [--no-async-scheduling]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import httpx

from mars.launch import ServerProcess


def _snap(path: str) -> dict | None:
    last = None
    try:
        with open(path) as f:
            for line in f:
                if '"kv_snapshot"' in line:
                    last = json.loads(line)
    except FileNotFoundError:
        return None
    return last


def measure(srv: ServerProcess, model: str, n: int, prompt: int, window_s: float) -> dict:
    stop = threading.Event()

    def one(i: int) -> None:
        with httpx.Client(timeout=3600) as c:
            while not stop.is_set():
                try:
                    c.post(srv.url + "/v1/completions", json={
                        "model": model,
                        "prompt": [100 + (i * 7 + k) % 800 for k in range(prompt)],
                        "max_tokens": 20_000, "ignore_eos": True})
                except httpx.HTTPError:
                    if not stop.is_set():
                        raise

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    # wait until all n run, then take the window between two snapshots with running == n
    deadline = time.monotonic() + 300
    first = None
    while time.monotonic() < deadline:
        s = _snap(srv.events_file)
        if s and s.get("running") == n and s.get("waiting") == 0 and s.get("emulated"):
            first = s
            break
        time.sleep(0.2)
    if first is None:
        stop.set()
        raise RuntimeError(f"{n} requests never ran together")
    time.sleep(window_s)
    last = _snap(srv.events_file)
    stop.set()
    a, b = first["emulated"], last["emulated"]
    steps = b["steps"] - a["steps"]
    return {"running": n, "running_at_end": last.get("running"), "steps": steps,
            "modeled_ms": 1e3 * (b["modeled_s"] - a["modeled_s"]) / steps,
            "host_ms": 1e3 * (b["host_cpu_s"] - a["host_cpu_s"]) / steps,
            "late_share": (b["late_steps"] - a["late_steps"]) / steps,
            "late_ms": 1e3 * (b["late_s"] - a["late_s"]) / steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emulate", default="h100-nvl:qwen3-coder-30b-a3b")
    ap.add_argument("--running", default="16,64,256")
    ap.add_argument("--prompt", type=int, default=2000, help="prompt tokens per request")
    ap.add_argument("--window", type=float, default=10.0, help="seconds measured per point")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="the sync scheduler class (default: async, as vLLM on the card)")
    args = ap.parse_args()
    extra = ["--no-async-scheduling"] if args.no_async_scheduling else []
    rows = []
    for n in (int(x) for x in args.running.split(",")):
        srv = ServerProcess(args=["--emulate", args.emulate, "--no-sidecar", *extra]).start()
        try:
            model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
            rows.append(measure(srv, model, n, args.prompt, args.window))
        finally:
            srv.stop()
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"Emulated engine's host CPU per step vs modeled step ({args.emulate}, EMULATED GPU; "
          f"{'sync' if extra else 'async'} scheduling; {args.prompt}-token prompts, decode)\n")
    print("| running | modeled step (ms) | engine host CPU / step (ms) | host / modeled | "
          "late steps | mean lateness / step (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['running']} | {r['modeled_ms']:.2f} | {r['host_ms']:.2f} | "
              f"{r['host_ms'] / r['modeled_ms']:.2f} | {100 * r['late_share']:.1f} % | "
              f"{r['late_ms']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
