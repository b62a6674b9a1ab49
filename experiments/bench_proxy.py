"""Proxy overhead of the mars sidecar vs. direct calls to the same vLLM server, in one run.

    .venv/bin/python experiments/bench_proxy.py [--requests 300] [--tokens 128]
                                                [--concurrency 1,16,64] [--json out.json]

Starts one ``mars-vllm serve`` (embedded tiny model; its default sidecar is pass-through for
``--policy fcfs``) plus standalone sidecars in front of the same engine, then measures, for each
target against the engine itself:

* non-streaming latency: sequential ``/v1/completions`` calls (1 token); each round calls
  every target back to back (order rotated), the added p50 is the median of the per-round
  differences to direct, the added p99 is the target's p99 minus direct's;
* streaming throughput: C concurrent streams of ``--tokens`` tokens each, tokens/s from the
  streams' usage chunks; each repetition runs every target once (order rotated) and the
  ratio is the median over repetitions of target / direct.

Cores (unless ``--no-split-cores``): EngineCore (one torch thread) on core 0; vLLM's API server,
the sidecars and this load generator on the others -- the shape of a GPU host, where the
engine computes on the device and the HTTP frontends share the CPU. Unsplit, the engine's
threads take whichever core is free on this 2-core machine, so every microsecond the sidecar
spends comes out of the engine's throughput and the ratio measures core contention. The load
generator is a raw-socket client that only collects bytes (httpx's per-line SSE parsing cost
more CPU per token than the sidecar) and is the same for every target.

It first waits (bounded) for a quiet machine (``--quiet-load``): on a shared 2-core machine
other work swamps a sub-millisecond signal.

Targets: ``direct`` (the engine), ``sidecar`` (as ``mars-vllm serve`` launches it),
``sidecar+admission`` (admission on, window 128, each client one session) and
``sidecar/httpx`` (pass-through with the httpx upstream client, for comparison).

Prints a markdown table and the command. Not a test: numbers depend on the machine and on
whatever else runs on it (the load average is printed with the table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mars.launch import ServerProcess  # noqa: E402
from mars.sidecar.process import SidecarProcess  # noqa: E402

MODEL = "mars-tiny"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def children(server_pid: int) -> dict[int, bytes]:
    out = {}
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                out[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
    return out


def child_sidecar_pid(server_pid: int) -> int | None:
    """The sidecar ``mars-vllm serve`` started (a child process running mars.sidecar)."""
    return next((pid for pid, cmd in children(server_pid).items() if b"mars.cli.sidecar" in cmd),
                None)


def engine_pids(server_pid: int) -> list[int]:
    """vLLM's other processes (EngineCore, ...): every child but the sidecar."""
    return [pid for pid, cmd in children(server_pid).items() if b"mars.cli.sidecar" not in cmd]


def wait_quiet(max_load: float, max_wait_s: float) -> None:
    """Other work on the machine swamps a sub-millisecond signal: start when it is quiet."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        print(f"waiting for load average {os.getloadavg()[0]:.1f} <= {max_load} ...",
              file=sys.stderr, flush=True)
        time.sleep(15)


def latency(targets: dict[str, str], n: int, session: dict[str, str | None]) -> dict:
    clients = {name: httpx.Client(timeout=60) for name in targets}
    samples: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)

    def one(name: str) -> float:
        body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1}
        if session[name]:
            body["vllm_xargs"] = {"job_id": session[name]}
        t = time.perf_counter()
        r = clients[name].post(targets[name] + "/v1/completions", json=body)
        dt = time.perf_counter() - t
        assert r.status_code == 200, r.text
        return dt

    for name in names:  # warm-up (connections, admission of the latency sessions)
        for _ in range(10):
            one(name)
    for i in range(n):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            samples[name].append(one(name))
    for c in clients.values():
        c.close()
    return samples


_USAGE = re.compile(rb'"completion_tokens":(\d+)')


async def _one_stream(host: str, port: int, body: bytes) -> int:
    """One streamed completion over a raw HTTP/1.1 connection; returns completion tokens.

    The load generator shares the frontends' core with vLLM's API server and the sidecar, so
    it must be light: it only collects the bytes as they come (no SSE or chunked parsing per
    token, which in httpx cost more CPU than the sidecar itself) and reads the usage chunk at
    the end. Both targets get exactly this client.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (host.encode(), len(body), body))
        parts = []
        while data := await reader.read(1 << 16):
            parts.append(data)
    finally:
        writer.close()
    raw = b"".join(parts)
    if not raw.startswith(b"HTTP/1.1 200"):
        raise AssertionError(raw[:300])
    found = _USAGE.findall(raw)
    return int(found[-1]) if found else 0


