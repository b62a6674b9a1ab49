"""What scraping ``/metrics`` costs a sidecar under overload, measured side by side in one run.

    .venv/bin/python experiments/bench_metrics_scrape.py [--streams 200] [--rounds 600]
        [--scrape-interval 1] [--layout shared|sidecar-core] [--json out.json]

Starts one ``mars-vllm serve --policy mars --no-sidecar`` (embedded tiny model) and the
sidecar ``mars-vllm serve --policy mars`` would start in front of it (admission through its
AIMD window, the engine's event stream read, so every metric family has data), and keeps ``--streams`` streaming sessions against it without pause: each stream is one
session's last round, and a finished one is replaced at once by a new session. That is an
overload: more sessions than the window admits, so the sidecar queues some, relays the
others' tokens, and folds every engine event into its metrics.

Under that load a probe makes sequential 1-token calls, in blocks that alternate between *no
scraper* and *a scraper* fetching the sidecar's ``/metrics`` every ``--scrape-interval``
seconds (default 1 s; Prometheus's own default is one minute, its example configuration 15 s).
The probe's session is admitted before the load starts, so it never waits in the queue. What
the sidecar adds to a call is measured on that call itself: the sidecar's upstream is a byte
relay (*the tap*, a process of its own) in front of the engine, which stamps when each probe
call's request reaches it and when the first byte of its answer comes back from the engine;
the probe stamps when it sent the call and when the first byte came back (one monotonic clock,
the machine's). The first span less the second is *the sidecar's span*: its reading, parsing,
admission bookkeeping and forwarding both ways, any wait on its event loop, and four socket
hops (client to sidecar to tap, and back). A client of the engine alone pays two of them
(client to engine and back), so each round pairs the call through the sidecar with one
straight to the tap (*the control*, in alternating order): its span less the tap's is those
two hops and the tap's own wake-ups, and the round's *sidecar added* is the sidecar's span
less the control's, what the sidecar adds in a deployment (its work and one more hop each
way). The probe keeps one keep-alive connection to each, as an OpenAI client's pool does.
(Earlier versions paired each call with one straight to the engine, whose differences under
this overload had a p90 of ~60 ms since a 1-token call waits for whichever CPU-engine step is
running; then measured the sidecar's span alone over a fresh connection per call, charging the
sidecar with the client's connection set-up and the tap's wake-ups: +1.3 ms at p50 nearly
idle.) Then, still under
the load, the sidecar's ``/metrics`` and vLLM's own (which the sidecar fetches and appends)
are scraped back to back: the paired difference is what the sidecar adds to a scrape.

Cores: EngineCore on core 0 and the HTTP frontends (vLLM's API server, the sidecar, the tap)
on the others, as in ``bench_proxy.py`` (a GPU host's shape: the engine computes on the device); the
load generator and the scraper, which in a deployment run on other machines, in processes of
their own beside the frontends at the lowest CPU priority, so they only take what the
frontends leave idle. Not a test: the numbers depend on the machine and on what else runs
(the load average is printed); docs/results.md has a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_proxy import (MODEL, _one_stream, engine_pids, pct, pin,  # noqa: E402
                         split_cores, wait_quiet)
from mars.launch import ServerProcess, free_port  # noqa: E402
from mars.sidecar.process import SidecarProcess  # noqa: E402


class _Background:
    """A helper process of this benchmark (the load, the scraper): spawned on ``cores`` at
    nice 19 (see :func:`_background`), told to stop through an event, its errors counted in
    shared memory. Subclasses pass their target and its own arguments; the target gets
    ``(cores, stop, errors, *args)``."""

    def __init__(self, target: Any, *args: Any, cores: list[int] | None) -> None:
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._errors = ctx.Value("i", 0)
        self._proc = ctx.Process(target=target, daemon=True,
                                 args=(cores, self._stop, self._errors, *args))

    @property
    def errors(self) -> int:
        return self._errors.value

    def __enter__(self):
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(timeout=300)
        if self._proc.is_alive():
            self._proc.kill()
        elif self._proc.exitcode:
            raise RuntimeError(f"{type(self).__name__.lower()} process died "
                               f"(exit {self._proc.exitcode})")


def _renice(nice: int) -> None:
    """Run at this priority (below 0 needs privileges: said, and the run goes on)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        print(f"cannot renice to {nice}: {e}", file=sys.stderr)


