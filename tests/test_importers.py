"""Importers of agent logs users already have: OpenAI-style request logs, SWE-agent
``.traj`` files, our OpenHands session logs (small fixtures written here)."""

from __future__ import annotations

import json

import pytest

from mars.cli import workloads as cli
from mars.workloads.importer import import_file
from mars.workloads.importers import (
    classify_swe_agent_action,
    classify_tool,
    detect_format,
    estimate_message_tokens,
    estimate_text_tokens,
)
from mars.workloads.trace import TraceError, prompt_lengths, read_trace, validate_trace


def _msgs(*texts: str) -> list[dict]:
    roles = ["system", "user", "assistant", "tool"]
    return [{"role": roles[min(i, 3)], "content": t} for i, t in enumerate(texts)]


def _resp(text: str, tool: str | None = None, command: str | None = None,
          usage: dict | None = None) -> dict:
    msg: dict = {"role": "assistant", "content": text}
    if tool:
        msg["tool_calls"] = [{"id": "c1", "type": "function", "function": {
            "name": tool, "arguments": json.dumps({"command": command} if command else {})}}]
    d: dict = {"choices": [{"index": 0, "message": msg}]}
    if usage:
        d["usage"] = usage
    return d


def test_estimates_are_the_documented_rule():
    assert estimate_text_tokens("") == 0
    assert estimate_text_tokens("abcd") == 1 and estimate_text_tokens("abcde") == 2
    assert estimate_text_tokens("é" * 4) == 2  # UTF-8 bytes, not characters
    # 3 per message + content + 3 to prime the reply
    assert estimate_message_tokens(_msgs("a" * 40, "b" * 8)) == 3 + 3 + 10 + 3 + 2


def test_tool_classification():
    assert classify_tool("execute_bash", "pip install -e .") == "terminal.install"
    assert classify_tool("bash", "python -m pytest tests/") == "terminal.test"
    assert classify_tool("terminal", "grep -rn foo .") == "terminal.search"
    assert classify_tool("bash", "python repro.py") == "terminal.run"
    assert classify_tool("str_replace_editor", "view /a.py") == "file_editor.view"
    assert classify_tool("str_replace_editor", "str_replace /a.py") == "file_editor.edit"
    assert classify_tool("task_tracker") == "task_tracker"
    assert classify_tool("think") == "think" and classify_tool(None) is None
    assert classify_swe_agent_action("str_replace_editor view /x.py") == "file_editor.view"
    assert classify_swe_agent_action("find_file setup.py") == "terminal.search"
    assert classify_swe_agent_action("submit") == "unknown"
    assert classify_swe_agent_action("cat x.py") == "file_editor.view"


def test_openai_log_with_usage_timestamps_and_estimates(tmp_path):
    sys_p, task = "S" * 4000, "T" * 400
    lines = [
        # session a: usage given; tool gaps from the timestamps
        {"session_id": "a", "timestamp": 100.0, "end_s": 101.0, "messages": _msgs(sys_p, task),
         "response": _resp("look", "execute_bash", "ls -la",
                           {"prompt_tokens": 1100, "completion_tokens": 20})},
        {"session_id": "a", "timestamp": 103.5, "latency_s": 0.5,
         "messages": _msgs(sys_p, task, "look", "x" * 400),
         "response": _resp("fix", "str_replace_editor", "str_replace /f",
                           {"prompt_tokens": 1250, "completion_tokens": 30})},
        {"session_id": "a", "timestamp": 104.25, "messages": _msgs(sys_p, task, "y"),
         "response": _resp("done", usage={"prompt_tokens": 1300, "completion_tokens": 5})},
        # session b: no usage (estimated), metadata id, request/response nesting
        {"metadata": {"session_id": "b"}, "timestamp": 102.0,
         "request": {"messages": _msgs("s" * 80, "q" * 40)},
         "response": _resp("r" * 16, "bash", "pip install numpy")},
        {"metadata": {"session_id": "b"}, "timestamp": 110.0,
         "request": {"messages": _msgs("s" * 80, "q" * 40, "r" * 16, "o" * 400)},
         "response": _resp("ok")},
    ]
    log = tmp_path / "requests.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert detect_format(log) == "openai-log"
    res = import_file(log, "auto")
    tr = res.trace
    validate_trace(tr)
    assert tr.header.params["format"] == "openai-log" and res.used_timestamps
    a, b = tr.tasks
    assert (a.task_id, a.arrival_s, b.task_id, b.arrival_s) == ("a", 0.0, "b", 2.0)
    assert prompt_lengths(a) == [1100, 1250, 1300]  # usage wins over the estimate
    assert [r.output_tokens for r in a.rounds] == [20, 30, 5]
    assert [r.tool for r in a.rounds] == ["terminal.search", "file_editor.edit", None]
    assert [r.tool_duration_s for r in a.rounds[:2]] == [2.5, 0.25]  # next start - this end
    p_b = estimate_message_tokens(_msgs("s" * 80, "q" * 40))
    assert prompt_lengths(b)[0] == p_b and b.rounds[0].tool == "terminal.install"
    assert b.rounds[0].output_tokens == 4 + estimate_text_tokens(
        json.dumps(_resp("", "bash", "pip install numpy")["choices"][0]["message"]["tool_calls"]))
    assert b.rounds[0].tool_duration_s == 0.0  # no end time logged: the gap is unknown


