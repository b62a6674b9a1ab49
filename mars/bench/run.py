"""Run a bench: start what each point needs (a ``mars-vllm serve`` per policy, or per point
for the policies whose sidecar keeps state between points; or, with ``--sim``, nothing), run the
points' command lines (:mod:`mars.bench.plan`) as child processes, at most ``--jobs`` at a
time, with a progress line every ``--progress-interval`` seconds, and record every finished
point (:mod:`mars.bench.record`). Ctrl-C stops the replays (which still write their partial
results) and the servers; the tables are written from what finished and ``--resume``
continues. Output layout and design choices: :mod:`mars.bench` and docs/bench.md.

Past 600 lines on purpose: :class:`Bench` is one supervisor (the points in flight, their servers,
the progress line and Ctrl-C share one lock and one set of child processes, and an interrupt
must reach all of them); planning, records, reports, ideal latencies and worker processes are
modules of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TextIO

from mars.launch import pinned_to

from .ideal import SharedIdeals
from .observe import last_line, loadavg, replay_progress, versions
from .plan import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    BenchConfig,
    BenchError,
    Point,
    build_traces,
    replay_command,
    same_tasks,
    sim_argv,
)
from .record import (
    BENCH_SCHEMA,
    BENCH_VERSION,
    finite,
    fmt_dur,
    point_summary,
    report_md,
    write_document,
)
from .report import compare, format_tables, rate_key, write_plots
from .workers import WorkerPool


def warm_up(url: str, timeout_s: float = 120.0) -> str | None:
    """A few completions straight to the engine (not through the sidecar, so no admission
    session is opened) so that no policy's first measured point pays the fresh server's
    first-request costs. The last one decodes 96 tokens: the engine snapshots its queues
    when a request arrives (``waiting 1, running 0``) and then only every 0.5 s while it
    steps, so a warm-up of short requests only would leave that arrival snapshot as the
    engine's last word, which the sidecar reads as a queue; a request that decodes for a
    while leaves a snapshot of it running instead. Returns an error message, or None."""
    import httpx

    try:
        with httpx.Client(timeout=timeout_s) as c:
            model = c.get(url + "/v1/models").json()["data"][0]["id"]
            for n, out in ((32, 8), (256, 8), (64, 96)):
                r = c.post(url + "/v1/completions", json={
                    "model": model, "prompt": [100 + (7 * i) % 700 for i in range(n)],
                    "max_tokens": out, "min_tokens": out, "ignore_eos": True,
                    "temperature": 0.0})
                r.raise_for_status()
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------------------- bench


class Bench:
    def __init__(self, cfg: BenchConfig, out: TextIO | None = None, err: TextIO | None = None,
                 argv: Sequence[str] | None = None) -> None:
        self.cfg = cfg
        self.stdout = out or sys.stdout
        self.stderr = err or sys.stderr
        self.argv = list(argv if argv is not None else sys.argv)
        self.lock = threading.RLock()
        self.stop = threading.Event()
        self.children: dict[int, subprocess.Popen] = {}
        self.starting: dict[str, tuple[Any, float]] = {}
        self.active: dict[tuple, tuple[Point, Path, float]] = {}
        self.ideals = SharedIdeals(cfg.out / "ideal", ideal=cfg.ideal,
                                   simulated=bool(cfg.sim), lock=self.lock)
        self.servers: dict[str, dict[str, Any]] = {}
        self.points: list[Point] = []
        self.traces: dict[tuple[str, str], Path] = {}
        self.t0 = time.monotonic()
        self.start_unix = time.time()
        self.finished_walls: list[float] = []
        self.startups: list[float] = []
        self.interrupted = False
        self.groups_left = 0
        self.tool_cores: list[int] | None = None
        self.engine_cores: list[int] | None = None
        #: processes that run simulated points (``--sim``), started as points need them
        self.workers = WorkerPool()

    # ------------------------------------------------------------------------ output

    def say(self, msg: str) -> None:
        with self.lock:
            print(msg, file=self.stderr, flush=True)

    # ----------------------------------------------------------------------- prepare

    def prepare(self) -> None:
        from mars.workloads.ideal import trace_digest
        from mars.workloads.results import ResultsError, read_results
        from mars.workloads.toolpool import available_cores
        from mars.workloads.trace import dumps_trace, read_trace, write_trace

        cfg = self.cfg
        doc_path = cfg.out / "bench.json"
        if doc_path.exists() and not cfg.resume:
            raise BenchError(f"{cfg.out} already holds a bench (bench.json); pass --resume to "
                             "continue it, or choose another --out")
        if cfg.resume and doc_path.exists():
            try:
                old = json.loads(doc_path.read_text())
            except ValueError as e:
                raise BenchError(f"{doc_path}: not JSON ({e})") from None
            old_cfg = old.get("config") or {}
            diff = [k for k, v in cfg.settings().items() if old_cfg.get(k) != v]
            if diff:
                raise BenchError(f"--resume: {cfg.out} was run with other settings "
                                 f"({', '.join(diff)}); use the same options or another --out")

        if cfg.jobs > 1 or cfg.sim:
            self.engine_cores = self.tool_cores = None
            if cfg.tool_cores:
                self.tool_cores = cfg.tool_cores
        elif cfg.pin:
            avail = available_cores()
            eng, tools = (avail, avail) if len(avail) < 2 else (avail[:-1], avail[-1:])
            self.engine_cores = cfg.engine_cores or eng
            self.tool_cores = cfg.tool_cores or tools
        else:
            self.tool_cores = cfg.tool_cores

        traces = build_traces(cfg)
        for reg in cfg.regimes:
            self.ideals.set_shared(reg, same_tasks(
                [traces[(reg, rate_key(r))] for r in cfg.rates_for(reg)]))
        digests = {}
        for (reg, rk), tr in traces.items():
            p = cfg.out / "traces" / reg / f"rate-{rk}.jsonl"
            p.parent.mkdir(parents=True, exist_ok=True)
            write_trace(tr, p)
            self.traces[(reg, rk)] = p
            digests[(reg, rk)] = trace_digest(dumps_trace(read_trace(p)))

        if cfg.resume:
            for reg in cfg.regimes:
                self.ideals.resume(reg)

        for pol in cfg.policies:
            for reg in cfg.regimes:
                for rate in cfg.rates_for(reg):
                    d = cfg.out / "runs" / reg / pol / f"rate-{rate_key(rate)}"
                    pt = Point(reg, rate, pol, str(d))
                    if cfg.resume and (d / "results.json").exists():
                        try:
                            res = read_results(d)
                        except ResultsError:
                            res = None
                        if (res is not None and res.mode == "load"
                                and not res.run.get("interrupted")
                                and res.trace.get("sha256") == digests[(reg, rate_key(rate))]):
                            pt.status, pt.reused = "done", True
                            pt.summary = point_summary(res)
                            pt.ideal = (res.config.get("ideal") or {}).get("source")
                    self.points.append(pt)

    # --------------------------------------------------------------------------- run

    def run(self) -> int:
        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.prepare()
        todo = [p for p in self.points if p.status != "done"]
        groups = self.groups(todo)
        n_servers = len(groups)
        self.groups_left = n_servers
        rates = "; ".join(f"{reg} at {', '.join(rate_key(r) for r in cfg.rates_for(reg))}"
                          for reg in cfg.regimes) if cfg.regime_rates else \
            f"{', '.join(cfg.regimes)} x rates {', '.join(rate_key(r) for r in cfg.rates)}"
        self.say(f"mars bench{f' (preset {cfg.preset})' if cfg.preset else ''}: {rates}"
                 f" x policies {', '.join(cfg.policies)}: {len(self.points)} points "
                 f"({len(self.points) - len(todo)} reused), {n_servers} "
                 f"{'simulation(s)' if cfg.sim else 'server start(s)'}, "
                 f"{cfg.num_tasks} tasks per point; output {cfg.out}")
        if cfg.sim:
            gpus = f"{cfg.engines} x {cfg.sim} (placement {cfg.placement})" \
                if cfg.engines > 1 else cfg.sim
            self.say(f"mars bench: SIMULATED in virtual time (mars sim) on the EMULATED GPU "
                     f"{gpus}, {cfg.sim_tool_cores} virtual tool cores; {cfg.jobs} point(s) "
                     "at a time (virtual time: latencies stay comparable)")
        elif cfg.jobs > 1:
            self.say(f"mars bench: --jobs {cfg.jobs}: servers run concurrently and share the "
                     "CPU, so latencies are NOT comparable across policies (smoke-test mode)")
        elif self.engine_cores:
            from mars.workloads.toolpool import format_cores

            self.say(f"mars bench: engine on cores {format_cores(self.engine_cores)}, CPU-bound "
                     f"tools on {format_cores(self.tool_cores or [])}")
        self.save()

        old_term = None
        if threading.current_thread() is threading.main_thread():
            def on_term(signum, frame):  # noqa: ARG001
                raise KeyboardInterrupt
            old_term = signal.signal(signal.SIGTERM, on_term)
        try:
            if groups:
                with ThreadPoolExecutor(max_workers=max(1, cfg.jobs),
                                        thread_name_prefix="bench") as ex:
                    futures = [ex.submit(self._group, label, pts) for label, pts in groups]
                    self._supervise(futures)
        finally:
            self.workers.close()
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
        return self.finish()

    def groups(self, todo: list[Point]) -> list[tuple[str, list[Point]]]:
        """``(server label, points)`` per server start. ``--restart auto`` restarts the server
        between points only for policies with the sidecar's admission on: its AIMD window
        is state that outlives a run (an idle sidecar keeps the window the last run left),
        so the next point would start from the previous point's end, not from scratch."""
        from mars.policy.registry import get_policy

        if self.cfg.sim:  # no server: every point is its own simulation
            return [(p.label(), [p]) for p in todo]
        out: list[tuple[str, list[Point]]] = []
        for pol in self.cfg.policies:
            pts = [p for p in todo if p.policy == pol]
            if not pts:
                continue
            per_point = self.cfg.restart == "point" or (
                self.cfg.restart == "auto" and get_policy(pol).sidecar_admission)
            if per_point and len(pts) > 1:
                out += [(f"{pol} {p.regime} rate {rate_key(p.rate)}", [p]) for p in pts]
            else:
                out.append((pol, pts))
        return out

    def _supervise(self, futures: list[Future]) -> None:
        interrupts = 0
        last = time.monotonic()
        while True:
            try:
                _, pending = wait(futures, timeout=1.0)
                if not pending:
                    break
                if time.monotonic() - last >= self.cfg.progress_interval:
                    last = time.monotonic()
                    self.heartbeat()
            except KeyboardInterrupt:
                interrupts += 1
                self.interrupted = True
                if interrupts == 1:
                    self.say("\nmars bench: interrupted: stopping the running replays (their "
                             "partial results are kept) and the servers; Ctrl-C again to kill")
                    self.interrupt(hard=False)
                else:
                    self.say("mars bench: killing the replays and servers")
                    self.interrupt(hard=True)
        for f in futures:
            exc = f.exception()
            if exc is not None:  # a bug in a worker: keep the other results, report it
                self.say(f"mars bench: internal error: {type(exc).__name__}: {exc}")

    def interrupt(self, hard: bool) -> None:
        self.stop.set()
        with self.lock:
            children = list(self.children.values())
            starting = [srv for srv, _ in self.starting.values()]
        self.ideals.wake()
        for c in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.pid, signal.SIGKILL if hard else signal.SIGINT)
        # a replay being stopped still reads the server's /metrics: only servers that are
        # starting up are stopped now; the others stop when their replay has written results
        for srv in starting:
            with contextlib.suppress(Exception):
                srv.stop()

    def heartbeat(self) -> None:
        now = time.monotonic()
        with self.lock:
            active = list(self.active.values())
            starting = [(pol, t) for pol, (_, t) in self.starting.items()]
        done = sum(1 for p in self.points if p.status in ("done", "failed", "interrupted"))
        lines = [f"  ... {fmt_dur(now - self.t0)} elapsed, {done}/{len(self.points)} points "
                 f"finished{self.eta()}"]
        for pol, t in starting:
            lines.append(f"      {pol}: server starting ({fmt_dur(now - t)})")
        for pt, log, t in active:
            lines.append(f"      {pt.label()}: {replay_progress(log)} ({fmt_dur(now - t)})")
        self.say("\n".join(lines))

    def eta(self) -> str:
        with self.lock:
            left = [p for p in self.points if p.status in ("pending", "running")]
            walls = list(self.finished_walls)
            ups = list(self.startups)
        if not walls or not left:
            return ""
        per = sum(walls) / len(walls)
        up = sum(ups) / len(ups) if ups else 0.0
        est = (len(left) * per + self.groups_left * up) / max(1, self.cfg.jobs)
        return f", about {fmt_dur(est)} left"

    # ---------------------------------------------------------------------- workers

    def _group(self, label: str, points: list[Point]) -> None:
        from mars.launch import ServerProcess
        from mars.workloads.toolpool import format_cores

        with self.lock:
            self.groups_left -= 1
        if self.stop.is_set():
            for p in points:
                p.status = "not_run"
            return
        if self.cfg.sim:
            for p in points:
                if self.stop.is_set():
                    p.status = "not_run"
                    continue
                self._point(None, p)
            return
        policy = points[0].policy
        sdir = self.cfg.out / "servers" / policy
        if label != policy:
            sdir = sdir / f"{points[0].regime}-rate-{rate_key(points[0].rate)}"
        sdir.mkdir(parents=True, exist_ok=True)
        env = {"VLLM_CPU_OMP_THREADS_BIND": format_cores(self.engine_cores)} \
            if self.engine_cores else None
        args = ["--policy", policy, *self.cfg.server_args]
        if "--enable-prompt-tokens-details" not in self.cfg.server_args:
            args.append("--enable-prompt-tokens-details")
        if not any(a.startswith("--sidecar-args") for a in self.cfg.server_args):
            # the sidecar's CPU cap must know the cores the replay's tools really have (the
            # tool workers, one per tool core by default), not this machine's core count
            from mars.workloads.toolpool import available_cores
            workers = self.cfg.tool_workers or len(self.tool_cores or available_cores())
            args += ["--sidecar-args", json.dumps({"tool_cores": workers})]
        srv = ServerProcess(args=args, log_path=str(sdir / "server.log"),
                            events_file=str(sdir / "events.jsonl"), env=env,
                            startup_timeout_s=self.cfg.startup_timeout)
        t0 = time.monotonic()
        self.say(f"[{label}] starting `mars-vllm serve {' '.join(args)}` (log {sdir / 'server.log'})")
        with self.lock:
            self.starting[label] = (srv, t0)
        try:
            try:
                with pinned_to(self.engine_cores):
                    srv.start()
            except Exception as e:  # noqa: BLE001 - any start failure is reported, not raised
                stopped = self.stop.is_set()
                for p in points:
                    p.status = "not_run" if stopped else "failed"
                    p.error = None if stopped else f"server did not start: {str(e).splitlines()[0]}"
                if not stopped:
                    self.say(f"[{label}] server did not start: {str(e).splitlines()[0]} "
                             f"(log {sdir / 'server.log'})")
                msg = str(e)  # what happened (first line), then why: the log's last lines
                self.servers[label] = {"log": str(sdir / "server.log"),
                                       "error": msg if len(msg) <= 4000
                                       else msg[:500] + "\n...\n" + msg[-3500:]}
                self.save()
                return
            finally:
                with self.lock:
                    self.starting.pop(label, None)
            up = time.monotonic() - t0
            with self.lock:
                self.startups.append(up)
                self.servers.setdefault(label, {}).update(
                    {"startup_s": round(up, 2), "log": str(sdir / "server.log"),
                     "events": str(sdir / "events.jsonl"), "args": args})
            self.say(f"[{label}] server up in {up:.0f}s at {srv.url}")
            warn = warm_up(srv.engine_url)
            if warn:
                self.say(f"[{label}] warm-up request failed ({warn}); going on")
            for p in points:
                if self.stop.is_set():
                    p.status = "not_run"
                    continue
                self._point(srv, p)
        finally:
            srv.stop()

    def _command(self, srv, p: Point, ideal: str) -> list[str]:
        trace = self.traces[(p.regime, rate_key(p.rate))]
        return replay_command(self.cfg, trace, p, ideal, url=srv.url,
                              events_file=str(srv.events_file),
                              engine_cores=self.engine_cores, tool_cores=self.tool_cores)

    def _point(self, srv, p: Point) -> None:
        from mars.workloads.results import ResultsError, read_results

        ideal, measures = self.ideals.for_point(p.regime, self.stop)
        res = None
        try:
            if self.stop.is_set():
                p.status = "not_run"
                return
            d = Path(p.dir)
            if d.exists():
                shutil.rmtree(d)  # a stale partial run of an earlier invocation
            d.mkdir(parents=True)
            log = d / "replay.log"
            p.ideal = ideal
            p.status = "running"
            i = self.points.index(p) + 1
            extra = " (ideal latencies first: cached, or measured one task at a time)" \
                if measures else ""
            self.say(f"[{i}/{len(self.points)}] {p.label()}: replaying{extra}")
            t0 = time.monotonic()
            load0 = loadavg()
            if self.cfg.sim:
                p.returncode = self._simulate(p, ideal, log, t0)
            else:
                p.returncode = self._replay(srv, p, ideal, log, t0)
            p.wall_s = round(time.monotonic() - t0, 2)
            p.loadavg = [load0, loadavg()]
            if (d / "results.json").exists():
                try:
                    res = read_results(d)
                except ResultsError as e:
                    p.error = str(e)
            if res is not None and res.mode == "load":
                p.summary = point_summary(res)
                p.status = {0: "done", 3: "done", 130: "interrupted"}.get(p.returncode, "failed")
                if res.run.get("interrupted"):
                    p.status = "interrupted"
            else:
                res = None
                p.status = "interrupted" if self.stop.is_set() else "failed"
            if p.status == "failed" and not p.error:
                p.error = last_line(log)
            with self.lock:
                if p.status == "done" and not measures:  # an ideal run is not a typical point
                    self.finished_walls.append(p.wall_s)
            self.say(self._point_line(p))
        finally:
            if measures:
                self.ideals.measured(p.regime, res, p.policy)
            self.save()

    @contextlib.contextmanager
    def _running(self, p: Point, proc: subprocess.Popen, log: Path, t0: float):
        """``proc`` runs point ``p``: Ctrl-C reaches it (:meth:`interrupt`) and the heartbeat
        shows it until the block ends."""
        with self.lock:
            self.children[proc.pid] = proc
            self.active[p.key] = (p, log, t0)
            late = self.stop.is_set()
        if late:  # Ctrl-C came between the caller's check and the process's start
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGINT)
        try:
            yield
        finally:
            with self.lock:
                self.children.pop(proc.pid, None)
                self.active.pop(p.key, None)

    def _replay(self, srv, p: Point, ideal: str, log: Path, t0: float) -> int:
        """``mars replay`` of the point against ``srv``, in its own process; its status."""
        with open(log, "wb") as logf:
            proc = subprocess.Popen(self._command(srv, p, ideal), stdout=logf,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            with self._running(p, proc, log, t0):
                return proc.wait()

    def _simulate(self, p: Point, ideal: str, log: Path, t0: float) -> int:
        """``mars sim run`` of the point in a worker process (:mod:`mars.bench.workers`); its
        status. Ctrl-C reaches the worker as it reached a point's own process."""
        trace = self.traces[(p.regime, rate_key(p.rate))]
        worker = self.workers.take()
        try:
            with self._running(p, worker.proc, log, t0):
                return worker.run(sim_argv(self.cfg, trace, p, ideal), log)
        finally:
            self.workers.give_back(worker)

    def _point_line(self, p: Point) -> str:
        s = p.summary
        head = f"    {p.label()}: {p.status}"
        if not s:
            return head + (f": {p.error}" if p.error else "") + f" ({fmt_dur(p.wall_s or 0)})"
        lat = s.get("latency_s") or {}
        mid = f"{float(self.cfg.slacks[len(self.cfg.slacks) // 2]):g}"
        g = (s.get("goodput") or {}).get(mid)

        def f(x: Any) -> str:
            return f"{x:.2f}" if isinstance(x, (int, float)) else "–"
        gp = f", goodput s={mid} {g:.3g}/s" if isinstance(g, (int, float)) else ""
        load = f", load {p.loadavg[1]:.1f}" if p.loadavg and p.loadavg[1] is not None else ""
        return (f"{head}, {s['tasks_done']}/{s['tasks_total']} tasks done, latency mean "
                f"{f(lat.get('mean'))} s, P90 {f(lat.get('p90'))} s, P95 {f(lat.get('p95'))} s"
                f"{gp} ({fmt_dur(p.wall_s or 0)}{load}; {fmt_dur(time.monotonic() - self.t0)} "
                f"elapsed{self.eta()})")

    # ------------------------------------------------------------------------ results

    def document(self) -> dict[str, Any]:
        with self.lock:
            doc = {
                "schema": BENCH_SCHEMA, "version": BENCH_VERSION,
                "config": self.cfg.to_json(),
                "run": {"start_unix": self.start_unix, "wall_s": time.monotonic() - self.t0,
                        "interrupted": self.interrupted, "command": self.argv,
                        "engine_cores": self.engine_cores, "tool_cores": self.tool_cores,
                        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                 "python": platform.python_version()},
                        "versions": versions()},
                "traces": {f"{r}@{k}": str(p) for (r, k), p in self.traces.items()},
                "ideal": dict(self.ideals.files()),
                "servers": dict(self.servers),
                "points": [p.to_json() for p in self.points],
            }
        return doc

    def save(self) -> dict[str, Any]:
        """Write ``bench.json`` (after every point, so a crash loses nothing finished)."""
        with self.lock:  # workers finish points concurrently with --jobs
            doc = self.document()
            doc["comparison"] = finite(compare(doc))
            write_document(self.cfg.out / "bench.json", doc)
        return doc

    def finish(self) -> int:
        doc = self.save()
        tables = format_tables(doc)
        plots: dict[str, str] = {}
        try:
            plots = write_plots(doc, self.cfg.out / "plots")
        except ImportError as e:
            self.say(f"mars bench: plots skipped ({e})")
        doc["files"] = {"report": str(self.cfg.out / "report.md"), **plots}
        p = self.cfg.out / "bench.json"
        write_document(p, doc)
        (self.cfg.out / "report.md").write_text(report_md(doc, tables, plots, self.cfg.out))
        print(tables, file=self.stdout, flush=True)
        failed = [pt for pt in self.points if pt.status == "failed"]
        for pt in failed:
            self.say(f"failed: {pt.label()}: {pt.error}")
        self.say(f"\nbench:   {p}\nreport:  {self.cfg.out / 'report.md'}")
        if plots:
            self.say("plots:   " + "\n         ".join(plots.values()))
        self.say(f"time:    {fmt_dur(time.monotonic() - self.t0)}")
        if self.interrupted:
            self.say(f"interrupted: continue with the same command and --resume --out {self.cfg.out}")
            return EXIT_INTERRUPTED
        if failed or any(pt.status != "done" for pt in self.points):
            return EXIT_USAGE if failed else EXIT_FAILED
        if any(not (pt.summary or {}).get("complete") for pt in self.points):
            return EXIT_FAILED
        return EXIT_OK


