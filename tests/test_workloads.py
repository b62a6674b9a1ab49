"""Workload generator, trace schema/IO, importer and CLI (pure Python, fast)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mars.cli import workloads as cli
from mars.workloads.generator import (
    PAPER_CONTEXT_LIMIT,
    REGIMES,
    GeneratorConfig,
    Regime,
    build_pool,
    compress_time,
    generate,
    get_regime,
    poisson_arrivals,
    scale_trace,
    solve_theta,
    tilted_mean,
)
from mars.workloads.families import FAMILIES, get_family
from mars.workloads.importer import import_file, import_records, trace_to_records
from mars.workloads.stats import format_stats, trace_stats
from mars.workloads.tools import OBSERVATION_CAP_TOKENS, TOOLS, is_cpu_bound, sampling_table
from mars.workloads.trace import (
    Round,
    Task,
    Trace,
    TraceError,
    dumps_trace,
    loads_trace,
    prompt_lengths,
    read_trace,
    validate_trace,
    write_trace,
)

REPO = Path(__file__).resolve().parents[1]


def _assert_append_only(task: Task) -> None:
    ps = prompt_lengths(task)
    assert ps[0] == task.prefix_tokens + task.task_tokens
    for k in range(1, len(ps)):
        r = task.rounds[k - 1]
        assert ps[k] == ps[k - 1] + r.output_tokens + r.observation_tokens + r.template_tokens


# ------------------------------------------------------------------------------ tool table


def test_tool_table():
    specs, p = sampling_table()
    assert [s.name for s in specs] == [
        "terminal.run", "terminal.install", "terminal.search",
        "file_editor.view", "file_editor.edit", "task_tracker",
    ]
    assert math.isclose(sum(s.probability for s in specs), 0.94)
    assert math.isclose(p.sum(), 1.0)  # the remaining 0.06 is renormalised away
    assert math.isclose(p[0], 0.25 / 0.94)
    assert {n for n, t in TOOLS.items() if t.cpu_bound} == {
        "terminal.run", "terminal.test", "terminal.install"
    }
    assert is_cpu_bound("terminal.install") and not is_cpu_bound("file_editor.view")
    assert not is_cpu_bound(None) and not is_cpu_bound("something.else")


# ------------------------------------------------------------------------------- generator


def test_same_seed_same_trace_different_seed_different():
    a = generate("ILR-1", num_tasks=40, seed=7)
    b = generate("ILR-1", num_tasks=40, seed=7)
    c = generate("ILR-1", num_tasks=40, seed=8)
    assert a == b
    assert dumps_trace(a) == dumps_trace(b)
    assert [t.rounds for t in a] != [t.rounds for t in c]
    assert [t.arrival_s for t in a] != [t.arrival_s for t in c]


def test_pool_is_fast_and_well_formed():
    cfg = GeneratorConfig()
    pool = build_pool(424242, PAPER_CONTEXT_LIMIT, cfg)  # fresh seed: not cached    assert pool.size == cfg.pool_size == 20_000
    assert np.bincount(pool.family).tolist() == cfg.family_sizes() == [8000, 4000, 8000]
    assert pool.output.min() >= 1 and pool.observation.max() <= OBSERVATION_CAP_TOKENS
    last = pool.starts[1:] - 1
    assert (pool.tool[last] == -1).all() and (pool.observation[last] == 0).all()
    non_last = np.ones(len(pool.tool), bool)
    non_last[last] = False
    assert (pool.tool[non_last] >= 0).all()
    assert (pool.prompt + pool.output).max() <= PAPER_CONTEXT_LIMIT
    fam_of_round = np.repeat(pool.family, pool.num_rounds)
    for k, fam in enumerate(cfg.families):
        m = pool.family == k
        assert (pool.prefix_tokens[m] == fam.prefix_tokens).all()
        nr = pool.num_rounds[m]
        assert nr.min() >= fam.rounds.lo and nr.max() <= fam.rounds.hi
        rm = fam_of_round == k
        out = pool.output[rm]
        assert out.min() >= fam.output.lo and out.max() <= fam.output.hi
        # each family's tool mix, as given (renormalised)
        freq = np.bincount(pool.tool[rm & non_last], minlength=len(TOOLS)) / (rm & non_last).sum()
        assert np.allclose(freq, fam.tool_probabilities(), atol=0.01), fam.name


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family_distributions(fam):
    """Each family's draws follow its documented lognormals (medians within a few percent;
    clipping bounds lie outside the medians, so they do not move them)."""
    pool = build_pool(77, PAPER_CONTEXT_LIMIT)
    k = pool.family_names.index(fam.name)
    m = pool.family == k
    assert pool.truncated == 0  # nothing cut at 262K: the draws are the family's own
    assert math.isclose(np.median(pool.task_tokens[m]), fam.task_tokens.median, rel_tol=0.05)
    assert abs(np.median(pool.num_rounds[m]) - fam.rounds.median) <= 1
    rounds_of = np.repeat(pool.family, pool.num_rounds) == k
    assert math.isclose(np.median(pool.output[rounds_of]), fam.output.median, rel_tol=0.06)
    ln = np.log(pool.task_tokens[m])
    inner = (pool.task_tokens[m] > fam.task_tokens.lo) & (pool.task_tokens[m] < fam.task_tokens.hi)
    assert inner.mean() > 0.85 and math.isclose(np.std(ln[inner]), fam.task_tokens.sigma, rel_tol=0.25)


@pytest.mark.parametrize("name", list(REGIMES))
def test_regime_mean_within_1_percent(name):
    reg = REGIMES[name]
    trace = generate(name, num_tasks=2000, seed=0)
    vols = [sum(prompt_lengths(t)) for t in trace]
    assert abs(np.mean(vols) / reg.target_mean_volume - 1) < 0.01
    p = trace.header.params
    assert math.isclose(p["tilted_mean_prompt_volume"], reg.target_mean_volume, rel_tol=1e-6)
    assert max(t.max_context_tokens for t in trace) <= reg.context_limit
    assert all(t.prefix_tokens == get_family(t.meta["family"]).prefix_tokens for t in trace)
    assert math.isclose(sum(p["family_mix"].values()), 1.0)


def test_regimes_grow_in_context_size_not_in_rounds():
    """The paper's regimes progress "primarily in context size": per-call prompt mean and P90
    rise from ILR-1 to ILR-4, every regime has calls above 32K tokens, the rounds per task do
    not grow, and the estimated isolated completion time (H100, Qwen3-Coder-30B-A3B step-time
    model) stays within one band."""
    from mars.emulate.specs import get_gpu, get_model
    from mars.emulate.step_time import StepTimeModel
    from mars.workloads.ideal import estimate_isolated_s

    stm = StepTimeModel(get_model("qwen3-coder-30b-a3b"), get_gpu("h100"))
    means, p90s, rounds, ideal = [], [], [], []
    for i in (1, 2, 3, 4):
        trace = generate(f"ILR-{i}", num_tasks=2000, seed=0)
        calls = np.concatenate([prompt_lengths(t) for t in trace])
        means.append(calls.mean())
        p90s.append(np.percentile(calls, 90))
        assert (calls > 32_768).any(), f"ILR-{i} has no call above 32K tokens"
        rounds.append(np.mean([t.num_rounds for t in trace]))
        ideal.append(np.mean([estimate_isolated_s(t, stm) for t in trace.tasks[:400]]))
    assert means == sorted(means) and means[-1] > 2 * means[0]
    assert p90s == sorted(p90s) and p90s[-1] > 3 * p90s[0]
    assert rounds[-1] <= rounds[0]
    assert max(ideal) / min(ideal) < 1.5, ideal


def test_regimes_get_heavier():
    means = [np.mean([t.prompt_volume for t in generate(f"ILR-{i}", num_tasks=500, seed=1)]) for i in (1, 2, 3, 4)]
    assert means == sorted(means)


def test_solve_theta():
    v = np.array([1.0, 2.0, 3.0, 4.0])
    assert abs(solve_theta(v, 2.5)) < 1e-8  # untilted mean
    for target in (1.3, 2.0, 3.7):
        assert math.isclose(tilted_mean(v, solve_theta(v, target)), target, rel_tol=1e-8)
    with pytest.raises(ValueError):
        solve_theta(v, 4.5)
    with pytest.raises(ValueError):
        solve_theta(v, 1.0)


def test_append_only_against_pool_arrays():
    trace = generate("ILR-3", num_tasks=300, seed=5)
    pool = build_pool(5, PAPER_CONTEXT_LIMIT)
    for t in trace:
        _assert_append_only(t)
        i = t.meta["pool_index"]
        # prompts the pool computed vectorised == prompts derived from the rounds
        assert prompt_lengths(t) == pool.prompt[pool.starts[i]:pool.starts[i + 1]].tolist()
        assert t.rounds[-1].tool is None
        assert all(r.tool in TOOLS for r in t.rounds[:-1])


def test_context_limit_cuts_tasks():
    limit = 20_000
    pool = build_pool(3, limit)
    assert pool.truncated > 0
    assert (pool.prompt + pool.output).max() <= limit
    assert (pool.tool[pool.starts[1:] - 1] == -1).all()
    reg = Regime("tiny", float(np.median(pool.volume)), limit)
    trace = generate(reg, num_tasks=100, seed=3)
    assert max(t.max_context_tokens for t in trace) <= limit
    for t in trace:
        _assert_append_only(t)
    validate_trace(trace)


def test_scale_and_time_scale_preserve_shape():
    base = generate("ILR-2", num_tasks=60, seed=11)
    small = generate("ILR-2", num_tasks=60, seed=11, scale=50)
    fast = generate("ILR-2", num_tasks=60, seed=11, time_scale=4)
    assert small.header.params["scale"] == 50 and fast.header.params["time_scale"] == 4
    for b, s, f in zip(base, small, fast):
        assert b.task_id == s.task_id == f.task_id
        assert b.arrival_s == s.arrival_s
        assert math.isclose(f.arrival_s, b.arrival_s / 4)
        assert b.num_rounds == s.num_rounds == f.num_rounds
        _assert_append_only(s)
        assert s.prefix_tokens == round(get_family(b.meta["family"]).prefix_tokens / 50)
        for rb, rs, rf in zip(b.rounds, s.rounds, f.rounds):
            assert rb.tool == rs.tool == rf.tool
            assert rb.tool_duration_s == rs.tool_duration_s
            assert math.isclose(rf.tool_duration_s, rb.tool_duration_s / 4)
            assert (rb.output_tokens, rb.observation_tokens) == (rf.output_tokens, rf.observation_tokens)
            assert rs.output_tokens >= min(4, rb.output_tokens)
            assert abs(rs.output_tokens - rb.output_tokens / 50) <= 4
            assert (rs.observation_tokens == 0) == (rb.observation_tokens == 0)
            assert abs(rs.observation_tokens - rb.observation_tokens / 50) <= 1
    validate_trace(small)
    # the transforms also apply to any trace and compose
    assert scale_trace(base, 50) == replace(small, header=scale_trace(base, 50).header)
    assert compress_time(base, 4).tasks == fast.tasks


def test_duration_mode_and_arrivals():
    tr = generate("ILR-1", duration_s=2000, rate=0.5, seed=2)
    arr = [t.arrival_s for t in tr]
    assert arr == sorted(arr) and arr[-1] < 2000
    assert 850 < len(tr) < 1150  # Poisson(1000)
    full = poisson_arrivals(0.5, 2, num_tasks=len(tr) + 50)
    assert np.allclose(full[: len(tr)], arr, atol=1e-6)
    # arrivals are shared by all regimes of a seed
    other = generate("S-ILR-2", duration_s=2000, rate=0.5, seed=2)
    assert [t.arrival_s for t in other] == arr
    with pytest.raises(ValueError):
        generate("ILR-1", num_tasks=5, duration_s=10)
    with pytest.raises(ValueError):
        generate("ILR-1")


def test_regime_lookup():
    assert get_regime("ilr1").name == "ILR-1"
    assert get_regime("Short-ILR-3").name == "S-ILR-3"
    with pytest.raises(ValueError, match="unknown regime"):
        get_regime("ILR-9")


# ----------------------------------------------------------------------------- trace schema


def test_schema_round_trip(tmp_path):
    trace = generate("S-ILR-1", num_tasks=30, seed=4, scale=10, time_scale=3)
    path = tmp_path / "trace.jsonl"
    write_trace(trace, path)
    back = read_trace(path)
    assert back == trace
    assert loads_trace(path.read_text()) == trace
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    assert head["schema"] == "mars-trace" and head["version"] == 1 and head["num_tasks"] == 30
    assert set(json.loads(lines[1])) == {"task_id", "arrival_s", "prefix_tokens", "task_tokens", "rounds", "meta"}


def _small_trace() -> Trace:
    t1 = Task("a", 0.5, 100, 20, (Round(10, "terminal.run", 1.5, 30, 2), Round(5)))
    t2 = Task("b", 1.0, 100, 30, (Round(7, "file_editor.view", 0.1, 12, 2), Round(8, "task_tracker", 0.0, 3, 2), Round(4)))
    return Trace.build("hand", [t1, t2], seed=1)


def _mutate(lines: list[str], lineno: int, fn) -> list[str]:
    out = list(lines)
    d = json.loads(out[lineno - 1])
    fn(d)
    out[lineno - 1] = json.dumps(d)
    return out


def _set(path, value):
    def fn(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return fn


MALFORMED = [
    # (description, lines transform, expected message fragment)
    ("zero output", lambda L: _mutate(L, 3, _set(["rounds", 2, "output_tokens"], 0)),
     "t.jsonl:3: rounds[2].output_tokens must be >= 1"),
    ("float tokens", lambda L: _mutate(L, 2, _set(["task_tokens"], 20.5)),
     "t.jsonl:2: task_tokens must be an integer"),
    ("bool tokens", lambda L: _mutate(L, 2, _set(["rounds", 0, "observation_tokens"], True)),
     "t.jsonl:2: rounds[0].observation_tokens must be an integer"),
    ("negative duration", lambda L: _mutate(L, 3, _set(["rounds", 0, "tool_duration_s"], -1)),
     "t.jsonl:3: rounds[0].tool_duration_s must be >= 0"),
    ("bad json", lambda L: L[:2] + ['{"task_id": "b", '],
     "t.jsonl:3: invalid JSON"),
    ("tool on last round", lambda L: _mutate(L, 2, _set(["rounds", 1, "tool"], "terminal.run")),
     "t.jsonl:2: rounds[1].tool must be null"),
    ("no tool mid-task", lambda L: _mutate(L, 3, _set(["rounds", 1, "tool"], None)),
     "t.jsonl:3: rounds[1].tool must be a tool name"),
    ("missing field", lambda L: _mutate(L, 3, lambda d: d["rounds"][1].pop("template_tokens")),
     "t.jsonl:3: rounds[1]: missing field 'template_tokens'"),
    ("unknown field", lambda L: _mutate(L, 2, _set(["arival_s"], 3)),
     "t.jsonl:2: unknown field 'arival_s'"),
    ("empty rounds", lambda L: _mutate(L, 2, _set(["rounds"], [])),
     "t.jsonl:2: rounds must be a non-empty list"),
    ("duplicate id", lambda L: _mutate(L, 3, _set(["task_id"], "a")),
     "t.jsonl:3: task_id 'a' repeats the task on line 2"),
    ("unsorted arrivals", lambda L: _mutate(L, 3, _set(["arrival_s"], 0.1)),
     "t.jsonl:3: arrival_s 0.1 is before the previous task's"),
    ("truncated file", lambda L: L[:2],
     "t.jsonl:1: header says num_tasks=2 but the file has 1 tasks"),
    ("no header", lambda L: L[1:],
     "t.jsonl:1: not a mars trace"),
    ("future version", lambda L: _mutate(L, 1, _set(["version"], 2)),
     "t.jsonl:1: unsupported trace version 2"),
    ("empty file", lambda L: [],
     "t.jsonl:1: empty file"),
    ("not an object", lambda L: L[:2] + ["[1, 2]"],
     "t.jsonl:3: line must be a JSON object"),
]


@pytest.mark.parametrize("desc,transform,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_trace_rejected_naming_the_line(tmp_path, desc, transform, message):
    good = dumps_trace(_small_trace()).splitlines()
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(transform(good)) + "\n")
    with pytest.raises(TraceError) as exc:
        read_trace(path)
    assert message in str(exc.value)
    assert str(exc.value).startswith(str(path))


def test_blank_lines_keep_physical_line_numbers(tmp_path):
    lines = dumps_trace(_small_trace()).splitlines()
    lines = _mutate(lines, 3, _set(["rounds", 0, "output_tokens"], -2))
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([lines[0], "", lines[1], lines[2]]) + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:4: rounds\[0\]\.output_tokens"):
        read_trace(path)


def test_invalid_objects_are_not_written(tmp_path):
    bad = Task("x", 0.0, 10, 1, (Round(5, "terminal.run", 1.0, 3, 1),))  # last round has a tool
    with pytest.raises(TraceError, match=r"task 0 \('x'\): rounds\[0\]\.tool must be null"):
        write_trace(Trace.build("hand", [bad]), tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()
    np_int = Task("y", 0.0, 10, 1, (Round(np.int64(5)),))  # numpy ints would not serialise
    with pytest.raises(TraceError, match="must be an integer"):
        validate_trace(Trace.build("hand", [np_int]))


def test_task_helpers():
    t = _small_trace().tasks[1]
    assert prompt_lengths(t) == [130, 130 + 7 + 12 + 2, 130 + 21 + 8 + 3 + 2]
    assert t.prompt_volume == sum(prompt_lengths(t))
    assert t.max_context_tokens == 164 + 4
    assert t.rounds[0].appended_tokens == 21
    assert not t.rounds[0].cpu_bound and _small_trace().tasks[0].rounds[0].cpu_bound


def test_stats():
    trace = generate("ILR-1", num_tasks=200, seed=0)
    s = trace_stats(trace)
    assert s.tasks == 200 and s.rounds == sum(t.num_rounds for t in trace)
    assert s.tool_calls == s.rounds - 200
    assert math.isclose(sum(t.fraction for t in s.tools), 1.0)
    assert set(s.prefix_tokens) <= {f.prefix_tokens for f in FAMILIES}
    assert math.isclose(s.prompt_volume.mean, np.mean([t.prompt_volume for t in trace]))
    text = format_stats(s)
    assert "ILR-1" in text and "terminal.run" in text
    json.dumps(s.to_dict())  # serialisable


# ---------------------------------------------------------------------------------- importer

RECORDING = [
    # session s2 listed first in time but second in file; calls out of order within s1
    {"session_id": "s1", "call_index": 1, "prompt_tokens": 1150, "output_tokens": 40,
     "tool": "file_editor.edit", "tool_duration_s": 0.05},
    {"session_id": "s1", "call_index": 0, "start_s": 1000.0, "prompt_tokens": 1000,
     "output_tokens": 50, "tool": "terminal.run", "tool_duration_s": 2.0, "observation_tokens": 90},
    {"session_id": "s1", "call_index": 2, "prompt_tokens": 1215, "output_tokens": 30,
     "tool": "terminal.run", "extra": "ignored"},
    {"session_id": "s2", "start_s": 990.5, "prompt_tokens": 800, "output_tokens": 20},
    {"session_id": "s2", "prompt_tokens": 900, "output_tokens": 25, "tool": "terminal.install",
     "tool_duration_s": 12.0},
]


def test_importer_on_hand_made_recording():
    res = import_records(RECORDING, prefix_tokens=600)
    tr = res.trace
    assert res.used_timestamps and res.sessions == 2 and res.calls == 5
    assert [t.task_id for t in tr] == ["s2", "s1"]  # sorted by arrival
    s2, s1 = tr.tasks
    assert (s2.arrival_s, s1.arrival_s) == (0.0, 9.5)
    assert prompt_lengths(s1) == [1000, 1150, 1215]
    assert prompt_lengths(s2) == [800, 900]
    assert (s1.prefix_tokens, s1.task_tokens) == (600, 400)
    # given observation: template is the rest of the growth (150 - 50 - 90 = 10)
    assert s1.rounds[0] == Round(50, "terminal.run", 2.0, 90, 10)
    # derived: growth 1215 - 1150 - 40 = 25 -> 10 template + 15 observation
    assert s1.rounds[1] == Round(40, "file_editor.edit", 0.05, 15, 10)
    assert s1.rounds[2] == Round(30)  # tool after the last call is dropped
    assert s2.rounds[0].tool == "unknown"  # no tool recorded on a non-final call
    assert (res.dropped_final_tools, res.untooled, res.clamped) == (2, 1, 0)
    validate_trace(tr)


def test_importer_rejects_shrinking_context_unless_clamped(tmp_path):
    rec = [
        {"session_id": "a", "prompt_tokens": 500, "output_tokens": 50, "tool": "terminal.run"},
        {"session_id": "a", "prompt_tokens": 520, "output_tokens": 10},
    ]
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rec) + "\n")
    with pytest.raises(TraceError, match=r"rec\.jsonl:2: session 'a': prompt_tokens 520 is shorter"):
        import_file(path)
    res = import_file(path, clamp=True)
    assert res.clamped == 1 and res.trace.tasks[0].rounds[0].observation_tokens == 0
    assert not res.used_timestamps  # no start_s: Poisson arrivals
    path.write_text('{"session_id": "a", "prompt_tokens": 0, "output_tokens": 3}\n')
    with pytest.raises(TraceError, match=r"rec\.jsonl:1: prompt_tokens must be >= 1"):
        import_file(path)


def test_importer_round_trip_of_generated_trace():
    trace = generate("ILR-1", num_tasks=25, seed=9)
    res = import_records(trace_to_records(trace), prefix_tokens=1000, time_origin=0.0)
    # the importer cannot know each family's shared prefix: it splits the first prompt at
    # --prefix-tokens; everything else is reproduced exactly
    for t, back in zip(trace, res.trace.tasks):
        assert (t.task_id, t.arrival_s, t.rounds) == (back.task_id, back.arrival_s, back.rounds)
        assert prompt_lengths(t) == prompt_lengths(back) and back.prefix_tokens == 1000


# --------------------------------------------------------------------------------------- CLI


def test_cli_generate_stats_validate_import(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    assert cli.main(["generate", "ILR-2", "-o", str(out), "--num-tasks", "20", "--seed", "3",
                     "--scale", "20", "--time-scale", "2"]) == 0
    trace = read_trace(out)
    assert len(trace) == 20 and trace.header.params["scale"] == 20
    assert trace == generate("ILR-2", num_tasks=20, seed=3, scale=20, time_scale=2)
    assert cli.main(["validate", str(out)]) == 0
    assert "ok:" in capsys.readouterr().out
    assert cli.main(["stats", str(out)]) == 0
    assert "prompt volume" in capsys.readouterr().out
    assert cli.main(["stats", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["tasks"] == 20

    bad = tmp_path / "bad.jsonl"
    lines = out.read_text().splitlines()
    bad.write_text("\n".join(_mutate(lines, 2, _set(["rounds", 0, "output_tokens"], 0))) + "\n")
    assert cli.main(["validate", str(bad)]) == 1
    assert "bad.jsonl:2: rounds[0].output_tokens must be >= 1" in capsys.readouterr().err

    rec = tmp_path / "rec.jsonl"
    rec.write_text("\n".join(json.dumps(r) for r in RECORDING) + "\n")
    imp = tmp_path / "imp.jsonl"
    assert cli.main(["import", str(rec), "-o", str(imp), "--prefix-tokens", "600"]) == 0
    assert read_trace(imp) == import_file(rec, prefix_tokens=600).trace


def test_cli_register_into_parent_parser(tmp_path):
    import argparse

    parser = argparse.ArgumentParser(prog="mars")
    cli.register(parser.add_subparsers(dest="command"))
    out = tmp_path / "w.jsonl"
    args = parser.parse_args(["workloads", "generate", "s-ilr-3", "-o", str(out), "--duration", "50", "--rate", "1"])
    assert args.func(args) == 0
    args = parser.parse_args(["workloads", "validate", str(out)])
    assert args.func(args) == 0
    with pytest.raises(SystemExit):  # --num-tasks and --duration are exclusive
        parser.parse_args(["workloads", "generate", "ILR-1", "-o", "x", "--num-tasks", "3", "--duration", "5"])


def test_cli_as_module(tmp_path):
    out = tmp_path / "m.jsonl"
    r = subprocess.run(
        [sys.executable, "-m", "mars.cli.workloads", "generate", "ILR-4", "-o", str(out), "--num-tasks", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "mars.cli.workloads", "validate", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0 and "5 tasks" in r.stdout


def test_cli_stats_compares_regimes_and_families(tmp_path, capsys):
    png = tmp_path / "fig6.png"
    assert cli.main(["stats", "ILR-1", "ILR-4", "--num-tasks", "300", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["regime", "tasks"] and ">32K" in lines[0]
    assert lines[1].startswith("ILR-1") and lines[2].startswith("ILR-4")
    assert "EMULATED h100" in out  # the ideal estimate says where it comes from
    for fam in FAMILIES:
        assert fam.name in out
    assert "ILR-4 by family" in out
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 10_000
    assert cli.main(["stats", "--json", "--no-ideal", "ILR-2", "--num-tasks", "100"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["regime"]["tasks"] == 100 and d["regime"]["ideal_s"] is None
    assert {f["label"] for f in d["families"]} <= {f.name for f in FAMILIES}
    assert cli.main(["stats", "ILR-9"]) == 1
    assert "not a regime" in capsys.readouterr().err
