"""What a bench will run, decided before anything starts: its configuration
(:class:`BenchConfig`; the command, :mod:`mars.cli.bench`, checks its flags, and the
policies, regimes and rates are resolved here, so that bad input fails in one line before a
server or simulation starts), the seeded traces of every point (generated exactly as ``mars replay
REGIME`` would), the points themselves, and the command line that runs each point (``mars
replay`` against a server, or ``mars sim run`` in virtual time). No process is started here:
:mod:`mars.bench.run` does that.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mars.workloads.goodput import DEFAULT_SLACKS

from .report import BASELINES, MARS, rate_key

#: exit statuses of ``mars bench`` (docs/bench.md): every task finished; bad input or a failed
#: server or replay; every point ran but some task did not finish; interrupted
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
    #: simulated engines of the model behind one sidecar, and how sessions are placed on
    #: them (``mars sim run --engines N --placement P``)
    engines: int = 1
    placement: str = "mars"
    #: how their control planes count the host's tool cores (``--cpu-budget``)
    cpu_budget: str = "node"
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
                "regime_rates": self.regime_rates,
                # (absent with one engine: benches from before several engines resume)
                **({"engines": self.engines, "placement": self.placement,
                    "cpu_budget": self.cpu_budget} if self.engines > 1 else {})}

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


def same_tasks(traces: Sequence[Any]) -> bool:
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


def default_out(regimes: Sequence[str]) -> Path:
    return Path("runs") / f"bench-{'_'.join(regimes)}-{_dt.datetime.now():%Y%m%d-%H%M%S}"


# ------------------------------------------------------------------------ command lines


def sim_argv(cfg: BenchConfig, trace: Path, p: Point, ideal: str) -> list[str]:
    """``mars sim run`` of one point in virtual time (``--sim``): the arguments after
    ``mars`` (a worker process runs them: :mod:`mars.bench.workers`)."""
    from mars.emulate.profile import is_profile_path

    gpu, _, model = (cfg.sim or "").partition(":")
    target = ["--profile", cfg.sim] if is_profile_path(cfg.sim or "") else \
        ["--gpu", gpu, "--model", model]
    cmd = ["sim", "run",
           "--trace", str(trace),
           *target, "--policies", p.policy, "--flat",
           "--out", p.dir, "--seed", str(cfg.seed), "--ideal", ideal,
           "--tool-cores", str(cfg.sim_tool_cores), "--no-progress",
           "--slacks", ",".join(f"{s:g}" for s in cfg.slacks)]
    if cfg.server_args:
        cmd += ["--engine-args", shlex.join(cfg.server_args)]
    if cfg.engines > 1:
        cmd += ["--engines", str(cfg.engines), "--placement", cfg.placement,
                "--cpu-budget", cfg.cpu_budget]
    if cfg.ideal_cache:
        cmd += ["--ideal-cache", cfg.ideal_cache]
    if not cfg.run_plots:
        cmd.append("--no-plots")
    return cmd


def replay_command(cfg: BenchConfig, trace: Path, p: Point, ideal: str, *, url: str,
                   events_file: str, engine_cores: list[int] | None,
                   tool_cores: list[int] | None) -> list[str]:
    """``mars replay`` of one point against a served policy. The ideal cache's tag names the
    engine cores and server flags: ideal latencies measured on another set-up do not fit."""
    from mars.workloads.toolpool import format_cores

    server_hash = hashlib.sha256(json.dumps(cfg.server_args).encode()).hexdigest()[:10]
    tag = (f"mars-bench engine={format_cores(engine_cores) if engine_cores else '-'}"
           f" server={server_hash}")
    cmd = [sys.executable, "-m", "mars.cli", "replay",
           "--trace", str(trace),
           "--url", url, "--label", p.policy, "--out", p.dir,
           "--salt", f"bench/{p.regime}/rate-{rate_key(p.rate)}", "--seed", str(cfg.seed),
           "--events-file", events_file, "--ideal", ideal, "--ideal-tag", tag,
           "--slacks", ",".join(f"{s:g}" for s in cfg.slacks), "--tool-burn", cfg.tool_burn,
           "--request-timeout", f"{cfg.request_timeout:g}"]
    if tool_cores:
        cmd += ["--tool-cores", format_cores(tool_cores)]
    if cfg.tool_workers:
        cmd += ["--tool-workers", str(cfg.tool_workers)]
    if cfg.ideal_cache:
        cmd += ["--ideal-cache", cfg.ideal_cache]
    if not cfg.run_plots:
        cmd.append("--no-plots")
    return cmd