async def stream_run(url: str, conc: int, tokens: int, tag: str) -> float:
    host, port = urlsplit(url).hostname, urlsplit(url).port

    def body(i: int) -> bytes:
        return json.dumps({
            "model": MODEL, "prompt": [5, 6, 7, 8 + i % 64], "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True},
            "vllm_xargs": {"job_id": f"{tag}-{i}", "last_round": True}}).encode()

    bodies = [body(i) for i in range(conc)]
    t = time.perf_counter()
    counts = await asyncio.gather(*(_one_stream(host, port, b) for b in bodies))
    dt = time.perf_counter() - t
    assert all(c == tokens for c in counts), counts
    return sum(counts) / dt


def pin(pid: int, to: list[int]) -> None:
    """Every thread of process ``pid`` on the cores ``to``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), to)
        except OSError:
            pass


def split_cores(server_pid: int, sidecar_pids: list[int]) -> dict[str, list[int]] | None:
    """EngineCore on core 0; vLLM's API server, the sidecars and this load generator on the
    others. On a GPU host the engine computes on the device and the HTTP frontends have CPU to
    themselves; on this 2-core CPU host an unpinned engine's torch threads take whichever core
    is free, so any CPU the sidecar uses comes straight out of the engine's throughput and the
    ratio measures core contention, not the proxy. Every thread of each process is pinned."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    engine, front = cores[:1], cores[1:]
    for pid in engine_pids(server_pid):
        pin(pid, engine)
    for pid in [server_pid, *sidecar_pids, os.getpid()]:
        pin(pid, front)
    return {"engine": engine, "frontends": front}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300,
                    help="sequential non-streaming calls per target (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream (default: %(default)s)")
    ap.add_argument("--concurrency", default="1,16,64", help="concurrent streams (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per throughput cell (median)")
    ap.add_argument("--no-httpx", action="store_true", help="skip the httpx-client sidecar")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--quiet-load", type=float, default=2.0,
                    help="wait until the 1-min load average is at most this ... (default: %(default)s)")
    ap.add_argument("--quiet-wait", type=float, default=300,
                    help="... for at most this many seconds, then start anyway (default: %(default)s)")
    ap.add_argument("--no-split-cores", action="store_true",
                    help="leave every process on every core (default: EngineCore on core 0, "
                         "the HTTP frontends and the load generator on the others)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only print the table of results saved earlier with --json")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    concs = [int(c) for c in args.concurrency.split(",")]
    wait_quiet(args.quiet_load, args.quiet_wait)
    load0 = os.getloadavg()

    print("starting mars-vllm serve (tiny model) ...", file=sys.stderr, flush=True)
    split = not args.no_split_cores and len(os.sched_getaffinity(0)) >= 2
    server = ServerProcess(args=["--max-model-len", "4096", "--max-num-seqs", str(max(concs)),
                                 "--seed", "0"],
                           # one torch thread, on the engine's core
                           env={"VLLM_CPU_OMP_THREADS_BIND": "0"} if split else None).start()
    cores = None
    sidecars: list[SidecarProcess] = []
    try:
        targets = {"direct": server.engine_url, "sidecar": server.url}
        pids = {"sidecar": child_sidecar_pid(server.proc.pid)}
        adm = SidecarProcess(server.engine_url, [
            "--admission", "on", "--min-window", "128", "--max-window", "128",
            "--max-queue", "4096", "--engine-events", "none"]).start()
        sidecars.append(adm)
        targets["sidecar+admission"], pids["sidecar+admission"] = adm.url, adm.proc.pid
        if not args.no_httpx:
            hx = SidecarProcess(server.engine_url, ["--admission", "off", "--upstream-client",
                                                    "httpx", "--engine-events", "none"]).start()
            sidecars.append(hx)
            targets["sidecar/httpx"], pids["sidecar/httpx"] = hx.url, hx.proc.pid
        session = {name: (f"lat-{name}" if "admission" in name else None) for name in targets}
        if split:
            cores = split_cores(server.proc.pid, [p for p in pids.values() if p])

        print(f"latency: {args.requests} sequential calls per target ...", file=sys.stderr,
              flush=True)
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items() if p}
        lat = latency(targets, args.requests, session)
        cpu_per_req = {k: (cpu_seconds(p) - cpu0[k]) / (args.requests + 10) * 1e6
                       for k, p in pids.items() if p}

        # throughput: each repetition runs every target once (order rotated); a target's
        # ratio is the median over repetitions of its tok/s over direct's in the same one
        thr: dict[str, dict[int, float]] = {name: {} for name in targets}
        ratio: dict[str, dict[int, float]] = {name: {} for name in targets}
        #: CPU seconds of vLLM's API server and of the target's sidecar over all stream runs
        stream_cpu = {name: {"api": 0.0, "engine": 0.0, "sidecar": 0.0, "tokens": 0}
                      for name in targets}
        engines = engine_pids(server.proc.pid)
        for conc in concs:
            print(f"streams: {conc} x {args.tokens} tokens ...", file=sys.stderr, flush=True)
            runs: dict[str, list[float]] = {name: [] for name in targets}
            names = list(targets)
            for rep in range(args.reps):
                order = names[rep % len(names):] + names[:rep % len(names)]
                for name in order:
                    watched = {"api": [server.proc.pid], "engine": engines,
                               "sidecar": [pids[name]] if pids.get(name) else []}
                    c0 = {k: sum(map(cpu_seconds, ps)) for k, ps in watched.items()}
                    runs[name].append(asyncio.run(stream_run(
                        targets[name], conc, args.tokens, f"s{conc}-{rep}-{name}")))
                    for k, ps in watched.items():
                        stream_cpu[name][k] += sum(map(cpu_seconds, ps)) - c0[k]
                    stream_cpu[name]["tokens"] += conc * args.tokens
            for name in names:
                thr[name][conc] = statistics.median(runs[name])
                ratio[name][conc] = statistics.median(
                    a / b for a, b in zip(runs[name], runs["direct"]))
    finally:
        for sc in sidecars:
            sc.stop()
        server.stop()
    load1 = os.getloadavg()
    results = {"latency_s": lat, "throughput_tok_s": thr, "throughput_ratio": ratio,
               "sidecar_cpu_us_per_req": cpu_per_req, "stream_cpu_s": stream_cpu,
               "loadavg": [load0, load1], "cores": cores, "args": vars(args), "argv": sys.argv[1:]}
    print()
    print(render(json.loads(json.dumps(results))))  # same path as --render
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def render(res: dict) -> str:
    """The markdown table (and its notes) from a results dict (as saved with --json)."""
    lat, thr, ratio = res["latency_s"], res["throughput_tok_s"], res["throughput_ratio"]
    cpu_per_req, stream_cpu, args = res["sidecar_cpu_us_per_req"], res["stream_cpu_s"], res["args"]
    concs = list(thr["direct"])
    d99 = pct(lat["direct"], 0.99)
    head = ["target", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "sidecar CPU/req µs"]
    head += [f"stream ×{c}" for c in concs]
    head += ["CPU µs/streamed token: sidecar / vLLM API server"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in lat:
        p50, p99 = pct(lat[name], 0.5), pct(lat[name], 0.99)
        added = name != "direct"
        # added p50: median of the per-round differences (each round calls every target
        # back to back), which cancels most of the drift a shared machine adds
        paired = statistics.median(a - b for a, b in zip(lat[name], lat["direct"]))
        row = [f"`{name}`", f"{p50 * 1e3:.2f}", f"{p99 * 1e3:.2f}",
               f"{paired * 1e3:+.2f}" if added else "—",
               f"{(p99 - d99) * 1e3:+.2f}" if added else "—",
               f"{cpu_per_req[name]:.0f}" if name in cpu_per_req else "—"]
        for c in concs:
            row.append(f"{ratio[name][c]:.1%}" if added else f"{thr[name][c]:.0f} tok/s")
        sc = stream_cpu[name]
        per_tok = lambda k, sc=sc: sc[k] / max(1, sc["tokens"]) * 1e6  # noqa: E731
        row.append(f"{per_tok('sidecar'):.0f} / {per_tok('api'):.0f}" if added
                   else f"— / {per_tok('api'):.0f}")
        lines.append("| " + " | ".join(row) + " |")
    load0, load1 = res["loadavg"]
    lines += ["", (
        f"Machine: {os.cpu_count()} CPUs, load average {load0[0]:.1f} before / {load1[0]:.1f} "
        f"after. Latency: {args['requests']} sequential 1-token calls per target; added p50 = "
        f"median of the per-round differences to direct, added p99 = p99 − direct p99. "
        f"Streams of {args['tokens']} tokens: direct in tok/s, the others as the median over "
        f"{args['reps']} rotated repetitions of their tok/s over direct's in the same "
        f"repetition. CPU from /proc (10 ms ticks); the `sidecar` one also reads the engine's "
        f"event stream, which in the latency phase carries every target's traffic. "
        + (f"Cores: EngineCore on {res['cores']['engine']}, vLLM's API server, the sidecars "
           f"and the load generator on {res['cores']['frontends']}."
           if res.get("cores") else "Cores: not split.")),
        "Command: `.venv/bin/python experiments/bench_proxy.py " + " ".join(res.get("argv", []))
        + "`"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
