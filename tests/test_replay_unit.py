"""Replay harness, pure parts: prompt construction, tool pool, results schema, report table,
ideal cache, and the whole replay loop against an in-process fake OpenAI server (no vLLM)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mars.workloads.generator import generate
from mars.workloads.ideal import ideal_key, load_cached, load_ideal_file, save_cached
from mars.workloads.prompts import (
    TokenSpace,
    first_prompt,
    next_prompt,
    parse_token_range,
)
from mars.workloads.replay import ReplayConfig, ReplaySession, job_id
from mars.workloads.httpclient import ReplayError
from mars.workloads.results import (
    ResultsError,
    RoundResult,
    RunResult,
    TaskResult,
    format_report,
    read_results,
    report_rows,
    summarize_run,
    write_results,
)
from mars.workloads.toolpool import ToolPool, burn, format_cores, parse_cores
from mars.workloads.trace import Round, Task, Trace, prompt_lengths, write_trace

# ------------------------------------------------------------------------------- prompts


def _task(task_id="t0", prefix=20, ctx=7, rounds=None) -> Task:
    rounds = rounds or (Round(5, "terminal.run", 0.01, 9, 2), Round(3, "file_editor.view", 0.0, 4, 1),
                        Round(6))
    return Task(task_id, 0.0, prefix, ctx, tuple(rounds))


def test_round_k_prompt_is_previous_prompt_plus_generated_plus_filler_exactly():
    space = TokenSpace(seed=3)
    task = _task()
    p0 = first_prompt(space, task.task_id, task.prefix_tokens, task.task_tokens)
    assert p0 == space.shared_prefix(20) + space.task_context("t0", 7)
    gen0 = [1, 2, 3, 4, 5]  # any ids the model produced, even outside the filler range
    p1 = next_prompt(space, "t0", 0, p0, gen0, 9 + 2)
    assert p1[:len(p0)] == p0
    assert p1[len(p0):len(p0) + 5] == gen0
    assert p1[len(p0) + 5:] == space.filler("t0", 0, 11)
    assert len(p1) == len(p0) + 5 + 11
    gen1 = [7, 7, 7]
    p2 = next_prompt(space, "t0", 1, p1, gen1, 4 + 1)
    assert p2 == p1 + gen1 + space.filler("t0", 1, 5)
    # lengths equal the trace's derived prompt lengths when outputs are as asked
    assert [len(p0), len(p1), len(p2)] == prompt_lengths(task)


def test_prompt_content_is_deterministic_task_specific_and_in_range():
    a, b = TokenSpace(seed=0), TokenSpace(seed=0)
    assert a.task_context("x", 50) == b.task_context("x", 50)
    assert a.filler("x", 3, 40) == b.filler("x", 3, 40)
    # same counts, different tasks: different content (no cross-task prefix hits)
    assert a.task_context("x", 50) != a.task_context("y", 50)
    assert a.filler("x", 0, 40) != a.filler("x", 1, 40)
    # the shared prefix is shared by every task and survives a salt change; task content does not
    ideal = a.with_salt("run/ideal")
    assert ideal.shared_prefix(64) == a.shared_prefix(64)
    assert ideal.task_context("x", 50) != a.task_context("x", 50)
    # a different seed changes everything
    assert TokenSpace(seed=1).shared_prefix(64) != a.shared_prefix(64)
    ids = TokenSpace(seed=0, lo=100, hi=110).ids(2000, "k")
    assert min(ids) >= 100 and max(ids) < 110 and len(set(ids)) == 10
    assert a.ids(0, "k") == []


def test_parse_token_range():
    assert parse_token_range("100:900") == (100, 900)
    for bad in ("100", "a:b", "900:100", "-1:5", "5:6"):
        with pytest.raises(ValueError):
            parse_token_range(bad)


# ----------------------------------------------------------------------------- tool pool


def test_parse_and_format_cores():
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cores("2") == [2]
    assert format_cores([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    for bad in ("", "a", "3-1", "-2"):
        with pytest.raises(ValueError):
            parse_cores(bad)


def test_burn_takes_its_duration():
    s, e, done = burn(0.15, "wall")
    assert done and 0.15 <= e - s < 1.0
    # CPU-time burns stretch under contention (the point), so only a lower bound here
    c0 = time.thread_time()
    s, e, done = burn(0.15, "cpu")
    assert done and e - s >= 0.15 and time.thread_time() - c0 >= 0.15


def test_cpu_tools_queue_for_tool_cores_and_light_tools_do_not():
    async def go():
        pool = ToolPool(cores=[sorted(__import__("os").sched_getaffinity(0))[-1]], workers=1,
                        burn_mode="wall")
        async with pool:
            started: list[float] = []
            res = await asyncio.gather(
                pool.run(0.3, True, on_start=started.append),
                pool.run(0.3, True, on_start=started.append),
                pool.run(0.3, False),
            )
        return res, started

    (a, b, light), started = asyncio.run(go())
    first, second = sorted((a, b), key=lambda t: t.start)
    assert first.wait_s < 0.15
    assert second.wait_s >= 0.25  # waited for the single tool core
    assert second.start >= first.end - 0.01
    assert light.wait_s == 0 and 0.3 <= light.run_s < 1.0
    assert len(started) == 2


@pytest.mark.parametrize("how", ["main thread", "asyncio"])
def test_tool_workers_die_with_a_killed_replay(how):
    """A replay killed outright (SIGKILL: no clean-up runs) takes its tool workers with it;
    they used to wait on their queue forever, holding the replay's stdout open. ``asyncio``
    starts the pool as ``mars replay`` does (``async with``), and the workers must outlive
    the event loop that started them while the replay lives."""
    import signal
    import subprocess
    import sys

    import psutil

    from tests.conftest import wait_gone

    start = ("pool = ToolPool(workers=2, burn_mode='wall').start()\n" if how == "main thread"
             else "import asyncio\n"
                  "pool = asyncio.run(ToolPool(workers=2, burn_mode='wall').__aenter__())\n")
    code = ("import time\n"
            "from mars.workloads.toolpool import ToolPool\n" + start +
            "time.sleep(1)\n"  # the thread that spawned them has ended: still alive
            "assert all(p.is_alive() for p in pool._pool._processes.values())\n"
            "print(*pool._pool._processes, flush=True)\n"
            "time.sleep(600)\n")
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          text=True) as proc:
        try:
            workers = [psutil.Process(int(p)) for p in proc.stdout.readline().split()]
            assert len(workers) == 2, proc.wait(timeout=60)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            left = wait_gone(workers, 30)
            assert not left, f"tool workers {left} outlived their killed replay"
        finally:
            proc.kill()


def test_tool_pool_rejects_bad_config():
    with pytest.raises(ValueError):
        ToolPool(cores=[10_000])
    with pytest.raises(ValueError):
        ToolPool(burn_mode="gpu")


# ------------------------------------------------------------------------------- results


def _round(k, submit, first, end, prompt, cached, tool=None, cpu=False, enq=None, start=None,
           stop=None, dur=0.0) -> RoundResult:
    return RoundResult(index=k, prompt_tokens=prompt, output_tokens=4, planned_output_tokens=4,
                       submit_s=submit, first_token_s=first, end_s=end, cached_tokens=cached,
                       request_id=f"r{k}", tool=tool, tool_cpu_bound=cpu, tool_duration_s=dur,
                       tool_enqueue_s=enq, tool_start_s=start, tool_end_s=stop)


def _run(label="fcfs", lat_scale=1.0) -> RunResult:
    tasks = [
        TaskResult("a", 0.0, 2, "completed", 0.0, 4.0 * lat_scale, [
            _round(0, 0.0, 0.5, 1.0, 100, 0, "terminal.run", True, 1.0, 1.5, 2.0, 0.5),
            _round(1, 2.0, 2.2, 4.0 * lat_scale, 120, 96)], ideal_s=2.0),
        TaskResult("b", 1.0, 2, "truncated", 1.0, 3.0, [
            _round(0, 1.0, 1.1, 3.0, 100, 32)], ideal_s=1.0, error="round 1 would need ..."),
        TaskResult("c", 2.0, 3, "error", 2.0, None, [], ideal_s=None, error="round 0: HTTP 500"),
        TaskResult("d", 5.0, 3, "not_started"),
    ]
    r = RunResult(label=label, mode="load",
                  trace={"regime": "ILR-1", "num_tasks": 4, "seed": 0, "params": {}, "sha256": "x"},
                  server={"url": "http://x", "model": "m", "max_model_len": 100},
                  config={"seed": 0}, run={"start_unix": 1000.0, "wall_s": 5.0,
                                          "interrupted": False},
                  tasks=tasks, server_metrics={"vllm:e2e_request_latency_seconds_sum": 3.0,
                                               "vllm:e2e_request_latency_seconds_count": 3.0})
    return r.finalize()


def test_summary_numbers():
    s = _run().summary
    assert s["tasks"] == {"total": 4, "completed": 1, "truncated": 1, "error": 1, "not_started": 1}
    assert s["latency_s"]["count"] == 2 and s["latency_s"]["mean"] == pytest.approx(3.0)  # 4, 2
    assert s["window_s"] == [0.0, 4.0]
    assert s["throughput"]["tasks_per_s"] == pytest.approx(2 / 4.0)
    # a: 4 <= 2*2 (good at every slack); b: 2 <= 2*1 (good at every slack)
    assert s["goodput"]["2"]["good"] == 2 and s["goodput"]["2"]["evaluated"] == 2
    assert s["slowdown"]["mean"] == pytest.approx(2.0)
    assert s["cached_fraction"]["later_rounds_token_weighted"] == pytest.approx(96 / 120)
    assert s["cached_fraction"]["first_round_mean"] == pytest.approx((0 + 32 / 100) / 2)
    assert s["tool_wait_s"]["mean"] == pytest.approx(0.5)
    assert s["ttft_s"]["count"] == 3
    assert s["ttft_by_round"][0]["round"] == 0 and s["ttft_by_round"][0]["count"] == 2
    assert s["server"]["mean_e2e_request_latency_s"] == pytest.approx(1.0)
    slow = _run(lat_scale=1.5).summary  # a: 6 > 2*2 -> misses slack 2, meets 3 and 5
    assert slow["goodput"]["2"]["good"] == 1 and slow["goodput"]["3"]["good"] == 2


def test_results_round_trip_through_json(tmp_path):
    r = _run()
    r.summary["nan_example"] = math.nan
    write_results(r, tmp_path / "results.json")
    text = (tmp_path / "results.json").read_text()
    assert "NaN" not in text  # strict JSON
    back = read_results(tmp_path)  # a run directory works too
    assert back.to_dict() == r.to_dict()
    assert back.tasks[0].rounds[1].cached_fraction == pytest.approx(0.8)
    assert back.tasks[0].latency_s == pytest.approx(4.0)
    assert back.tasks[2].latency_s is None
    d = json.loads(text)
    assert d["schema"] == "mars-replay-results" and d["version"] == 1
    assert d["tasks"][0]["latency_s"] == pytest.approx(4.0)


def test_results_reader_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"schema": "mars-trace"}))
    with pytest.raises(ResultsError, match="not a mars replay results file"):
        read_results(p)
    d = _run().to_dict()
    d["version"] = 99
    p.write_text(json.dumps(d))
    with pytest.raises(ResultsError, match="unsupported results version 99"):
        read_results(p)
    with pytest.raises(ResultsError, match="cannot read"):
        read_results(tmp_path / "missing.json")


def test_report_table_compares_runs():
    table = format_report([_run("fcfs"), _run("mars", 1.5)])
    lines = table.splitlines()
    assert lines[0] == "| metric | fcfs | mars |"
    assert lines[1] == "|---|---:|---:|"
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines[2:]}
    assert rows["tasks done / total"][0] == "2 / 4 (1 truncated)"
    assert rows["tasks not done"][0] == "1 error, 1 not_started"
    assert rows["latency mean (s)"] == ["3.00", "4.00"]
    assert rows["goodput slack 2 (tasks/s)"] == ["0.500 (2/2)", "0.167 (1/2)"]
    assert rows["cached fraction, rounds ≥ 1"] == ["80.0%", "80.0%"]
    assert format_report([_run("a|b")]).splitlines()[0] == "| metric | a\\|b |"
    with pytest.raises(ValueError):
        format_report([])


def test_summary_of_an_empty_run_is_valid():
    s = summarize_run([TaskResult("a", 0.0, 2)])
    assert s["tasks"]["not_started"] == 1 and s["goodput"] is None
    assert math.isnan(s["latency_s"]["mean"])


# --------------------------------------------------------------------------------- ideal


def test_ideal_cache(tmp_path):
    f1 = {"trace_sha256": "abc", "model": "m", "tag": ""}
    f2 = {"tag": "", "model": "m", "trace_sha256": "abc"}
    assert ideal_key(f1) == ideal_key(f2) != ideal_key({**f1, "model": "other"})
    k = ideal_key(f1)
    assert load_cached(k, tmp_path) is None
    p = save_cached(k, f1, {"a": 1.5, "b": 2.0}, tmp_path)
    assert load_cached(k, tmp_path) == {"a": 1.5, "b": 2.0}
    assert load_ideal_file(p) == {"a": 1.5, "b": 2.0}
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"a": 3}))
    assert load_ideal_file(plain) == {"a": 3.0}
    iso = _run()
    iso.mode = "isolated"
    write_results(iso, tmp_path / "iso" / "results.json")
    assert load_ideal_file(tmp_path / "iso") == {"a": 4.0, "b": 2.0}
    write_results(_run(), tmp_path / "load.json")
    with pytest.raises(ValueError, match="isolated run"):
        load_ideal_file(tmp_path / "load.json")


# ------------------------------------------------------- the replay loop, fake server


class FakeServer:
    """An OpenAI-compatible /v1/completions that streams like vLLM and records requests."""

    def __init__(self, max_model_len=10_000, block=4, sidecar=False, fail_round=None,
                 usage_details=True, events_file=None, keys=None):
        #: (api key, events key): a sidecar started with --api-key / --events-api-key
        self.keys = keys
        self.max_model_len, self.block = max_model_len, block
        self.usage_details, self.events_file = usage_details, events_file
        self.sidecar, self.fail_round = sidecar, fail_round
        self.requests: list[dict] = []
        self.events: list[dict] = []
        self.rejected_events = 0
        self.seen: list[list[int]] = []

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for p in self.seen:
            n = 0
            for x, y in zip(p, prompt):
                if x != y:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1) // self.block * self.block

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.keys is not None:
            got = request.headers.get("authorization")
            ok = {f"Bearer {self.keys[0]}"}
            if path == "/v1/mars/events":
                ok.add(f"Bearer {self.keys[1]}")
            if got not in ok:
                return httpx.Response(401, json={"error": {"message": "bad key", "code": 401}})
            if path == "/v1/mars/events" and got == f"Bearer {self.keys[1]}" and any(
                    e["kind"] == "session_end" for e in json.loads(request.content)):
                # as the sidecar: a tool-runner key may not end sessions (whole batch refused)
                self.rejected_events += 1
                return httpx.Response(403, json={"error": {"message": "no", "code": 403}})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [
                {"id": "fake", "root": "/fake", "max_model_len": self.max_model_len}]})
        if path == "/v1/mars/events":
            if not self.sidecar:
                return httpx.Response(404, json={"detail": "Not Found"})
            self.events.extend(json.loads(request.content))
            return httpx.Response(200, json={"accepted": 0})
        if path == "/v1/completions":
            body = json.loads(request.content)
            self.requests.append(body)
            if self.fail_round is not None and body["vllm_xargs"]["round"] == self.fail_round:
                return httpx.Response(500, json={"error": {"message": "boom"}})
            prompt, n = body["prompt"], body["max_tokens"]
            cached = self._cached(prompt)
            gen = [(len(prompt) * 7 + i) % 50 for i in range(n)]
            self.seen.append(prompt + gen)
            rid = "cmpl-" + body["request_id"]
            chunks = [{"id": rid, "choices": [{"index": 0, "text": "x", "token_ids": [g],
                                                "finish_reason": "length" if i == n - 1 else None,
                                                **({"prompt_token_ids": prompt} if i == 0 else {})}]}
                      for i, g in enumerate(gen)]
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
            if self.usage_details:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            if self.events_file:  # what mars-vllm serve --mars-events-file writes
                with open(self.events_file, "a") as f:
                    f.write(json.dumps({"v": 1, "kind": "gpu_1st_token", "ts": time.time(),
                                        "session_id": body["vllm_xargs"]["job_id"],
                                        "request_id": f"{rid}-0-0123abcd", "round":
                                        body["vllm_xargs"]["round"], "launch_delay_s": 0.0,
                                        "cached_tokens": cached}) + "\n")
            chunks.append({"id": rid, "choices": [], "usage": usage})
            sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, content=sse.encode(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(404)


def _tiny_trace(n=3, **kw) -> Trace:
    return generate("ILR-1", num_tasks=n, scale=100, time_scale=200, rate=5.0, seed=1, **kw)


def _replay(fake: FakeServer, trace: Trace, mode="load", stop_after=None, events_path=None,
            **keys):
    cfg = ReplayConfig(url="http://fake", progress=False, tool_burn="wall", tool_workers=1,
                       events_file=fake.events_file, **keys)

    async def go():
        async with ReplaySession(cfg, transport=httpx.MockTransport(fake)) as s:
            if stop_after is not None:
                asyncio.get_running_loop().call_later(stop_after, s.stop)
            return await s.run(trace, mode, label=mode, events_path=events_path)

    return asyncio.run(go())


def test_replay_sends_exact_extending_prompts_and_session_metadata():
    fake = FakeServer()
    trace = _tiny_trace()
    res = _replay(fake, trace)
    assert [t.status for t in res.tasks] == ["completed"] * len(trace)
    assert len(fake.requests) == sum(t.num_rounds for t in trace)
    space = TokenSpace(seed=0, salt="run")
    for task in trace:
        reqs = sorted((r for r in fake.requests if r["vllm_xargs"]["job_id"] == task.task_id),
                      key=lambda r: r["vllm_xargs"]["round"])
        assert len(reqs) == task.num_rounds
        assert reqs[0]["prompt"] == first_prompt(space, task.task_id, task.prefix_tokens,
                                                 task.task_tokens)
        for k, (req, rnd) in enumerate(zip(reqs, task.rounds)):
            x = req["vllm_xargs"]
            assert x["round"] == k and x.get("last_round", False) == (k == task.num_rounds - 1)
            assert x.get("next_tool") == rnd.tool
            assert x.get("prev_tool") == (task.rounds[k - 1].tool if k else None)
            assert req["max_tokens"] == req["min_tokens"] == rnd.output_tokens
            assert req["ignore_eos"] is True and req["return_token_ids"] is True
            assert req["stream"] is True and req["stream_options"] == {"include_usage": True}
            if k:
                prev, prev_rnd = reqs[k - 1], task.rounds[k - 1]
                gen = [(len(prev["prompt"]) * 7 + i) % 50 for i in range(prev_rnd.output_tokens)]
                assert req["prompt"] == next_prompt(
                    space, task.task_id, k - 1, prev["prompt"], gen,
                    prev_rnd.observation_tokens + prev_rnd.template_tokens)
        assert [len(r["prompt"]) for r in reqs] == prompt_lengths(task)
    # measurements are recorded and cached fractions come from usage
    assert res.cached_tokens_source == "usage"
    t0 = res.tasks[0]
    assert all(r.ttft_s is not None and 0 <= r.ttft_s <= r.latency_s for r in t0.rounds)
    assert all(r.cached_tokens > 0 for t in res.tasks for r in t.rounds if r.index > 0)
    assert res.summary["cached_fraction"]["later_rounds_mean"] > 0.5
    assert t0.latency_s is not None and t0.finish_s == t0.rounds[-1].end_s
    assert res.summary["goodput"]["2"]["missing_ideal"] == len(trace)


def test_cached_tokens_fall_back_to_engine_events(tmp_path):
    trace = _tiny_trace(2)
    bare = _replay(FakeServer(usage_details=False), trace)
    assert bare.cached_tokens_source is None
    assert any("--enable-prompt-tokens-details" in n for n in bare.notes)
    assert math.isnan(bare.summary["cached_fraction"]["later_rounds_mean"])
    fake = FakeServer(usage_details=False, events_file=str(tmp_path / "engine.jsonl"))
    res = _replay(fake, trace, events_path=tmp_path / "events.jsonl")
    assert res.cached_tokens_source == "events"
    assert (tmp_path / "events.jsonl").exists() and res.files["events"].endswith("events.jsonl")
    ref = _replay(FakeServer(), trace)  # same prompts, cached tokens from usage
    # (rounds >= 1 only: round 0's shared-prefix hit depends on which task came first)
    assert [r.cached_tokens for t in res.tasks for r in t.rounds if r.index] == \
        [r.cached_tokens for t in ref.tasks for r in t.rounds if r.index]


def test_isolated_run_is_sequential_with_its_own_content_and_sessions():
    fake = FakeServer()
    trace = _tiny_trace(2)
    res = _replay(fake, trace, mode="isolated")
    a, b = res.tasks
    assert a.arrival_s == a.start_s and b.arrival_s == b.start_s >= a.finish_s
    assert {r["vllm_xargs"]["job_id"] for r in fake.requests} == {
        job_id(t.task_id, "isolated") for t in trace}
    ideal_space = TokenSpace(seed=0, salt="run/ideal")
    t = trace.tasks[0]
    assert fake.requests[0]["prompt"] == first_prompt(ideal_space, t.task_id, t.prefix_tokens,
                                                      t.task_tokens)


def test_context_limit_truncates_after_the_last_round_that_fits():
    task = Task("long", 0.0, 10, 10, (Round(4, "file_editor.view", 0.0, 30, 1),
                                      Round(4, "file_editor.view", 0.0, 30, 1), Round(4)))
    too_long = Task("huge", 0.0, 60, 50, (Round(4),))
    trace = Trace.build("test", [task, too_long])
    fake = FakeServer(max_model_len=60)  # P0=20, P1=55 (+4 = 59 fits), P2=90 does not
    res = _replay(fake, trace)
    t, h = res.tasks
    assert t.status == "truncated" and len(t.rounds) == 2 and "max_model_len 60" in t.error
    assert t.rounds[-1].tool is None  # the cut round's tool did not run
    assert t.latency_s is not None  # truncated tasks count as done
    assert h.status == "skipped" and h.rounds == [] and h.latency_s is None


def test_http_error_fails_the_task_not_the_run():
    fake = FakeServer(fail_round=1)
    res = _replay(fake, _tiny_trace(2))
    assert [t.status for t in res.tasks] == ["error", "error"]
    assert all("HTTP 500: boom" in t.error and len(t.rounds) == 1 for t in res.tasks)
    assert res.summary["tasks"]["error"] == 2


def test_stop_interrupts_cleanly_and_keeps_partial_results():
    fake = FakeServer(sidecar=True)
    trace = Trace.build("test", [
        Task("a", 0.0, 10, 10, (Round(4, "terminal.run", 20.0, 3, 1), Round(4))),
        Task("b", 0.0, 10, 10, (Round(4, "file_editor.view", 20.0, 3, 1), Round(4))),
        Task("c", 60.0, 10, 10, (Round(4),)),
    ])
    t0 = time.monotonic()
    res = _replay(fake, trace, stop_after=1.5)
    assert time.monotonic() - t0 < 10  # the 20 s tools were stopped, CPU burn included
    assert res.run["interrupted"] is True
    a, b, c = res.tasks
    assert a.status == b.status == "interrupted" and len(a.rounds) == len(b.rounds) == 1
    assert c.status == "not_started" and c.rounds == []
    assert res.summary["tasks"] == {"total": 3, "completed": 0, "truncated": 0,
                                    "interrupted": 2, "not_started": 1}
    ends = [e for e in fake.events if e["kind"] == "tool_end"]
    assert {e["status"] for e in ends} == {"interrupted"} and len(ends) == 2
    assert {e["reason"] for e in fake.events if e["kind"] == "session_end"} == {"disconnect"}
    json.dumps(res.to_dict(), allow_nan=False)


def test_tool_events_go_to_a_sidecar_when_present():
    fake = FakeServer(sidecar=True)
    trace = _tiny_trace(2)
    res = _replay(fake, trace)
    kinds = [e["kind"] for e in fake.events]
    tools = sum(t.num_rounds - 1 for t in trace)
    assert kinds.count("tool_enqueue") == kinds.count("tool_start") == kinds.count("tool_end") == tools
    from mars.protocol.events import parse_event

    for e in fake.events:
        parse_event(e)
    ends = [e for e in fake.events if e["kind"] == "tool_end"]
    assert all(e["status"] == "ok" and e["session_id"].startswith("ILR-1") for e in ends)
    assert any("posted to the sidecar" in n for n in res.notes)


# ---------------------------------------------------------------------------------- CLI


def _mars(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mars.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_cli_clear_errors():
    r = _mars("replay", "ILR-9", "--url", "http://127.0.0.1:9")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "mars replay: unknown regime 'ILR-9'; known: ILR-1, ILR-2, ILR-3, ILR-4, S-ILR-1, "
        "S-ILR-2, S-ILR-3"]
    r = _mars("replay", "ILR-1", "--num-tasks", "2", "--url", "http://127.0.0.1:9", "--no-progress")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("mars replay: cannot reach http://127.0.0.1:9")
    r = _mars("replay", "--url", "http://127.0.0.1:9")
    assert r.returncode == 1 and "give a regime" in r.stderr
    r = _mars("replay", "ILR-1", "--url", "http://127.0.0.1:9", "--tool-cores", "x")
    assert r.returncode == 2 and "core list must look like 0-3,6" in r.stderr  # argparse


def test_cli_report(tmp_path):
    write_results(_run("fcfs"), tmp_path / "a" / "results.json")
    write_results(_run("mars", 1.5), tmp_path / "b" / "results.json")
    r = _mars("report", str(tmp_path / "a"), str(tmp_path / "b" / "results.json"),
              "--plot", str(tmp_path / "cdf.png"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "| metric | fcfs | mars |"
    assert (tmp_path / "cdf.png").stat().st_size > 1000
    r = _mars("report", str(tmp_path / "a"), str(tmp_path / "a"))
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "| metric | fcfs (a) | fcfs (a) |"
    r = _mars("report", str(tmp_path / "nope"))
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_plots_are_written(tmp_path):
    from mars.workloads.plots import write_run_plots

    r = _run()
    evs = [{"kind": "kv_snapshot", "ts": 1000.0 + i, "total_blocks": 100, "used_blocks": i,
            "free_blocks": 100 - i, "pinned_blocks": 0, "running": 1, "waiting": 0}
           for i in range(5)]
    out = write_run_plots(r, tmp_path, evs)
    assert set(out) == {"latency_cdf", "ttft_per_round", "kv_usage"}
    assert all(Path(p).stat().st_size > 1000 for p in out.values())
    assert "kv_usage" not in write_run_plots(r, tmp_path / "no-events")


def test_trace_file_replay_arguments(tmp_path):
    from mars.cli.replay import build_trace
    import argparse

    trace = _tiny_trace(2)
    write_trace(trace, tmp_path / "t.jsonl")
    ns = argparse.Namespace(regime=None, trace=str(tmp_path / "t.jsonl"), num_tasks=None,
                            duration=None, rate=None, scale=2.0, time_scale=1.0, seed=0,
                            context_limit=None)
    t2 = build_trace(ns)
    assert len(t2) == 2 and t2.header.params["scale"] == 200.0
    ns.num_tasks = 3
    with pytest.raises(ValueError, match="with --trace the file decides"):
        build_trace(ns)


def test_replay_sends_the_api_key_and_the_events_key():
    """Against a keyed sidecar the replay authenticates its calls with --api-key and its
    tool events with --events-api-key; a missing key is one clear error, not a hang."""
    fake = FakeServer(sidecar=True, keys=("sk-api", "sk-tools"))
    trace = _tiny_trace(2)
    res = _replay(fake, trace, api_key="sk-api", events_api_key="sk-tools")
    assert [t.status for t in res.tasks] == ["completed"] * 2
    assert fake.events, "tool events were not accepted"
    # sessions that fail end with session_end, which goes with the API key, not the events key
    fake = FakeServer(sidecar=True, keys=("sk-api", "sk-tools"), fail_round=1)
    res = _replay(fake, trace, api_key="sk-api", events_api_key="sk-tools")
    assert [t.status for t in res.tasks] == ["error"] * 2
    assert fake.rejected_events == 0
    assert len([e for e in fake.events if e["kind"] == "session_end"]) == 2
    assert any(e["kind"] == "tool_end" for e in fake.events)
    with pytest.raises(ReplayError, match="401.*API key"):
        _replay(FakeServer(sidecar=True, keys=("sk-api", "sk-tools")), trace)
    with pytest.raises(ReplayError, match="events key"):
        _replay(FakeServer(sidecar=True, keys=("sk-api", "sk-tools")), trace,
                api_key="sk-api", events_api_key="wrong")


def test_recomputed_context_and_preemptions():
    """Round 1 of task a had 100 + 4 tokens of context computed in round 0, and found 96 in
    the prefix cache: 8 tokens were evicted during the tool call and prefilled again."""
    r = _run()
    assert r.summary["recomputed_context_tokens"] == 8
    rows = dict(report_rows(r))
    assert rows["recomputed context (tokens)"] == "8"
    assert rows["preemptions (server)"] == "–"
    r.server_metrics = {**r.server_metrics, "vllm:num_preemptions_total": 3.0}
    assert dict(report_rows(r.finalize()))["preemptions (server)"] == "3"


def test_ctrl_c_while_the_replay_probes_its_server_stops_it_gracefully(tmp_path):
    """A Ctrl-C that lands during start-up (here: while the server probe waits for its
    answer) is held, not raised half-way: start-up ends, no task starts, the partial results
    (every task not started) are written, exit 130, no traceback. The server is a stub that
    answers the probe only once the signal was sent, so the moment is certain."""
    import http.server
    import os
    import signal
    import threading

    probed, release, paths = threading.Event(), threading.Event(), []

    class Stub(http.server.BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            paths.append(("GET", self.path))
            if self.path == "/v1/models":
                probed.set()
                release.wait(30)
                self._send(200, {"object": "list", "data": [
                    {"id": "stub", "object": "model", "max_model_len": 4096}]})
            else:
                self._send(404, {"error": "no"})

        def do_POST(self):  # noqa: N802
            paths.append(("POST", self.path))
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self._send(404, {"error": "no"})

        def log_message(self, *a):  # quiet
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"

    def ctrl_c_as_in_a_terminal() -> None:  # not ignored, even under `nohup make test &`
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mars.cli", "replay", "ILR-1", "--num-tasks", "2",
             "--ideal", "skip", "--no-progress", "--url", url, "--out", str(tmp_path / "r")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=ctrl_c_as_in_a_terminal)
        try:
            assert probed.wait(60), proc.communicate(timeout=30)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)  # (delivered while the probe still waits)
            release.set()
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
    finally:
        release.set()
        srv.shutdown()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted while starting" in err and "Traceback" not in err, err[-3000:]
    res = read_results(tmp_path / "r")
    assert res.run["interrupted"] is True
    assert [t.status for t in res.tasks] == ["not_started", "not_started"]
    assert not [p for p in paths if "completions" in p[1]]  # no call was sent