def test_openai_log_errors_name_the_line(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text(json.dumps({"session_id": "a", "messages": _msgs("x")}) + "\n"
                   + json.dumps({"session_id": "a", "prompt": "no messages"}) + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: no 'messages' list"):
        import_file(log, "openai-log")
    log.write_text(json.dumps({"messages": _msgs("x")}) + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: no session id"):
        import_file(log, "openai-log")


def test_condensed_history_error_clamp_or_split(tmp_path):
    calls = [(1000, 50), (1200, 40), (600, 30), (700, 20)]  # the third call was condensed
    log = tmp_path / "c.jsonl"
    log.write_text("\n".join(json.dumps({
        "session_id": "s", "timestamp": float(i), "messages": _msgs("x"),
        "response": _resp("y", "bash", "ls", {"prompt_tokens": p, "completion_tokens": o})})
        for i, (p, o) in enumerate(calls)) + "\n")
    with pytest.raises(TraceError, match=r"c\.jsonl:3: .*condensed history.*--condensed"):
        import_file(log, "openai-log")
    clamped = import_file(log, "openai-log", condensed="clamp")
    assert clamped.clamped == 1 and len(clamped.trace) == 1
    split = import_file(log, "openai-log", condensed="split")
    assert split.split == 1 and [t.task_id for t in split.trace] == ["s", "s~2"]
    first, second = split.trace.tasks
    assert prompt_lengths(first) == [1000, 1200] and prompt_lengths(second) == [600, 700]
    assert second.arrival_s == 2.0  # from the condensed call's own timestamp


def _traj(steps: list[dict], sent: int | None = None, received: int | None = None) -> dict:
    doc: dict = {"trajectory": steps, "history": [
        {"role": "system", "content": "S" * 4000}, {"role": "user", "content": "I" * 800}],
        "info": {"exit_status": "submitted"}}
    if sent is not None:
        doc["info"]["model_stats"] = {"tokens_sent": sent, "tokens_received": received,
                                      "api_calls": len(steps)}
    return doc


def test_swe_agent_traj_calibrated_to_the_recorded_totals(tmp_path):
    base = [{"role": "system", "content": "S" * 4000}, {"role": "user", "content": "I" * 800}]
    steps = []
    history = list(base)
    for k, (action, obs, dur) in enumerate([
            ("str_replace_editor view /repo/a.py", "A" * 2000, 0.2),
            ("python -m pytest tests/test_a.py", "F" * 1200, 14.0),
            ("submit", "", 0.1)]):
        resp = f"THOUGHT {k}\n```\n{action}\n```"
        steps.append({"response": resp, "thought": "t", "action": action, "observation": obs,
                      "execution_time": dur, "query": [dict(m) for m in history]})
        history += [{"role": "assistant", "content": resp}, {"role": "user", "content": obs}]
    d = tmp_path / "trajs"
    d.mkdir()
    (d / "django__django-1.traj").write_text(json.dumps(_traj(steps, sent=6000, received=90)))
    (d / "flask-2.traj").write_text(json.dumps(_traj(steps[:1])))
    assert detect_format(d) == "swe-agent"
    res = import_file(d, "auto")
    validate_trace(res.trace)
    t = {x.task_id: x for x in res.trace}["django__django-1"]
    ps = prompt_lengths(t)
    assert ps == sorted(ps) and abs(sum(ps) - 6000) <= 3  # rescaled to tokens_sent
    assert abs(sum(r.output_tokens for r in t.rounds) - 90) <= 3
    assert [r.tool for r in t.rounds] == ["file_editor.view", "terminal.test", None]
    assert [r.tool_duration_s for r in t.rounds[:2]] == [0.2, 14.0]
    one = {x.task_id: x for x in res.trace}["flask-2"]  # no totals: the raw estimate
    assert prompt_lengths(one) == [estimate_message_tokens(base)]
    bad = tmp_path / "x.traj"
    bad.write_text(json.dumps({"history": []}))
    with pytest.raises(TraceError, match="not a SWE-agent trajectory"):
        import_file(bad, "auto")


def test_openhands_session_logs_of_our_runs(tmp_path):
    sessions = tmp_path / "run" / "sessions"
    sessions.mkdir(parents=True)
    doc = {"result": {"session_id": "t1-abc"},
           "llm_calls": [
               {"round": 0, "submit_ts": 50.0, "status": "ok", "prompt_tokens": 9000,
                "completion_tokens": 120},
               {"round": 1, "submit_ts": 55.0, "status": "ok", "prompt_tokens": 9400,
                "completion_tokens": 80},
               {"round": 2, "submit_ts": 57.0, "status": "ok", "prompt_tokens": 9600,
                "completion_tokens": 40}],
           "tool_calls": [
               {"tool": "terminal", "round": 0, "duration_s": 3.0,
                "args": {"command": "pip install -r requirements.txt"}},
               {"tool": "file_editor", "round": 0, "duration_s": 0.1,
                "args": {"command": "view"}},
               {"tool": "file_editor", "round": 1, "duration_s": 0.05,
                "args": {"command": "str_replace"}}]}
    (sessions / "t1-abc.json").write_text(json.dumps(doc))
    assert detect_format(tmp_path / "run") == "openhands"
    res = import_file(tmp_path / "run", "auto", prefix_tokens=0)
    (t,) = res.trace.tasks
    assert t.task_id == "t1-abc" and prompt_lengths(t) == [9000, 9400, 9600]
    assert [r.tool for r in t.rounds] == ["terminal.install", "file_editor.edit", None]
    assert t.rounds[0].tool_duration_s == pytest.approx(3.1)  # both tools of round 0
    assert res.used_timestamps
    doc["llm_calls"][1].pop("prompt_tokens")
    (sessions / "t1-abc.json").write_text(json.dumps(doc))
    with pytest.raises(TraceError, match="round 1 has no token usage"):
        import_file(tmp_path / "run", "openhands")


def test_cli_import_formats(tmp_path, capsys):
    log = tmp_path / "r.jsonl"
    log.write_text(json.dumps({"session_id": "a", "messages": _msgs("x" * 100),
                               "response": _resp("y")}) + "\n")
    out = tmp_path / "t.jsonl"
    assert cli.main(["import", str(log), "-o", str(out)]) == 0
    assert "1 tasks from 1 calls" in capsys.readouterr().out
    assert read_trace(out).header.params["format"] == "openai-log"
    assert cli.main(["import", str(log), "-o", str(out), "--format", "swe-agent"]) == 1
    assert "not a SWE-agent trajectory" in capsys.readouterr().err


def test_openai_log_mixed_usage_iso_times_and_malformed_entries(tmp_path):
    log = tmp_path / "m.jsonl"
    msgs1, msgs2 = _msgs("s" * 400), _msgs("s" * 400, "a" * 40, "o" * 800)
    log.write_text("\n".join(json.dumps(x) for x in [
        {"session_id": "m", "timestamp": "2026-01-01T00:00:00Z", "messages": msgs1,
         "response": _resp("a" * 40, "bash", "ls", {"prompt_tokens": 5000,
                                                    "completion_tokens": 10})},
        {"session_id": "m", "timestamp": "2026-01-01T00:00:03+00:00", "messages": msgs2,
         "response": _resp("b" * 8)}]) + "\n")
    (t,) = import_file(log, "openai-log").trace.tasks
    # one call without usage: the whole session is estimated (no false "condensed" error)
    assert prompt_lengths(t) == [estimate_message_tokens(msgs1), estimate_message_tokens(msgs2)]
    assert t.arrival_s == 0.0
    log.write_text(json.dumps({"session_id": "m", "messages": msgs1, "choices": ["oops"]}) + "\n")
    with pytest.raises(TraceError, match=r"m\.jsonl:1: malformed log entry"):
        import_file(log, "openai-log")


def test_swe_agent_rescaling_keeps_the_history_append_only(tmp_path):
    # outputs rescaled up 3x, prompts barely: without care the second prompt would be shorter
    # than the first prompt + output
    steps = [{"response": "r" * 800, "action": "ls", "observation": "x" * 4,
              "execution_time": 0.1, "query": _msgs("S" * 4000)},
             {"response": "r" * 40, "action": "submit", "observation": "",
              "execution_time": 0.0, "query": _msgs("S" * 4000, "r" * 800, "x" * 4)}]
    p = tmp_path / "a.traj"
    p.write_text(json.dumps(_traj(steps, sent=2200, received=630)))
    (t,) = import_file(p, "swe-agent").trace.tasks
    ps = prompt_lengths(t)
    assert ps[1] >= ps[0] + t.rounds[0].output_tokens
    validate_trace(import_file(p, "swe-agent").trace)


def test_openhands_sdk_conversation_store(tmp_path):
    """The OpenHands SDK's own persisted conversation (base_state.json + events/)."""
    conv = tmp_path / "state" / "conv-1"
    (conv / "events").mkdir(parents=True)
    (conv / "base_state.json").write_text(json.dumps({"id": "conv-1", "stats": {
        "usage_to_metrics": {
            "agent": {"token_usages": [
                {"model": "m", "prompt_tokens": 8000, "completion_tokens": 60, "response_id": "r1"},
                {"model": "m", "prompt_tokens": 8300, "completion_tokens": 40, "response_id": "r2"},
                {"model": "m", "prompt_tokens": 8500, "completion_tokens": 20, "response_id": "r3"}]},
            "condenser": {"token_usages": [
                {"model": "m", "prompt_tokens": 9999, "completion_tokens": 99, "response_id": "c1"}]}}}}))
    events = [
        {"kind": "MessageEvent", "id": "e0", "timestamp": "2026-01-01T00:00:00", "source": "user"},
        {"kind": "ActionEvent", "id": "a1", "timestamp": "2026-01-01T00:00:02",
         "tool_name": "terminal", "llm_response_id": "r1",
         "action": {"kind": "TerminalAction", "command": "python -m pytest -x"}},
        {"kind": "ObservationEvent", "id": "o1", "timestamp": "2026-01-01T00:00:09.5",
         "action_id": "a1", "tool_name": "terminal"},
        {"kind": "ActionEvent", "id": "a2", "timestamp": "2026-01-01T00:00:10",
         "tool_name": "file_editor", "llm_response_id": "r2",
         "action": {"kind": "FileEditorAction", "command": "view"}},
        {"kind": "ObservationEvent", "id": "o2", "timestamp": "2026-01-01T00:00:10.25",
         "action_id": "a2", "tool_name": "file_editor"},
    ]
    for i, e in enumerate(events):
        (conv / "events" / f"event-{i:05d}-{e['id']}.json").write_text(json.dumps(e))
    assert detect_format(tmp_path / "state") == "openhands-sdk"
    res = import_file(tmp_path / "state", "auto")
    (t,) = res.trace.tasks
    assert t.task_id == "conv-1" and prompt_lengths(t) == [8000, 8300, 8500]  # no condenser
    assert [r.tool for r in t.rounds] == ["terminal.test", "file_editor.view", None]
    assert [r.tool_duration_s for r in t.rounds[:2]] == [7.5, 0.25]
    assert res.used_timestamps