def _background(cores: list[int] | None) -> None:
    """In a helper process: beside the frontends, at the lowest CPU priority."""
    if cores:
        os.sched_setaffinity(0, cores)
    os.nice(19)


class Load(_Background):
    """``n`` streaming sessions kept in flight until stopped, from a process of their own at
    the lowest CPU priority (nice 19). A deployment's clients run on other machines: here the
    load must not take the frontends' core from the sidecar and vLLM's API server (from a
    thread of this process it did, and the sidecar's added latency measured the load
    generator), nor can it share the engine's core (the CPU engine's OpenMP thread starved
    it there: streams stalled for seconds and the queue ran dry)."""

    def __init__(self, url: str, n: int, tokens: int, cores: list[int] | None) -> None:
        done = mp.get_context("spawn").Value("i", 0)
        super().__init__(_load_main, url, n, tokens, done, cores=cores)
        self._done = done

    @property
    def done(self) -> int:
        return self._done.value


def _load_main(cores: list[int] | None, stop, errors, url: str, n: int, tokens: int,
               done) -> None:
    _background(cores)
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


class Scraper(_Background):
    """Fetches the sidecar's ``/metrics`` every ``interval`` seconds while ``on`` is set, from
    a process of its own at nice 19 (like the load: Prometheus runs elsewhere, and parsing
    81 KiB a second in the probe's process would slow the probe). Each scrape's latency,
    size and series count go to ``log``; a failed scrape is counted, never silent."""

    def __init__(self, url: str, interval: float, cores: list[int] | None, log: Path) -> None:
        on = mp.get_context("spawn").Event()
        super().__init__(_scrape_main, url + "/metrics", interval, str(log), on, cores=cores)
        self.on, self.log = on, log

    def scrapes(self) -> list[tuple[float, int, int, int]]:
        """(latency s, bytes, series, mars series) of every scrape so far."""
        if not self.log.exists():
            return []
        return [tuple(json.loads(line)) for line in self.log.read_text().splitlines()]


def _scrape_main(cores: list[int] | None, stop, errors, url: str, interval: float, log: str,
                 on) -> None:
    _background(cores)
    with httpx.Client(timeout=60) as c, open(log, "a") as out:
        while not stop.is_set():
            if not on.wait(0.1):
                continue
            t = time.perf_counter()
            try:
                r = c.get(url)
                r.raise_for_status()
            except httpx.HTTPError as e:
                with errors.get_lock():
                    errors.value += 1
                print(f"scraper: {type(e).__name__}: {e}", file=sys.stderr)
            else:
                lines = [ln for ln in r.text.splitlines() if ln and not ln.startswith("#")]
                out.write(json.dumps([time.perf_counter() - t, len(r.content), len(lines),
                                      sum(ln.startswith("mars_") for ln in lines)]) + "\n")
                out.flush()
            stop.wait(max(0.0, interval - (time.perf_counter() - t)))


def scrape_latency(sidecar: str, engine: str, n: int) -> dict[str, list[float]]:
    """``n`` rounds of the sidecar's ``/metrics`` and vLLM's own, back to back: the sidecar's
    includes vLLM's, so the paired difference is what the sidecar adds to a scrape."""
    out: dict[str, list[float]] = {"sidecar": [], "engine": []}
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            for name, url in ((("sidecar", sidecar), ("engine", engine)) if i % 2 else
                              (("engine", engine), ("sidecar", sidecar))):
                t = time.perf_counter()
                c.get(url + "/metrics").raise_for_status()
                out[name].append(time.perf_counter() - t)
    return out