def run_seeds(cfg: BenchConfig, seeds: list[int]) -> int:
    """One bench per seed into ``OUT/seed-N`` (each resumable on its own), then the pooled
    comparison in ``OUT`` (mars.bench.seeds). Returns the worst of the seeds' statuses."""
    from dataclasses import replace

    from .seeds import seed_dir, write_combined

    if not cfg.resume:  # refuse before any seed runs, not after the first ones did
        taken = [d for d in [cfg.out, *(seed_dir(cfg.out, s) for s in seeds)]
                 if (d / "bench.json").exists()]
        if taken:
            raise BenchError(f"{taken[0]} already holds a bench (bench.json); pass --resume to "
                             "continue it or choose another --out")
    codes = []
    for i, seed in enumerate(seeds):
        print(f"mars bench: seed {seed} ({i + 1} of {len(seeds)})", file=sys.stderr, flush=True)
        rc = Bench(replace(cfg, seed=seed, out=seed_dir(cfg.out, seed))).run()
        codes.append(rc)
        if rc == EXIT_INTERRUPTED:
            print(f"mars bench: interrupted; continue every seed with the same command and "
                  f"--resume --out {cfg.out}", file=sys.stderr)
            return rc
    command = "mars " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        write_combined(cfg.out, seeds, command)
    except (OSError, ValueError) as e:  # (json.JSONDecodeError is a ValueError)
        raise BenchError(f"pooling the seeds' benches in {cfg.out}: {e}") from None
    print(f"mars bench: seeds {', '.join(map(str, seeds))} pooled: {cfg.out / 'report.md'}",
          file=sys.stderr)
    return next((c for c in (EXIT_USAGE, EXIT_FAILED) if c in codes), EXIT_OK)
