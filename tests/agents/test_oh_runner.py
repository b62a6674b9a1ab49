"""The concurrent runner and the ``python -m mars.openhands_integration`` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mars.openhands_integration.runner import arrival_offsets, format_summary, summarize

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _res(i, status="finished", **kw):
    base = {"task_id": f"t{i}", "session_id": f"s{i}", "status": status, "arrival_ts": 100.0 + i,
            "start_ts": 100.5 + i, "end_ts": 110.0 + 2 * i, "queue_s": 0.5, "run_s": 9.5 + i,
            "completion_s": 10.0 + i, "check_passed": i % 2 == 0, "rounds": 4, "llm_time_s": 2.0,
            "ttft_mean_s": 0.1, "tool_time_s": 1.0, "tool_calls": 3, "tool_timeouts": 0,
            "events": {"emitted": 9, "sent": 9, "dropped": 0, "written": 9}, "confinement": "bwrap",
            "leftover_processes": 0}
    base.update(kw)
    return base


def test_summary_is_comparable_across_runs():
    s = summarize([_res(0), _res(1), _res(2, status="error")], meta={"label": "mars", "concurrency": 2})
    assert s["label"] == "mars" and s["tasks"] == 3 and s["errors"] == 1
    assert s["status"] == {"finished": 2, "error": 1}
    assert s["solved"] == 2 and s["checked"] == 3
    assert s["completion_s"]["mean"] == pytest.approx(11.0) and s["completion_s"]["p50"] == pytest.approx(11.0)
    assert s["completion_ok_s"]["mean"] == pytest.approx(10.5)
    assert s["makespan_s"] == pytest.approx(14.0)
    assert s["events"] == {"emitted": 27, "sent": 27, "dropped": 0, "written": 27}
    assert "completion_s mean=11.00" in format_summary(s)
    json.dumps(s)


def test_arrivals():
    assert arrival_offsets(3, None) == [0.0, 0.0, 0.0]
    u = arrival_offsets(4, 2.0, arrival="uniform")
    assert u == [0.0, 0.5, 1.0, 1.5]
    p1 = arrival_offsets(50, 5.0, seed=1)
    assert p1 == arrival_offsets(50, 5.0, seed=1) and p1 != arrival_offsets(50, 5.0, seed=2)
    assert all(b >= a for a, b in zip(p1, p1[1:]))
    assert 5.0 < p1[-1] < 20.0  # ~49 gaps of mean 0.2 s


@pytest.mark.agents
def test_forkserver_runner_runs_concurrent_sessions(stub, tmp_path):
    pytest.importorskip("openhands.sdk")
    from mars.openhands_integration.runner import run_tasks
    from mars.openhands_integration.tasks import load_tasks

    tasks = load_tasks("bundled")[:2]
    out = tmp_path / "run"
    cfg = {"url": stub.url, "model": "stub-model", "max_rounds": 3, "out_dir": str(out)}
    s = run_tasks(tasks, cfg, concurrency=2, label="stub", start_method="forkserver")
    assert s["tasks"] == 2 and s["status"] == {"max_rounds": 2}
    assert s["forkserver_start_s"] > 0
    assert s["events"]["sent"] == s["events"]["emitted"] == 20 and s["events"]["dropped"] == 0
    assert s["leftover_processes"] == 0
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert {r["task_id"] for r in results} == {t.id for t in tasks}
    assert len({r["pid"] for r in results}) == 2  # one process per session
    assert json.loads((out / "summary.json").read_text())["tasks"] == 2
    merged = (out / "events.jsonl").read_text().splitlines()
    assert len(merged) == 20
    assert len(list((out / "sessions").glob("*.json"))) == 2
    assert len({x["job_id"] for x in stub.xargs()}) == 2


@pytest.mark.agents
def test_a_crashing_worker_costs_only_its_own_task(stub, tmp_path):
    pytest.importorskip("openhands.sdk")
    from mars.openhands_integration.runner import run_tasks
    from mars.openhands_integration.tasks import Task

    # the set-up command kills its worker process (possible in the unconfined mode only)
    tasks = [Task(id="crash", prompt="p", setup="kill -9 $PPID"),
             Task(id="ok1", prompt="p"), Task(id="ok2", prompt="p")]
    cfg = {"url": stub.url, "model": "stub-model", "max_rounds": 2, "confinement": "unconfined",
           "out_dir": str(tmp_path / "run")}
    s = run_tasks(tasks, cfg, concurrency=2, label="crash", start_method="forkserver")
    res = {json.loads(x)["task_id"]: json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().splitlines()}
    assert res["crash"]["status"] == "error" and "died" in res["crash"]["error"]
    assert res["ok1"]["status"] == res["ok2"]["status"] == "max_rounds"
    assert s["status"] == {"error": 1, "max_rounds": 2}


@pytest.mark.agents
def test_cli_run_inline(stub, tmp_path):
    pytest.importorskip("openhands.sdk")
    out = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mars.openhands_integration", "run", "--url", stub.url, "--tasks", "bundled",
         "--limit", "1", "--max-rounds", "2", "--start-method", "inline", "--out", str(out), "--json",
         "--label", "cli"],
        capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["label"] == "cli" and summary["model"] == "stub-model"  # discovered via /v1/models
    assert summary["tasks"] == 1 and summary["rounds_mean"] == 2
    assert (out / "results.jsonl").exists()


def test_cli_help_and_tasks():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mars.openhands_integration", "tasks"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and "fix-add" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "mars.openhands_integration", "run", "--help"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and "--concurrency" in proc.stdout


def test_no_vllm_or_fastapi_in_the_agent_package():
    """The agent env has neither; nothing in the package may import them (the SDK itself
    pulls in uvicorn, which is its business)."""
    mods = ["mars.openhands_integration", "mars.openhands_integration.sink",
            "mars.openhands_integration.workspace", "mars.openhands_integration.runner",
            "mars.openhands_integration.session", "mars.openhands_integration.tasks"]
    try:
        import openhands.sdk  # noqa: F401
        mods += ["mars.openhands_integration.agent", "mars.openhands_integration.tools",
                 "mars.openhands_integration.llm", "mars.openhands_integration.preload"]
    except ImportError:
        pass
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods) +
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'fastapi', 'torch')]\n"
            "print(bad); sys.exit(1 if bad else 0)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-1000:]