#: what marks a probe call's request for the tap (in the OpenAI ``user`` field, which the
#: sidecar passes on and vLLM ignores)
_MARK = re.compile(rb"tapmark-(\d+)")


class Tap(_Background):
    """A byte relay from ``port`` to the engine's ``upstream_port`` that stamps, for each
    request carrying a probe mark, when it arrived (``time.monotonic_ns``) and when the first
    byte of its answer was passed back, as lines ``mark t_in t_out`` in ``log``. HTTP/1.1
    without pipelining: the first answer bytes on a connection after a marked request are
    its answer. The sidecar's upstream client is pointed here."""

    def __init__(self, port: int, upstream_port: int, cores: list[int] | None,
                 log: Path, nice: int = 0) -> None:
        ready = mp.get_context("spawn").Event()
        super().__init__(_tap_main, port, upstream_port, str(log), ready, nice, cores=cores)
        self.ready, self.log = ready, log

    def __enter__(self):
        super().__enter__()
        if not self.ready.wait(30):
            raise RuntimeError("the tap did not start")
        return self

    def spans(self) -> dict[int, int]:
        """Mark -> nanoseconds from the request's arrival to its answer's first byte."""
        out = {}
        if self.log.exists():
            for line in self.log.read_text().splitlines():
                k, t_in, t_out = map(int, line.split())
                out[k] = t_out - t_in
        return out


def _tap_main(cores: list[int] | None, stop, errors, port: int, upstream_port: int, log: str,
              ready, nice: int) -> None:
    if cores:  # beside the frontends: it relays every call
        os.sched_setaffinity(0, cores)
    if nice:
        _renice(nice)
    out = open(log, "a", buffering=1)

    async def pipe(reader, writer, marks: list | None, pending: list) -> None:
        try:
            while data := await reader.read(1 << 16):
                if marks is not None:  # sidecar -> engine
                    now = time.monotonic_ns()
                    pending.extend((int(m.group(1)), now) for m in _MARK.finditer(data))
                elif pending:  # engine -> sidecar: the first bytes of the marked answer
                    k, t_in = pending.pop(0)
                    out.write(f"{k} {t_in} {time.monotonic_ns()}\n")
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(cr, cw) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream_port)
        except OSError:
            with errors.get_lock():
                errors.value += 1
            cw.close()
            return
        pending: list[tuple[int, int]] = []
        try:
            await asyncio.gather(pipe(cr, uw, [], pending), pipe(ur, cw, None, pending))
        except asyncio.CancelledError:  # (the tap stopping with connections open)
            pass

    async def run() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.2)
        server.close()

    asyncio.run(run())
    out.close()


class _Reply:
    """httptools' callbacks for one answer: only its end matters."""

    done = False

    def on_message_complete(self) -> None:
        self.done = True


class _ProbeConnection:
    """The probe's connection to one target: by default one HTTP/1.1 keep-alive connection,
    opened once, as an OpenAI client's pool keeps it, so a call pays no connect and no accept
    (a fresh connection per call charged the sidecar's accept to the sidecar, which a client
    of the engine alone pays as well); ``fresh``: a new one per call."""

    def __init__(self, host: str, port: int, fresh: bool = False) -> None:
        self.host, self.port = host, port
        #: a new connection for every call, opened just before it (``--connection fresh``,
        #: the earlier method, for comparison)
        self.fresh = fresh
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "_ProbeConnection":
        if not self.fresh:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.close()

    async def call(self, k: int) -> int:
        """One 1-token call of the admitted probe session, marked ``k`` for the tap:
        nanoseconds from sending it to its answer's first byte. Reads the whole answer."""
        import httptools

        if self.fresh:
            if self.writer is not None:
                self.writer.close()
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None and self.writer is not None
        body = json.dumps({"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1,
                           "user": f"tapmark-{k}", "vllm_xargs": {"job_id": "probe"}}).encode()
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
               b"\r\nContent-Length: %d\r\n\r\n%s" % (self.host.encode(), len(body), body))
        reply = _Reply()
        parser = httptools.HttpResponseParser(reply)
        t0 = time.monotonic_ns()
        self.writer.write(req)
        data = await self.reader.read(1 << 16)
        t1 = time.monotonic_ns()
        while True:
            if not data:
                raise AssertionError("the connection closed before the answer ended")
            parser.feed_data(data)
            if reply.done:
                break
            data = await self.reader.read(1 << 16)
        if parser.get_status_code() != 200:
            raise AssertionError(f"probe call {k}: HTTP {parser.get_status_code()}")
        return t1 - t0


