"""The sidecar's CPU per request against the number of engines behind it (#34), in one run.

    .venv/bin/python experiments/bench_sidecar_engines.py [--engines 1,2,4,8]
        [--sessions 300] [--rounds 4] [--concurrency 32] [--per-engine] [--json out.json]

With several engines the sidecar runs one control plane, one event reader and one HTTP
client per engine, places every new session by pricing each engine, and after each control
step looks for queued sessions another engine would admit (late binding). This measures what
that costs it: for each engine count, ``mars sidecar --upstream URL1,...,URLn
--engine-events EP1,...,EPn`` (admission on, MARS placement) in front of ``n`` stand-in
engines, and the same stream of agent sessions through it (``--sessions`` sessions of
``--rounds`` non-streaming 1-token calls each, ``--concurrency`` sessions at a time). The
stand-ins answer every call at once and publish what a mars engine publishes for it
(``gpu_submit``, ``gpu_1st_token``, ``gpu_end``) and a ``kv_snapshot`` every 0.5 s, so every
control plane folds a real event stream; they run in a process of their own, as does this
load generator. The number is the sidecar process's CPU time (user + system, from
``/proc``) over the calls it served: CPU, not latency, so the engines and the load sharing
the machine's cores do not enter it, only the sidecar's own work. A real engine's
calls last longer, so sessions overlap more and queues form; the stand-ins make the
per-call cost, not the queueing, the subject.

Two shapes of load. By default the same sessions at every engine count (a fixed load on the
node, spread thinner as engines are added): what an operator adding engines for headroom
pays. With ``--per-engine``, ``--sessions`` and ``--concurrency`` are per engine (n engines
get n times both): a fixed load per engine, the issue's scaling question, where each
engine's own periodic work (its KV snapshots, its control plane's timer steps) is spread
over as many calls at every engine count and only what grows with the engines per call
(pricing every engine for a new session, looking at every engine for a late binding) is
left to rise.

Not a test: numbers depend on the machine (its CPU speed; the 2-core test machine is slow);
the ratios between engine counts are the result. docs/results.md has a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mars.launch import free_port  # noqa: E402
from mars.sidecar.process import SidecarProcess  # noqa: E402

_ANSWER = json.dumps({
    "id": "c", "object": "text_completion", "model": "m", "choices": [
        {"index": 0, "text": "ok", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()


def _engines_main(ports: list[int], endpoints: list[str], ready, stop) -> None:
    """The stand-in engines, one asyncio server and one event publisher each."""
    from mars.stream.publisher import EventPublisher

    pubs = [EventPublisher(endpoint=ep) for ep in endpoints]
    seq = [0]

    def publish(rank: int, ev: dict) -> None:
        ev.setdefault("ts", time.time())
        pubs[rank].publish(ev)

    async def handle(rank: int, reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                if head.startswith(b"POST"):
                    meta = json.loads(body).get("vllm_xargs") or {}
                    sid, rnd = str(meta.get("job_id") or "anon"), meta.get("round")
                    seq[0] += 1
                    rid = f"cmpl-{seq[0]}"
                    common = {"session_id": sid, "request_id": rid, "round": rnd}
                    publish(rank, {"kind": "gpu_submit", "prompt_tokens": 3,
                                   "projected_blocks": 1, **common})
                    publish(rank, {"kind": "gpu_1st_token", "launch_delay_s": 0.0,
                                   "prompt_tokens": 3, **common})
                    publish(rank, {"kind": "gpu_end", "freed_blocks": 1, "output_tokens": 1,
                                   **common})
                    data = _ANSWER
                else:
                    data = b'{"object":"list","data":[]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(data), data))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def snapshots() -> None:
        for r in range(len(ports)):
            publish(r, {"kind": "scheduler_start", "scheduler_cls": "stand-in",
                        "policy": "mars", "total_blocks": 100_000, "block_size": 16,
                        "pid": os.getpid()})
        while not stop.is_set():
            for r in range(len(ports)):
                publish(r, {"kind": "kv_snapshot", "total_blocks": 100_000,
                            "free_blocks": 90_000, "used_blocks": 10_000, "running": 4,
                            "waiting": 0})
            await asyncio.sleep(0.5)

    async def run() -> None:
        servers = [await asyncio.start_server(
            lambda r, w, rank=rank: handle(rank, r, w), "127.0.0.1", port)
            for rank, port in enumerate(ports)]
        ready.set()
        await snapshots()
        for s in servers:
            s.close()

    asyncio.run(run())
    for p in pubs:
        p.close()


async def _session(host: str, port: int, sid: str, rounds: int) -> int:
    """One agent session's calls over one keep-alive connection; returns calls that got 200."""
    reader, writer = await asyncio.open_connection(host, port)
    ok = 0
    try:
        for rnd in range(rounds):
            body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1,
                               "vllm_xargs": {"job_id": sid, "round": rnd,
                                              "last_round": rnd == rounds - 1}}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            ok += head.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
    return ok


