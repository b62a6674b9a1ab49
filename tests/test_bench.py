"""``mars bench``: policies serve a scaled ILR-1 replay end to end, and the comparison.

The engine test starts ONE ``mars-vllm serve --policy NAME`` for each of ``SMOKE_POLICIES``
(small KV cache, tiny model, eager mode) through ``mars bench`` and replays 2 scaled ILR-1
tasks of at most 3 rounds against each. Server start-up dominates (30-110 s each on the
shared 2-core machine), so the bench runs its servers at once (``--jobs 3``: a smoke-test mode
whose latencies are not comparable, which is fine here: this checks that the bench serves
each policy correctly, not which is faster). Three policies, not all nine: fcfs (stock
ordering, no admission, the ideal latencies), mars (its own scheduler, pins, the sidecar's
admission) and continuum (a pinning baseline): every branch the bench's server path takes.
Every policy's scheduler runs on vLLM's real scheduler in ``test_scheduler_invariants``, and
the tables with every policy and the ablation in ``test_tables_and_plots``. A second engine
test interrupts a bench mid-replay (SIGINT) and checks that it stops cleanly with partial
results; the rest (report maths, tables, plots, errors, ``--resume``) needs no server.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mars.bench.report import compare, format_tables, write_plots
from mars.bench.observe import replay_progress
from mars.bench.plan import cut_rounds
from mars.policy.registry import POLICY_NAMES, get_policy
from tests.conftest import BASE_ARGS

#: the policies the smoke bench serves (module docstring): each branch of the server path
SMOKE_POLICIES = ("fcfs", "mars", "continuum")

# --scale 100: the smallest family prefix (terminal agents, 4,000 tokens) must still span one
# 32-token KV block after scaling, or a round-1 prompt has no full block for the prefix cache
SMOKE = ["ILR-1", "--rates", "1", "--num-tasks", "2", "--scale", "100", "--time-scale", "50",
         "--max-rounds", "3", "--seed", "0", "--no-run-plots", "--progress-interval", "20",
         "--server-args=" + " ".join(BASE_ARGS)]


def _default_sigint() -> None:
    # A suite started in the background (``nohup make test &``) runs with SIGINT ignored, and
    # an ignored signal is inherited: the bench would then rightly ignore the test's Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _bench(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mars.cli", "bench", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint, **kw)


def _mars(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mars.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


# --------------------------------------------------------------------- no server needed


@pytest.mark.parametrize("args,msg", [
    (["ILR-9"], "unknown regime 'ILR-9'; known: ILR-1"),
    (["ILR-1", "--policies", "fcfs,nope"], "unknown policy 'nope'; valid: fcfs, mars"),
    (["ILR-1", "--rates", "0.1,-2"], "--rates must be > 0"),
    (["ILR-1", "--server-args=--policy mars"], "must not set --policy"),
    (["ILR-1", "--resume"], "--resume needs --out"),
])
def test_bad_input_is_one_clear_line(args, msg, tmp_path):
    r = subprocess.run([sys.executable, "-m", "mars.cli", "bench", *args], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("mars bench: ") and msg in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()  # nothing written


def test_policies_all_names_every_registered_policy_once():
    from mars.bench.plan import resolve_policies

    names = resolve_policies("all", ablation=False)  # 'all' alone names the variants too
    assert sorted(names) == sorted(POLICY_NAMES) and len(set(names)) == len(names)
    assert resolve_policies("all", ablation=True) == names
    assert resolve_policies("fcfs, mars,mars", ablation=False) == ["fcfs", "mars"]


def test_cut_rounds_keeps_a_valid_append_only_trace():
    from mars.workloads.generator import generate
    from mars.workloads.trace import loads_trace, dumps_trace

    tr = generate("ILR-1", num_tasks=4, rate=1, seed=0, scale=50)
    cut = cut_rounds(tr, 3)
    assert all(t.num_rounds == min(3, o.num_rounds) for t, o in zip(cut.tasks, tr.tasks))
    for t, o in zip(cut.tasks, tr.tasks):
        assert t.rounds[-1].tool is None and t.rounds[-1].tool_duration_s == 0
        assert t.prompt_lengths() == o.prompt_lengths()[:t.num_rounds]
    assert loads_trace(dumps_trace(cut)).tasks == cut.tasks  # the reader accepts it
    assert cut.header.params["max_rounds"] == 3


def test_replay_progress_reads_the_tqdm_line(tmp_path):
    log = tmp_path / "replay.log"
    log.write_text("mars replay: ILR-1 ...\nfcfs:  20%|##   | 2/10 [00:03<00:12, 0.6task/s, "
                   "active=3 llm=2 rounds=14 tools=1+0q]\rfcfs:  30%|###  | 3/10 [00:04<00:10,"
                   " 0.6task/s, active=2 llm=1 rounds=19 tools=1+1q]")
    assert replay_progress(log) == "load run 3/10 tasks, active=2 llm=1 rounds=19 tools=1+1q"
    assert replay_progress(tmp_path / "missing.log") == "starting"


def _pt(policy, rate, mean, p90, p95, g3, done=10, total=10, regime="ILR-1"):
    return {"regime": regime, "rate": rate, "policy": policy, "status": "done",
            "summary": {"tasks_done": done, "tasks_total": total, "complete": done == total,
                        "latency_s": {"mean": mean, "p90": p90, "p95": p95},
                        "goodput": {"2": g3 / 2, "3": g3, "5": g3}}}


def _doc():
    pts = [
        _pt("fcfs", 0.1, 10, 20, 30, 0.10), _pt("continuum", 0.1, 8, 25, 26, 0.20),
        _pt("mars", 0.1, 4, 12, 28, 0.30),
        _pt("fcfs", 0.2, 20, 40, 50, 0.0), _pt("continuum", 0.2, 5, 9, 10, 0.0, done=9),
        _pt("mars", 0.2, 10, 30, 40, 0.05),
        _pt("mars_no_coord", 0.1, 8, 20, 30, 0.1), _pt("mars_no_ctrl", 0.1, 2, 10, 14, 0.6),
        _pt("mars_no_coord", 0.2, 30, 40, 60, 0.01),
    ]
    return {"schema": "mars-bench", "version": 1, "points": pts,
            "config": {"regimes": ["ILR-1"], "rates": [0.1, 0.2], "slacks": [2, 3, 5],
                       "time_scale": 10,
                       "policies": ["fcfs", "continuum", "mars", "mars_no_coord",
                                    "mars_no_ctrl"]}}


def test_compare_picks_the_strongest_complete_baseline_per_metric():
    cmp = compare(_doc())
    assert cmp["baselines"] == ["fcfs", "continuum"]
    r1, r2 = cmp["vs_baseline"]
    m = r1["metrics"]
    assert (m["mean"]["best"], m["mean"]["ratio"]) == ("continuum", 2.0)  # 8 / 4
    assert (m["p90"]["best"], m["p90"]["ratio"]) == ("fcfs", 20 / 12)
    assert (m["p95"]["best"], m["p95"]["ratio"]) == ("continuum", 26 / 28)  # MARS loses P95
    assert (m["goodput@3"]["best"], m["goodput@3"]["ratio"]) == ("continuum", 0.30 / 0.20)
    # continuum did not finish every task at 0.2: never the strongest baseline there
    m = r2["metrics"]
    assert m["mean"]["best"] == "fcfs" and m["mean"]["ratio"] == 2.0
    assert math.isinf(m["goodput@3"]["ratio"])  # MARS > 0, every baseline 0
    w = cmp["wins"]
    assert (w["mean"]["better"], w["mean"]["points"]) == (2, 2)
    assert (w["p95"]["better"], w["p95"]["points"]) == (1, 2)
    assert w["mean"]["with_ci"] == 0 and r1["metrics"]["mean"]["ci"] is None  # no task data
    # ablation: variant / mars for latency, mars / variant for goodput (> 1: component helps)
    a1, a2 = cmp["ablation"]
    assert a1["metrics"]["mean"]["mars_no_coord"]["ratio"] == 2.0
    assert a1["metrics"]["mean"]["mars_no_ctrl"]["ratio"] == 0.5
    assert a1["metrics"]["goodput@3"]["mars_no_ctrl"]["ratio"] == 0.5
    assert math.isnan(a2["metrics"]["mean"]["mars_no_ctrl"]["ratio"])  # not run


def test_paired_intervals_say_which_ratios_the_tasks_support():
    """Per-task latencies give each latency ratio a paired-bootstrap interval: a MARS that is
    faster on every task is clearly better; one that differs only by noise is not."""
    import random

    from mars.bench.stats import BootstrapConfig, paired_tasks, ratio_interval

    rng = random.Random(0)
    base = {f"t{i}": rng.uniform(20, 200) for i in range(60)}
    fast = {k: v / 1.5 * rng.uniform(0.9, 1.1) for k, v in base.items()}
    noise = {k: v * rng.uniform(0.8, 1.25) for k, v in base.items()}
    lo, hi = ratio_interval(*paired_tasks(fast, base), "mean")
    assert 1.35 < lo < hi < 1.7 and hi - lo < 0.15
    lo, hi = ratio_interval(*paired_tasks(noise, base), "p90")
    assert lo < 1 < hi
    # deterministic, tasks unfinished on either side left out, too few tasks: no interval
    assert ratio_interval(*paired_tasks(fast, base), "mean") == \
        ratio_interval(*paired_tasks(fast, base), "mean")
    m, b = paired_tasks({"a": 1.0, "b": None, "c": 2.0}, {"a": 2.0, "b": 3.0, "d": 1.0})
    assert m.tolist() == [1.0] and b.tolist() == [2.0]
    assert ratio_interval(m, b, "mean", BootstrapConfig(min_tasks=10)) is None

    doc = _doc()
    for p in doc["points"]:
        if p["rate"] == 0.1 and p["policy"] in ("continuum", "mars"):
            p["summary"]["task_latency_s"] = fast if p["policy"] == "mars" else base
    cmp = compare(doc)
    ci = cmp["vs_baseline"][0]["metrics"]["mean"]["ci"]
    assert ci is not None and ci[0] > 1
    assert cmp["wins"]["mean"]["clearly_better"] == 1 and cmp["wins"]["mean"]["with_ci"] == 1
    text = format_tables(doc)
    assert f"2.00× [{ci[0]:.2f}–{ci[1]:.2f}] (vs continuum)" in text
    assert "mean latency 2/2 (1 clearly better, 0 clearly worse)" in text


def test_tables_and_plots(tmp_path):
    doc = _doc()
    text = format_tables(doc)
    assert "### ILR-1: task latency and goodput per policy and rate" in text
    assert "| 0.1 | mars | 10/10 | **4.00** | **12.00** | 28.00 |" in text
    assert "| 0.2 | continuum | 9/10 ! |" in text
    assert "| ILR-1 | 0.1 | 2.00× (vs continuum) | 1.67× (vs fcfs) | 0.93× (vs continuum) |" in text
    assert "∞ (vs fcfs)" in text
    assert "mean latency 2/2, P90 2/2, P95 1/2" in text
    assert "| ILR-1 | 0.1 | mean (s) | 4.00 | 8.00 (2.00×) | 2.00 (0.50×) |" in text
    pytest.importorskip("matplotlib")
    plots = write_plots(doc, tmp_path)
    assert set(plots) == {"latency_vs_rate_ILR-1", "goodput_vs_rate_ILR-1", "ablation_ILR-1"}
    assert all(Path(p).stat().st_size > 5000 for p in plots.values())


# ------------------------------------------------------------------------- with servers


def _server_pids_under(path: Path) -> list[int]:
    """Processes whose command line names ``path`` (the servers' event files live there)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmd:
            out.append(int(d.name))
    return out


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("bench") / "all"
    cache = tmp_path_factory.mktemp("ideal-cache")
    t0 = time.monotonic()
    proc = _bench(*SMOKE, "--policies", ",".join(SMOKE_POLICIES), "--jobs", "3",
                  "--ideal-cache", str(cache), "--out", str(out))
    try:
        stdout, stderr = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
    wall = time.monotonic() - t0
    print(f"\nmars bench --policies {','.join(SMOKE_POLICIES)} --jobs 3: {wall:.0f}s",
          file=sys.stderr)
    return out, proc.returncode, stdout, stderr, cache


@pytest.mark.engine
def test_bench_runs_its_policies_and_writes_the_comparison(smoke):
    out, rc, stdout, stderr, _ = smoke
    assert rc == 0, stderr[-4000:]
    doc = json.loads((out / "bench.json").read_text())
    assert doc["config"]["policies"] == list(SMOKE_POLICIES)  # fcfs first: the ideal latencies
    assert doc["config"]["comparable"] is False  # --jobs 3
    assert [p["status"] for p in doc["points"]] == ["done"] * len(SMOKE_POLICIES)
    assert doc["ideal"]["ILR-1"] and Path(doc["ideal"]["ILR-1"]).exists()
    # the printed comparison has its sections, and report.md has it with the command
    for head in ("### ILR-1: task latency", "### MARS vs the strongest baseline"):
        assert head in stdout
    assert "### Ablation" not in stdout  # no variant ran
    report = (out / "report.md").read_text()
    assert "mars bench ILR-1 --rates 1" in report and stdout.strip() in report
    for name in ("latency_vs_rate_ILR-1", "goodput_vs_rate_ILR-1"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 5000
    cmp = doc["comparison"]
    assert cmp["baselines"] == ["fcfs", "continuum"]
    assert cmp["vs_baseline"][0]["metrics"]["mean"]["ratio"] > 0
    assert not cmp.get("variants")
    assert "[fcfs] server up in" in stderr and "replaying" in stderr
    assert _server_pids_under(out) == []  # every server stopped


@pytest.mark.engine
@pytest.mark.parametrize("policy", SMOKE_POLICIES)
def test_policy_serves_the_scaled_replay(smoke, policy):
    """Each policy's own server completed every task, exactly as the trace says."""
    from mars.workloads.results import read_results
    from mars.workloads.trace import read_trace

    out, _, _, _, _ = smoke
    doc = json.loads((out / "bench.json").read_text())
    (pt,) = [p for p in doc["points"] if p["policy"] == policy]
    assert pt["status"] == "done" and pt["returncode"] == 0, (pt, doc.get("servers", {}).get(policy))
    res = read_results(pt["dir"])
    trace = read_trace(out / "traces" / "ILR-1" / "rate-1.jsonl")
    assert res.label == policy and res.mode == "load"
    assert [t.status for t in res.tasks] == ["completed"] * 2
    assert [len(t.rounds) for t in res.tasks] == [t.num_rounds for t in trace.tasks]
    assert all(t.num_rounds <= 3 for t in trace.tasks)
    rounds = [r for t in res.tasks for r in t.rounds]
    assert all(r.output_tokens == r.planned_output_tokens for r in rounds)
    assert all(r.end_s >= (r.first_token_s or 0) >= r.submit_s for r in rounds)
    assert res.cached_tokens_source == "usage"
    assert all(r.cached_tokens > 0 for r in rounds if r.index >= 1)  # prefix cache at work
    for t, tt in zip(res.tasks, trace.tasks):
        assert t.latency_s >= tt.tool_time_s * 0.9  # tools are part of the latency
        assert t.ideal_s and t.ideal_s > 0  # judged against the shared ideal latencies
    s = pt["summary"]
    assert s["complete"] and s["tasks_done"] == 2 and s["goodput_evaluated"] == 2
    assert 0 < s["latency_s"]["mean"] < 60
    # the server ran this policy, with the sidecar's admission as the registry says
    log = Path(doc["servers"][policy]["log"]).read_text(errors="replace")
    assert f"mars: policy={policy} " in log
    admission = "on" if get_policy(policy).sidecar_admission else "off"
    assert f"(admission {admission}," in log


@pytest.mark.engine
def test_resume_reuses_finished_points_without_a_server(smoke, tmp_path):
    out, _, stdout, _, cache = smoke
    copy = tmp_path / "resumed"
    shutil.copytree(out, copy)
    proc = _bench(*SMOKE, "--policies", ",".join(SMOKE_POLICIES), "--jobs", "3",
                  "--ideal-cache", str(cache), "--out", str(copy), "--resume")
    so, se = proc.communicate(timeout=300)
    assert proc.returncode == 0, se[-3000:]
    n = len(SMOKE_POLICIES)
    assert f"{n} points ({n} reused), 0 server start(s)" in se
    assert "starting `mars-vllm serve" not in se
    doc = json.loads((copy / "bench.json").read_text())
    assert all(p["reused"] for p in doc["points"])
    assert so.replace("| reused |", "|  |") == stdout  # the same tables (noted as reused)
    # a bench directory is never overwritten by accident
    r = _mars("bench", *SMOKE, "--policies", ",".join(SMOKE_POLICIES), "--out", str(copy),
              timeout=120)
    assert r.returncode == 1 and "--resume" in r.stderr


@pytest.mark.engine
@pytest.mark.parametrize("delay_s", [3.0, 0.0], ids=["mid-run", "at-start"])
def test_ctrl_c_stops_cleanly_and_keeps_partial_results(tmp_path, delay_s):
    """SIGINT mid-replay: the replay stops and writes its partial results, the server is
    stopped, the tables are written, exit 130. Tools are not compressed here (time-scale 1),
    so the tasks are still running when the signal comes. ``at-start``: the signal lands while
    the replay process is still starting (server probe, tool workers spawning), which once left
    it hanging with a half-started tool pool."""
    pytest.importorskip("vllm")
    out = tmp_path / "b"
    args = ["ILR-1", "--policies", "fcfs", "--rates", "0.05", "--num-tasks", "3", "--scale",
            "200", "--seed", "0", "--ideal", "skip", "--no-run-plots",
            "--progress-interval", "5", "--server-args=" + " ".join(BASE_ARGS), "--out", str(out)]
    proc = _bench(*args)
    lines: list[str] = []
    deadline = time.monotonic() + 600
    assert proc.stderr is not None
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "replaying" in line:
                time.sleep(delay_s)  # mid-run: round 0 done, tools running
                proc.send_signal(signal.SIGINT)
                break
        else:
            pytest.fail("the replay never started:\n" + "".join(lines))
        t0 = time.monotonic()
        so, se = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _server_pids_under(out):  # never leave a server to load later tests
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    se = "".join(lines) + se
    assert proc.returncode == 130, se[-3000:]
    assert time.monotonic() - t0 < 60
    assert "interrupted" in se and "--resume" in se
    doc = json.loads((out / "bench.json").read_text())
    assert doc["run"]["interrupted"] is True
    (pt,) = doc["points"]
    assert pt["status"] == "interrupted"
    results = Path(pt["dir"]) / "results.json"
    if delay_s == 0 and pt["returncode"] == -signal.SIGINT:
        # the signal reached the replay before Python had run any of it (the bench signals
        # its children the moment it is interrupted; this one had just been started):
        # nothing was replayed, nothing is saved, --resume runs the point again
        assert not results.exists()
    else:
        # it stopped the graceful way: partial results, exit 130, no traceback
        assert pt["returncode"] == 130, pt
        assert "Traceback" not in (Path(pt["dir"]) / "replay.log").read_text()
        res = json.loads(results.read_text())
        assert res["run"]["interrupted"] is True
        assert {t["status"] for t in res["tasks"]} <= {"interrupted", "not_started", "completed"}
    assert "### ILR-1: task latency" in so and (out / "report.md").exists()
    assert "interrupted" in (out / "report.md").read_text()
    assert _server_pids_under(out) == []


def test_a_point_worker_runs_commands_in_turn_and_reports_their_status(tmp_path):
    """``mars bench --sim``'s worker (mars.bench.workers): each command's status and output
    (its own log), one after another in one process; a worker killed mid-command answers
    with a failure, and the pool does not hand it out again."""
    from mars.bench.workers import WorkerPool

    pool = WorkerPool()
    try:
        w = pool.take()
        assert w.run(["sim", "run", "--no-such-flag"], tmp_path / "a.log") == 2
        assert "unrecognized arguments: --no-such-flag" in (tmp_path / "a.log").read_text()
        assert w.run(["events", "tail", "--help"], tmp_path / "b.log") == 0
        assert "usage: mars events tail" in (tmp_path / "b.log").read_text()
        assert "no-such-flag" not in (tmp_path / "b.log").read_text()
        pool.give_back(w)
        assert pool.take() is w  # the same process, still alive
        w.proc.kill()
        assert w.run(["events", "tail", "--help"], tmp_path / "c.log") != 0
        pool.give_back(w)
        assert pool.take() is not w
    finally:
        pool.close()
    assert not w.alive
