"""What scraping ``/metrics`` costs a sidecar under overload, measured side by side in one run.

    .venv/bin/python experiments/bench_metrics_scrape.py [--streams 200] [--rounds 400]
                                                        [--scrape-interval 1] [--json out.json]

Starts one ``mars-vllm serve --policy mars`` (embedded tiny model; the sidecar admits sessions
through its AIMD window and reads the engine's event stream, so every metric family has data)
and keeps ``--streams`` streaming sessions against it without pause: each stream is one
session's last round, and a finished one is replaced at once by a new session. That is an
overload: more sessions than the window admits, so the sidecar queues some, relays the
others' tokens, and folds every engine event into its metrics.

Under that load a probe makes sequential 1-token calls, each round to the engine directly and
through the sidecar back to back (order rotated; the probe's session is admitted before the
load starts, so it never waits in the queue). Rounds alternate in blocks between *no scraper*
and *a scraper* fetching the sidecar's ``/metrics`` every ``--scrape-interval`` seconds (as
Prometheus would, at 15 times its default rate). The sidecar's added latency is the median of
the per-round differences (through the sidecar minus direct), so the engine's own queueing
under the load cancels; the table gives it with and without the scraper, the scrape's own
latency, the exposition's size and series count.

Cores: EngineCore on core 0 and the HTTP frontends (vLLM's API server, the sidecar) on the
others, as in ``bench_proxy.py`` (a GPU host's shape: the engine computes on the device); the
load generator, which in a deployment runs on the clients' machines, in a process of its own
beside the frontends at the lowest CPU priority, so it only takes what they leave idle. Not a test: the numbers depend on the machine
and on what else runs (the load average is printed); docs/results.md has a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_proxy import MODEL, _one_stream, child_sidecar_pid, pct, split_cores, wait_quiet  # noqa: E402
from mars.launch import ServerProcess  # noqa: E402


class Load:
    """``n`` streaming sessions kept in flight until stopped, from a process of their own at
    the lowest CPU priority (nice 19). A deployment's clients run on other machines: here the
    load must not take the frontends' core from the sidecar and vLLM's API server (from a
    thread of this process it did, and the sidecar's added latency measured the load
    generator), nor can it share the engine's core (the CPU engine's OpenMP thread starved
    it there: streams stalled for seconds and the queue ran dry)."""

    def __init__(self, url: str, n: int, tokens: int, cores: list[int] | None) -> None:
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._done = ctx.Value("i", 0)
        self._errors = ctx.Value("i", 0)
        self._proc = ctx.Process(target=_load_main, daemon=True,
                                 args=(url, n, tokens, cores, self._stop, self._done,
                                       self._errors))

    @property
    def done(self) -> int:
        return self._done.value

    @property
    def errors(self) -> int:
        return self._errors.value

    def __enter__(self) -> "Load":
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(timeout=300)
        if self._proc.is_alive():
            self._proc.kill()
        elif self._proc.exitcode:
            raise RuntimeError(f"the load process died (exit {self._proc.exitcode})")


def _load_main(url: str, n: int, tokens: int, cores: list[int] | None, stop, done,
               errors) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    os.nice(19)
    host, port = urlsplit(url).hostname, urlsplit(url).port

    async def slot(i: int) -> None:
        k = 0
        while not stop.is_set():
            body = json.dumps({
                "model": MODEL, "prompt": [5, 6, 7, 8 + i % 64], "max_tokens": tokens,
                "ignore_eos": True, "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True},
                "vllm_xargs": {"job_id": f"load-{i}-{k}", "last_round": True}}).encode()
            try:
                await _one_stream(host, port, body)
                with done.get_lock():
                    done.value += 1
            except Exception as e:  # counted and shown, never a silent end of the load
                with errors.get_lock():
                    errors.value += 1
                if errors.value <= 3:
                    print(f"load: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                await asyncio.sleep(0.5)
            k += 1

    async def run() -> None:
        await asyncio.gather(*(slot(i) for i in range(n)))

    asyncio.run(run())


class Scraper:
    """Fetches the sidecar's ``/metrics`` every ``interval`` seconds while enabled, then the
    engine's own (which the sidecar's includes: the difference is the sidecar's part)."""

    def __init__(self, url: str, engine_url: str, interval: float) -> None:
        self.url, self.interval = url + "/metrics", interval
        self.engine_url = engine_url + "/metrics"
        self.on = threading.Event()
        self.latency: list[float] = []
        self.engine_latency: list[float] = []
        self.size: list[int] = []
        self.series: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                if not self.on.wait(0.1):
                    continue
                t = time.perf_counter()
                r = c.get(self.url)
                self.latency.append(time.perf_counter() - t)
                r.raise_for_status()
                self.size.append(len(r.content))
                self.series.append(sum(1 for line in r.text.splitlines()
                                       if line and not line.startswith("#")))
                t1 = time.perf_counter()
                c.get(self.engine_url).raise_for_status()
                self.engine_latency.append(time.perf_counter() - t1)
                self._stop.wait(max(0.0, self.interval - (time.perf_counter() - t)))