async def _load(url: str, sessions: int, rounds: int, concurrency: int, tag: str) -> int:
    host, port = url.split("//")[1].split(":")
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with sem:
            return await _session(host, int(port), f"{tag}-{i}", rounds)

    return sum(await asyncio.gather(*(one(i) for i in range(sessions))))


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def measure(n: int, args: argparse.Namespace, tmp: Path) -> dict:
    ctx = mp.get_context("spawn")
    ports = [free_port() for _ in range(n)]
    eps = [f"ipc://{tmp}/engine-{n}-{r}.ipc" for r in range(n)]
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_engines_main, args=(ports, eps, ready, stop), daemon=True)
    proc.start()
    sidecar = None
    try:
        if not ready.wait(60):
            raise RuntimeError("the stand-in engines did not start")
        sidecar = SidecarProcess(",".join(f"http://127.0.0.1:{p}" for p in ports), [
            "--admission", "on", "--engine-events", ",".join(eps)]).start()
        scale = n if args.per_engine else 1
        sessions, concurrency = args.sessions * scale, args.concurrency * scale
        asyncio.run(_load(sidecar.url, min(20 * scale, sessions), args.rounds,
                          concurrency, f"warm{n}"))  # connections, first events
        time.sleep(1.0)
        runs = []
        for rep in range(args.reps):
            cpu0, t0 = _cpu_s(sidecar.proc.pid), time.perf_counter()
            ok = asyncio.run(_load(sidecar.url, sessions, args.rounds, concurrency,
                                   f"e{n}r{rep}"))
            wall, cpu = time.perf_counter() - t0, _cpu_s(sidecar.proc.pid) - cpu0
            calls = sessions * args.rounds
            if ok != calls:
                raise RuntimeError(f"{n} engines: {calls - ok} of {calls} calls failed")
            runs.append({"cpu_us_per_call": cpu / calls * 1e6, "calls_per_s": calls / wall})
        placement = sidecar.state().get("placement", {})  # (absent with one engine)
        return {"engines": n, "runs": runs, "rebinds": placement.get("rebinds"),
                "received": [e.get("engine_events_received")
                             for e in placement.get("engines", [])]}
    finally:
        if sidecar is not None:
            sidecar.stop()
        stop.set()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def render(res: dict) -> str:
    rows = ["| engines | sidecar CPU per call (µs), median of reps | calls/s | vs 1 engine |",
            "|---:|---:|---:|---:|"]
    base = None
    for r in res["points"]:
        cpu = statistics.median(x["cpu_us_per_call"] for x in r["runs"])
        thr = statistics.median(x["calls_per_s"] for x in r["runs"])
        base = base or cpu
        rows.append(f"| {r['engines']} | {cpu:.0f} | {thr:.0f} | {cpu / base:.2f}× |")
    a = res["args"]
    each = " per engine" if a.get("per_engine") else ""
    rows += ["", f"{a['sessions']} sessions{each} × {a['rounds']} calls, {a['concurrency']}{each} "
             "at a time, "
             f"{a['reps']} repetitions per engine count; stand-in engines (answer at once, "
             f"publish each call's events and a KV snapshot every 0.5 s). Machine: "
             f"{os.cpu_count()} CPUs, load average {res['loadavg'][0][0]:.1f} before / "
             f"{res['loadavg'][1][0]:.1f} after.",
             "Command: `.venv/bin/python experiments/bench_sidecar_engines.py "
             + " ".join(res["argv"]) + "`"]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="1,2,4,8", help="engine counts (default: %(default)s)")
    ap.add_argument("--sessions", type=int, default=300, help="sessions per repetition")
    ap.add_argument("--rounds", type=int, default=4, help="calls per session")
    ap.add_argument("--concurrency", type=int, default=32, help="sessions at a time")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per engine count")
    ap.add_argument("--per-engine", action="store_true",
                    help="--sessions and --concurrency per engine (a fixed load per engine) "
                         "instead of for the node")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.engines.split(",")]
    except ValueError:
        ap.error(f"--engines must be numbers separated by commas, not {args.engines!r}")
    if any(c < 1 for c in counts) or min(args.sessions, args.rounds, args.concurrency,
                                         args.reps) < 1:
        ap.error("engine counts, --sessions, --rounds, --concurrency and --reps must be >= 1")
    load0 = os.getloadavg()
    points = []
    with tempfile.TemporaryDirectory(prefix="mars-engines-bench-") as tmp:
        for n in counts:
            print(f"{n} engine(s) ...", file=sys.stderr, flush=True)
            points.append(measure(n, args, Path(tmp)))
    res = {"points": points, "loadavg": [load0, os.getloadavg()], "args": vars(args),
           "argv": sys.argv[1:]}
    print(render(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