def probe(url: str, tap_port: int, rounds: int, block: int, scraper: Scraper,
          fresh: bool = False) -> dict[str, dict[str, dict[int, int]]]:
    """Sequential marked calls in pairs, in blocks that alternate without / with the scraper:
    each pair is one call through the sidecar (even mark) and one straight to the tap (odd
    mark; the control: what a client's own two socket hops to a relay cost, which the
    sidecar's span also holds), in alternating order. Phase -> path -> mark -> nanoseconds to
    the first byte, as the probe saw them."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    out: dict[str, dict[str, dict[int, int]]] = {ph: {"sidecar": {}, "tap": {}}
                                                 for ph in ("off", "on")}

    async def run() -> None:
        async with _ProbeConnection(host, port, fresh) as side, \
                _ProbeConnection(host, tap_port, fresh) as tap:
            for i in range(rounds):
                phase = "on" if (i // block) % 2 else "off"
                if (phase == "on") != scraper.on.is_set():
                    (scraper.on.set if phase == "on" else scraper.on.clear)()
                order = (("sidecar", side, 2 * i), ("tap", tap, 2 * i + 1))
                for path, conn, k in (order if i % 2 == 0 else order[::-1]):
                    out[phase][path][k] = await conn.call(k)

    asyncio.run(run())
    scraper.on.clear()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=200,
                    help="streaming sessions kept in flight (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=64,
                    help="tokens per stream (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=600,
                    help="probe rounds (a call through the sidecar and one straight to the "
                         "tap) in all, half of them with the scraper "
                         "(default: %(default)s)")
    ap.add_argument("--block", type=int, default=25,
                    help="rounds per block; blocks alternate off / on (default: %(default)s)")
    ap.add_argument("--scrape-interval", type=float, default=1.0,
                    help="seconds between scrapes while on (default: %(default)s)")
    ap.add_argument("--scrape-rounds", type=int, default=30,
                    help="paired scrapes of the sidecar's and vLLM's /metrics after the probe, "
                         "under the same load (default: %(default)s)")
    ap.add_argument("--bound-ms", type=float, default=1.0,
                    help="the sidecar's added-p50 target, docs/sidecar.md (default: %(default)s)")
    ap.add_argument("--quiet-load", type=float, default=2.0,
                    help="wait until the 1-min load average is at most this ... "
                         "(default: %(default)s)")
    ap.add_argument("--quiet-wait", type=float, default=300,
                    help="... for at most this many seconds, then start anyway "
                         "(default: %(default)s)")
    ap.add_argument("--layout", choices=("shared", "sidecar-core"), default="shared",
                    help="shared: EngineCore on the first core, every frontend (vLLM's API "
                         "server, the sidecar, the tap, the probe) on the others; "
                         "sidecar-core: EngineCore and vLLM's API server on the first core, "
                         "the sidecar on the others with the tap and the probe at a higher "
                         "priority (nice -5), as on a GPU host whose frontends have cores to "
                         "spare (default: %(default)s)")
    ap.add_argument("--connection", choices=("keep-alive", "fresh"), default="keep-alive",
                    help="keep-alive: the probe keeps one connection to the sidecar and one to "
                         "the tap, as an OpenAI client's pool does; fresh: a new connection "
                         "per call, opened just before it (the earlier method: the sidecar's "
                         "span then holds its accepting the connection, and the control "
                         "the tap's connecting to the engine: read its sidecar's span column "
                         "only) (default: %(default)s)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()
    if args.streams < 1 or args.block < 1 or args.rounds < 2 * args.block:
        ap.error("--streams and --block must be >= 1 and --rounds >= 2 x --block (both "
                 "phases need rounds)")
    if args.scrape_interval <= 0 or args.scrape_rounds < 1:
        ap.error("--scrape-interval must be > 0 and --scrape-rounds >= 1")
    wait_quiet(args.quiet_load, args.quiet_wait)
    load0 = os.getloadavg()
    print("starting mars-vllm serve --policy mars --no-sidecar (tiny model), the tap and "
          "mars sidecar ...", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="mars-scrape-bench-"))
    events = f"ipc://{tmp}/engine-events.ipc"
    # the engine alone, publishing its events; the sidecar below is the one `mars-vllm serve
    # --policy mars` would start (admission on, the engine's events), its upstream the tap
    server = ServerProcess(args=["--policy", "mars", "--no-sidecar", "--mars-events-endpoint",
                                 events, "--max-model-len", "4096", "--max-num-seqs", "256",
                                 "--seed", "0"],
                           env={"VLLM_CPU_OMP_THREADS_BIND": "0"}).start()
    sidecar: SidecarProcess | None = None
    try:
        own = args.layout == "sidecar-core"
        cores = split_cores(server.proc.pid, [])
        if cores and own:  # the engine and vLLM's API server on one core, the sidecar's own
            for pid in [server.proc.pid, *engine_pids(server.proc.pid)]:
                pin(pid, cores["engine"])
            _renice(-5)  # the probe's own reads are not the sidecar's time
        front = cores["frontends"] if cores else None
        tap_port = free_port()
        with Tap(tap_port, urlsplit(server.url).port, front, tmp / "tap",
                 nice=-5 if own else 0) as tap:
            sidecar = SidecarProcess(f"http://127.0.0.1:{tap_port}", [
                "--admission", "on", "--engine-events", events]).start()
            if cores:
                pin(sidecar.proc.pid, front)
            # admit the probe's session before the load (it never waits in the queue)
            httpx.post(sidecar.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1,
                "vllm_xargs": {"job_id": "probe"}}).raise_for_status()
            print(f"load: {args.streams} streams; probe: {args.rounds} calls ...",
                  file=sys.stderr, flush=True)
            with Load(sidecar.url, args.streams, args.tokens, front) as load, \
                    Scraper(sidecar.url, args.scrape_interval, front, tmp / "scrapes") as sc:
                time.sleep(10)  # the window fills, the queue forms
                state = httpx.get(sidecar.url + "/v1/mars/state", timeout=30).json()
                t0, done0 = time.perf_counter(), load.done
                seen = probe(sidecar.url, tap_port, args.rounds, args.block, sc,
                             fresh=args.connection == "fresh")
                elapsed, done1 = time.perf_counter() - t0, load.done
                state_end = httpx.get(sidecar.url + "/v1/mars/state", timeout=30).json()
                print(f"scrapes: {args.scrape_rounds} paired rounds ...", file=sys.stderr,
                      flush=True)
                pair = scrape_latency(sidecar.url, server.url, args.scrape_rounds)
                scrapes, scrape_errors = sc.scrapes(), sc.errors
            time.sleep(0.5)  # (the tap's last lines)
            spans = tap.spans()
        tap_errors = tap.errors
        missing = sum(1 for ph in seen.values() for path in ph.values() for k in path
                      if k not in spans)
        if load.errors or scrape_errors or tap_errors or not scrapes or missing:
            print(f"load errors {load.errors}, scrape errors {scrape_errors}, tap errors "
                  f"{tap_errors}, scrapes {len(scrapes)}, probe calls the tap did not see "
                  f"{missing}: the run does not measure what it says", file=sys.stderr)
            return 1
    finally:
        if sidecar is not None:
            sidecar.stop()
        server.stop()
    lat = {ph: {path: {"client_ns": [v[k] for k in sorted(v)],
                       "engine_ns": [spans[k] for k in sorted(v)]} for path, v in paths.items()}
           for ph, paths in seen.items()}
    res = {"latency_s": lat, "scrapes": scrapes, "scrape_pair_s": pair,
           "streams_done": done1 - done0, "elapsed_s": elapsed,
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
    rows = ["| scraper | calls | first byte p50 ms | engine's part p50 ms | sidecar's span p50 "
            "ms | the control's p50 ms | sidecar added p50 ms | added p90 ms | added p99 ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for phase, label in (("off", "none"), ("on", f"every {args['scrape_interval']:g} s")):
        c, e = lat[phase]["sidecar"]["client_ns"], lat[phase]["sidecar"]["engine_ns"]
        cc, ce = lat[phase]["tap"]["client_ns"], lat[phase]["tap"]["engine_ns"]
        span = [(a - b) / 1e6 for a, b in zip(c, e)]
        control = [(a - b) / 1e6 for a, b in zip(cc, ce)]
        added = [s - t for s, t in zip(span, control)]  # round by round
        # over fresh connections the control also pays the tap's connecting to the engine
        # (it connects before it reads the request): its "added" would be biased low
        shown = (f"{statistics.median(added):+.3f} | {pct(added, 0.9):+.3f} | "
                 f"{pct(added, 0.99):+.3f}" if args.get("connection") != "fresh" else
                 "n/a | n/a | n/a")
        rows.append(f"| {label} | {len(c)} + {len(cc)} | {statistics.median(c) / 1e6:.2f} | "
                    f"{statistics.median(e) / 1e6:.2f} | {statistics.median(span):+.3f} | "
                    f"{statistics.median(control):+.3f} | {shown} |")
    lat_s = [x[0] for x in res["scrapes"]]
    pair = res["scrape_pair_s"]
    added = [a - b for a, b in zip(pair["sidecar"], pair["engine"])]
    series = [x[2] for x in res["scrapes"]]
    kib = statistics.median(x[1] for x in res["scrapes"]) / 1024
    ours = statistics.median(x[3] for x in res["scrapes"])
    side, eng = statistics.median(pair["sidecar"]), statistics.median(pair["engine"])
    (a0, q0), (a1, q1) = res["admitted_queued"]
    load0, load1 = res["loadavg"]
    rows += ["", (
        f"Scrapes during the probe: {len(lat_s)}, {pct(lat_s, 0.5) * 1e3:.1f} ms at p50 / "
        f"{pct(lat_s, 0.99) * 1e3:.1f} ms at p99, {kib:.0f} KiB, "
        f"{statistics.median(series):.0f} series ({ours:.0f} of them mars's; first "
        f"{series[0]}, last {series[-1]}). Afterwards, under the same load, {len(added)} "
        f"scrapes of the sidecar and of vLLM's own /metrics back to back: {side * 1e3:.1f} vs "
        f"{eng * 1e3:.1f} ms at p50; what the sidecar adds (median of the paired differences): "
        f"{statistics.median(added) * 1e3:+.1f} ms. Load: {args['streams']} streams of "
        f"{args['tokens']} tokens kept in flight (nice 19), {res['streams_done']} finished in "
        f"the probe's {res['elapsed_s']:.0f} s; the sidecar had {a0} sessions admitted and {q0} "
        f"queued as the probe began, {a1} and {q1} as it ended. Target: added p50 within "
        f"{args['bound_ms']:g} ms. Machine: {os.cpu_count()} CPUs, load average "
        f"{load0[0]:.1f} before / {load1[0]:.1f} after; cores "
        + ((f"EngineCore and vLLM's API server on {res['cores']['engine']}, the sidecar "
            f"on {res['cores']['frontends']} (the tap and the probe beside it at nice -5)."
            if args.get("layout") == "sidecar-core" else
            f"EngineCore on {res['cores']['engine']}, the rest on "
            f"{res['cores']['frontends']}.") if res.get("cores") else "not split.")),
        "Command: `.venv/bin/python experiments/bench_metrics_scrape.py "
        + " ".join(res["argv"]) + "`"]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