def probe(targets: dict[str, str], rounds: int, block: int, scraper: Scraper) -> dict:
    """Paired rounds (direct, then through the sidecar, order rotated), in blocks that
    alternate without / with the scraper."""
    out: dict[str, dict[str, list[float]]] = {
        phase: {name: [] for name in targets} for phase in ("off", "on")}
    names = list(targets)
    with httpx.Client(timeout=120) as c:
        def one(name: str) -> float:
            body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1,
                    "vllm_xargs": {"job_id": "probe"}}
            t = time.perf_counter()
            r = c.post(targets[name] + "/v1/completions", json=body)
            dt = time.perf_counter() - t
            assert r.status_code == 200, r.text
            return dt

        for i in range(rounds):
            phase = "on" if (i // block) % 2 else "off"
            if (phase == "on") != scraper.on.is_set():
                (scraper.on.set if phase == "on" else scraper.on.clear)()
            for name in names[i % 2:] + names[:i % 2]:
                out[phase][name].append(one(name))
    scraper.on.clear()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=200,
                    help="streaming sessions kept in flight (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=400,
                    help="paired probe rounds in all (default: %(default)s)")
    ap.add_argument("--block", type=int, default=25,
                    help="rounds per block; blocks alternate off / on (default: %(default)s)")
    ap.add_argument("--scrape-interval", type=float, default=1.0,
                    help="seconds between scrapes while on (default: %(default)s)")
    ap.add_argument("--bound-ms", type=float, default=1.0,
                    help="the sidecar's added-p50 target, docs/sidecar.md (default: %(default)s)")
    ap.add_argument("--quiet-load", type=float, default=2.0)
    ap.add_argument("--quiet-wait", type=float, default=300)
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()
    wait_quiet(args.quiet_load, args.quiet_wait)
    load0 = os.getloadavg()
    print("starting mars-vllm serve --policy mars (tiny model) ...", file=sys.stderr, flush=True)
    server = ServerProcess(args=["--policy", "mars", "--max-model-len", "4096",
                                 "--max-num-seqs", "256", "--seed", "0"],
                           env={"VLLM_CPU_OMP_THREADS_BIND": "0"}).start()
    try:
        sidecar_pid = child_sidecar_pid(server.proc.pid)
        cores = split_cores(server.proc.pid, [sidecar_pid] if sidecar_pid else [])
        targets = {"direct": server.engine_url, "sidecar": server.url}
        with httpx.Client(timeout=60) as c:  # admit the probe's session before the load
            for name in targets:
                c.post(targets[name] + "/v1/completions", json={
                    "model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1,
                    "vllm_xargs": {"job_id": "probe"}}).raise_for_status()
        print(f"load: {args.streams} streams; probe: {args.rounds} paired rounds ...",
              file=sys.stderr, flush=True)
        with Load(server.url, args.streams, args.tokens,
                  cores["frontends"] if cores else None) as load, \
                Scraper(server.url, server.engine_url, args.scrape_interval) as scraper:
            time.sleep(10)  # the window fills, the queue forms
            state = httpx.get(server.url + "/v1/mars/state", timeout=30).json()
            t0 = time.perf_counter()
            lat = probe(targets, args.rounds, args.block, scraper)
            elapsed = time.perf_counter() - t0
            state_end = httpx.get(server.url + "/v1/mars/state", timeout=30).json()
    finally:
        server.stop()
    res = {"latency_s": lat, "scrape_s": scraper.latency,
           "engine_scrape_s": scraper.engine_latency, "scrape_bytes": scraper.size,
           "scrape_series": scraper.series, "streams_done": load.done,
           "load_errors": load.errors, "elapsed_s": elapsed,
           "admitted_queued": [[state.get("admitted"), state.get("queued")],
                               [state_end.get("admitted"), state_end.get("queued")]],
           "loadavg": [load0, os.getloadavg()], "cores": cores, "args": vars(args),
           "argv": sys.argv[1:]}
    print()
    print(render(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


def render(res: dict) -> str:
    lat, args = res["latency_s"], res["args"]
    rows = ["| scraper | rounds | direct p50 ms | sidecar p50 ms | added p50 ms | added p90 ms |",
            "|---|---:|---:|---:|---:|---:|"]
    for phase, label in (("off", "none"), ("on", f"every {args['scrape_interval']:g} s")):
        d, s = lat[phase]["direct"], lat[phase]["sidecar"]
        diffs = [b - a for a, b in zip(d, s)]
        rows.append(f"| {label} | {len(d)} | {statistics.median(d) * 1e3:.2f} | "
                    f"{statistics.median(s) * 1e3:.2f} | {statistics.median(diffs) * 1e3:+.2f} | "
                    f"{pct(diffs, 0.9) * 1e3:+.2f} |")
    sc, es = res["scrape_s"], res["engine_scrape_s"]
    (a0, q0), (a1, q1) = res["admitted_queued"]
    load0, load1 = res["loadavg"]
    rows += ["", (
        f"Scrapes: {len(sc)}, latency p50 {pct(sc, 0.5) * 1e3:.1f} ms / p99 "
        f"{pct(sc, 0.99) * 1e3:.1f} ms (vLLM's own /metrics, which it includes: p50 "
        f"{pct(es, 0.5) * 1e3:.1f} ms / p99 {pct(es, 0.99) * 1e3:.1f} ms), "
        f"{statistics.median(res['scrape_bytes']) / 1024:.0f} KiB, "
        f"{statistics.median(res['scrape_series']):.0f} series (first {res['scrape_series'][0]}, "
        f"last {res['scrape_series'][-1]}). Load: {args['streams']} streams of {args['tokens']} "
        f"tokens kept in flight (nice 19), {res['streams_done']} finished in {res['elapsed_s']:.0f} s "
        f"({res['load_errors']} errors); the sidecar had {a0} sessions admitted and {q0} queued "
        f"at the start, {a1} and {q1} at the end. Target: added p50 within "
        f"{args['bound_ms']:g} ms. Machine: {os.cpu_count()} CPUs, load average "
        f"{load0[0]:.1f} before / {load1[0]:.1f} after; cores "
        + (f"EngineCore on {res['cores']['engine']}, the rest on {res['cores']['frontends']}."
           if res.get("cores") else "not split.")),
        "Command: `.venv/bin/python experiments/bench_metrics_scrape.py "
        + " ".join(res["argv"]) + "`"]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
