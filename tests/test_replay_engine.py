"""``mars replay`` against a real ``mars-vllm serve`` (tiny model, CPU, sidecar in front).

One server for the module. Checks that what the replay measures is what the server did:
prompts arrive with exactly the length the client built, later rounds hit the prefix cache,
each round's client-side span contains the engine's own span (gpu_submit -> gpu_end), vLLM's
``vllm:e2e_request_latency_seconds`` counted the same requests, and each tool ran between its
round and the next, never inside one; then the ideal cache, Ctrl-C and the context limit.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mars.workloads.eventlink import read_events
from mars.workloads.results import read_results
from mars.workloads.trace import Round, Task, Trace, write_trace
from tests.conftest import wait_for_events

pytestmark = pytest.mark.engine

SCALED = ["ILR-1", "--num-tasks", "3", "--scale", "50", "--time-scale", "40", "--rate", "0.2",
          "--seed", "0", "--tool-burn", "wall", "--no-progress"]


@pytest.fixture(scope="module")
def server(fcfs_server):
    return fcfs_server  # (shared with other modules: tests/conftest.py)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("ideal-cache")


def _replay(server, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mars.cli", "replay", *args, "--url", server.url,
           "--events-file", server.events_file]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def first_run(server, cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("run1")
    r = _replay(server, *SCALED, "--out", str(out), "--ideal-cache", str(cache), "--label", "fcfs")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_replay_measures_what_the_server_did(first_run):
    out, proc = first_run
    res = read_results(out)
    assert res.mode == "load" and res.label == "fcfs"
    assert [t.status for t in res.tasks] == ["completed"] * 3
    assert res.server["sidecar"] is True and res.server["max_model_len"] == 16384
    rounds = [r for t in res.tasks for r in t.rounds]
    assert len(rounds) == res.trace["rounds"]
    assert all(r.output_tokens == r.planned_output_tokens for r in rounds)

    # cached tokens are reported and later rounds hit the prefix cache
    assert res.cached_tokens_source == "usage"
    later = [r for r in rounds if r.index >= 1]
    assert later and all(r.cached_tokens > 0 for r in later)
    assert res.summary["cached_fraction"]["later_rounds_token_weighted"] > 0.5

    # every round's engine span (gpu_submit -> gpu_end, from the recorded event stream) lies
    # within the client's span, and the engine saw exactly the prompt the client built
    evs = read_events(out / "events.jsonl")
    by_rid: dict[str, dict[str, dict]] = {}
    for e in evs:
        if e["kind"] in ("gpu_submit", "gpu_end", "gpu_1st_token"):
            by_rid.setdefault(e["request_id"].rsplit("-", 2)[0], {})[e["kind"]] = e
    t0 = res.run["start_unix"]
    slack = 0.05  # clock mapping and event stamping
    for t in res.tasks:
        for r in t.rounds:
            e = by_rid[r.request_id]
            assert e["gpu_submit"]["prompt_tokens"] == r.prompt_tokens
            assert e["gpu_1st_token"]["cached_tokens"] == r.cached_tokens
            assert e["gpu_end"]["output_tokens"] == r.output_tokens
            assert t0 + r.submit_s - slack <= e["gpu_submit"]["ts"]
            assert e["gpu_end"]["ts"] <= t0 + r.end_s + slack

    # vLLM's own e2e histogram counted exactly these requests, and the client's spans hold the
    # server's. The client's excess (HTTP and sidecar proxying) depends on how busy the
    # machine is (0.2 s a round once in CI), so it is bounded only loosely here; tool time
    # counted into a round, the error a tight bound would catch, is checked from the stream
    # below
    sm = res.server_metrics
    assert sm and sm["vllm:e2e_request_latency_seconds_count"] == len(rounds)
    server_mean = res.summary["server"]["mean_e2e_request_latency_s"]
    client_mean = res.summary["round_latency_s"]["mean"]
    assert server_mean * 0.98 <= client_mean <= server_mean + 2.0, (client_mean, server_mean)

    # tool events went to the sidecar and came back in the merged stream, and each tool ran
    # between its round's end and the next round's submit, never inside a round
    kinds = [e["kind"] for e in evs]
    n_tools = sum(1 for r in rounds if r.tool)
    assert kinds.count("tool_start") == kinds.count("tool_end") == n_tools > 0
    tool_ev = {(e["kind"], e["call_id"]): e for e in evs if e["kind"] in ("tool_start", "tool_end")}
    for t in res.tasks:
        for r, nxt in zip(t.rounds, t.rounds[1:]):
            call = f"{t.task_id}.r{r.index}"  # (the replay's call id: session, round)
            start, end = tool_ev["tool_start", call]["ts"], tool_ev["tool_end", call]["ts"]
            assert t0 + r.end_s - slack <= start <= end <= t0 + nxt.submit_s + slack
            assert r.end_s <= r.tool_start_s <= r.tool_end_s <= nxt.submit_s
    # goodput is judged against the isolated run measured first (and cached)
    ideal = read_results(out / "ideal_results.json")
    assert ideal.mode == "isolated" and all(t.status == "completed" for t in ideal.tasks)
    assert all(t.ideal_s == it.latency_s for t, it in zip(res.tasks, ideal.tasks))
    assert res.summary["goodput"]["5"]["evaluated"] == 3
    assert res.config["ideal"]["source"].endswith(".json")
    for png in ("latency_cdf", "ttft_per_round", "kv_usage"):
        assert Path(res.files[png]).stat().st_size > 1000
    assert "| goodput slack 2 (tasks/s) |" in proc.stdout


def test_second_run_reuses_cached_ideal(server, cache, first_run, tmp_path):
    out1, _ = first_run
    r = _replay(server, *SCALED, "--out", str(tmp_path), "--ideal-cache", str(cache),
                "--salt", "second")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ideal latencies from cache" in r.stderr
    assert not (tmp_path / "ideal_results.json").exists()
    a, b = read_results(out1), read_results(tmp_path)
    assert [t.ideal_s for t in a.tasks] == [t.ideal_s for t in b.tasks]
    # a new salt means new task content: round 0 gets only the shared prefix from the cache
    assert b.tasks[0].rounds[0].cached_tokens <= a.tasks[0].rounds[0].prompt_tokens - 1


def test_ctrl_c_writes_partial_results(server, tmp_path):
    cmd = [sys.executable, "-m", "mars.cli", "replay", "ILR-1", "--num-tasks", "4", "--scale",
           "50", "--rate", "2", "--ideal", "skip", "--no-progress", "--url", server.url,
           "--out", str(tmp_path)]
    since = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # wait until the replay's calls reach the engine (its Ctrl-C handler is installed by then),
    # then let tools of uncompressed length get going
    assert wait_for_events(server.events_file, lambda e: e["kind"] == "gpu_end"
                           and e["ts"] > since and "@" not in (e.get("session_id") or ""),
                           timeout_s=90)
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted, stopping" in err
    res = read_results(tmp_path)
    assert res.run["interrupted"] is True
    assert "interrupted" in {t.status for t in res.tasks}
    assert sum(len(t.rounds) for t in res.tasks) > 0


def test_context_limit_stops_a_task(server, tmp_path):
    # P0 = 8100, P1 = 16114 (+4 fits 16384), P2 = 16628 does not: two rounds, then stop
    task = Task("long-ctx", 0.0, 100, 8000, (Round(4, "file_editor.view", 0.01, 8000, 10),
                                              Round(4, "file_editor.view", 0.01, 500, 10),
                                              Round(4)))
    write_trace(Trace.build("test", [task]), tmp_path / "t.jsonl")
    r = _replay(server, "--trace", str(tmp_path / "t.jsonl"), "--ideal", "skip",
                "--no-progress", "--no-plots", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    t = read_results(tmp_path / "out").tasks[0]
    assert t.status == "truncated" and len(t.rounds) == 2
    assert "max_model_len 16384" in t.error
    assert t.rounds[1].prompt_tokens == 16114 and t.rounds[1].cached_tokens >= 8096


def test_mars_top_watches_a_replay_live(server, tmp_path):
    """``mars top`` in a tmux pane while a replay runs against the real engine: the replay's
    sessions appear on screen as the sidecar admits them, with the engine's KV pool and the
    stream's events; then it quits on its key."""
    from tests.tmux import mars_top

    with mars_top(server.url, tmp_path, "--interval", "0.3") as pane:
        pane.wait_for(f"mars top  {server.url}")
        out, err = tmp_path / "run", tmp_path / "replay.err"
        with open(err, "wb") as errf:
            replay = subprocess.Popen(
                [sys.executable, "-m", "mars.cli", "replay", *SCALED, "--url", server.url,
                 "--ideal", "skip", "--no-plots", "--salt", "top", "--out", str(out)],
                stdout=subprocess.DEVNULL, stderr=errf)
            screens = []
            deadline = time.monotonic() + 600
            while replay.poll() is None and time.monotonic() < deadline:
                screens.append(pane.capture())
                time.sleep(0.3)
            if replay.poll() is None:
                replay.kill()
        assert replay.wait() == 0, err.read_text()[-3000:]
        screens.append(pane.capture())
        pane.keys("q")
        assert pane.exit_code() == 0 and "Traceback" not in pane.stderr()
    tasks = [t.task_id for t in read_results(out).tasks]
    # each session lives for seconds (rounds and tools): some frame shows it
    seen = {t for t in tasks if any(t in s for s in screens)}
    assert seen, (tasks, screens[len(screens) // 2])
    last = screens[-1]
    total = re.search(r"free \S+ of (\d+) blocks", last)
    events = re.search(r"events (\d+)", last)
    assert total and int(total.group(1)) > 0, last
    assert events and int(events.group(1)) > 0 and "stream live" in last, last
