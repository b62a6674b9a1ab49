"""Agent logs users already have, converted into the importer's call records.

The lower of the two import layers: it reads files (every format, the importer's own
``recording`` JSONL included) into records and imports nothing of :mod:`.importer`, which
turns records into a trace.

Each format becomes the per-call records of :mod:`mars.workloads.importer` (``session_id``,
``call_index``, ``prompt_tokens``, ``output_tokens``, ``tool``, ``tool_duration_s``,
``start_s``), so one code path derives the append-only trace, checks it and handles condensed
histories. Formats (``docs/workloads.md`` §3 has the details):

* ``openai-log`` -- a generic OpenAI-style request log, JSONL with one call per line:
  ``messages`` (or ``request.messages``), the response (``response`` / ``choices``) and
  ``usage``, a session id and optional timestamps.
* ``swe-agent`` -- SWE-agent ``.traj`` files (one task each; a directory of them).
* ``openhands`` -- the session logs of our instrumented OpenHands runs
  (``mars openhands run --out DIR`` writes ``DIR/sessions/<id>.json``; per round the LLM's
  reported token usage and timings, and the tool calls with their durations).
* ``openhands-sdk`` -- conversations persisted by the OpenHands SDK itself
  (``<persistence_dir>/<conversation>/base_state.json`` + ``events/``).

Token counts come from the log's ``usage`` when it has them. Otherwise they are estimated
from the text: ``ceil(UTF-8 bytes / 4)`` per content string (OpenAI's rule of thumb of ~4
characters per token for English; code and JSON run denser, so this undercounts them by
10-30 %) plus 3 tokens per chat message and 3 to prime the reply (OpenAI's counting guide for
its chat format). SWE-agent records only totals (``model_stats.tokens_sent`` /
``tokens_received``): the per-call estimates are rescaled so that they add up to those.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from collections.abc import Iterable, Iterator
from os import PathLike
from pathlib import Path
from typing import Any

from .trace import TraceError

FORMATS = ("recording", "openai-log", "swe-agent", "openhands", "openhands-sdk")
TOKENS_PER_MESSAGE = 3
REPLY_PRIMING_TOKENS = 3
BYTES_PER_TOKEN = 4


# --------------------------------------------------------------------------- estimates
def estimate_text_tokens(text: str | None) -> int:
    """``ceil(UTF-8 bytes / 4)``: the documented estimate when a log has no usage."""
    if not text:
        return 0
    return math.ceil(len(text.encode("utf-8", "replace")) / BYTES_PER_TOKEN)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content)


def estimate_message_tokens(messages: Iterable[dict]) -> int:
    """Prompt tokens of a chat request: every message's text (tool calls as their JSON)
    plus the per-message and reply-priming overheads."""
    total = REPLY_PRIMING_TOKENS
    for m in messages:
        if not isinstance(m, dict):
            continue
        total += TOKENS_PER_MESSAGE + estimate_text_tokens(_content_text(m.get("content")))
        if m.get("tool_calls"):
            total += estimate_text_tokens(json.dumps(m["tool_calls"]))
    return total


# ------------------------------------------------------------------------------- tools
_INSTALL = re.compile(r"\b(pip3?|uv pip|poetry|conda|apt(-get)?|npm|yarn|cargo)\b.*\binstall\b")
_TEST = re.compile(r"\b(pytest|tox|nox|unittest|go test|cargo test|npm test|make test)\b")
_SEARCH = re.compile(r"^\s*(grep|rg|ag|find|ls|tree|locate|search_dir|search_file|find_file)\b")
_VIEW = re.compile(r"^\s*(cat|head|tail|less|open|goto|scroll_up|scroll_down)\b")


def classify_tool(name: str | None, command: str | None = None) -> str | None:
    """Map a logged tool call to a kind of :data:`mars.workloads.tools.TOOL_TABLE` (unknown
    names stay as they are: the replay treats them as light)."""
    if not name:
        return None
    n = name.lower()
    cmd = (command or "").strip()
    if n in ("str_replace_editor", "file_editor", "editor", "edit_file", "str_replace"):
        first = cmd.split()[0] if cmd else ""
        return "file_editor.view" if first in ("view", "") else "file_editor.edit"
    if n in ("task_tracker",):
        return "task_tracker"
    if n in ("bash", "execute_bash", "terminal", "shell", "run", "cmd", "cmd_run"):
        if _INSTALL.search(cmd):
            return "terminal.install"
        if _TEST.search(cmd):
            return "terminal.test"
        if _SEARCH.search(cmd):
            return "terminal.search"
        return "terminal.run"
    return name  # already a kind (file_editor.view, ...) or unknown (light in the replay)


def classify_swe_agent_action(action: str) -> str:
    """SWE-agent actions are command lines (``str_replace_editor view /x``, ``find_file y``,
    ``python repro.py``)."""
    a = (action or "").strip()
    first = a.split()[0] if a else ""
    if first in ("str_replace_editor", "edit", "create", "insert"):
        rest = a[len(first):].strip()
        return classify_tool("str_replace_editor", rest if first == "str_replace_editor" else
                             "edit")  # type: ignore[return-value]
    if first in ("submit", "exit", "exit_forfeit", ""):
        return "unknown"
    if _VIEW.search(a):
        return "file_editor.view"
    return classify_tool("bash", a)  # type: ignore[return-value]


# ------------------------------------------------------------------------ openai log
def _num(d: dict, *keys: str) -> float | None:
    for k in keys:
        v = d.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def openai_log_records(lines: Iterable[tuple[int, Any]], source: str) -> Iterator[tuple[int, dict]]:
    """Records from an OpenAI-style request log. Per line: a session id (``session_id``,
    ``metadata.session_id`` / ``job_id``, or ``user``); ``messages`` or
    ``request.messages``; the response as ``response`` (a chat completion) or top-level
    ``choices``; ``usage`` (top level or in the response); timestamps ``start_s`` /
    ``timestamp`` / ``created`` and ``end_s`` (or ``latency_s``). The tool after a call is
    the first tool call of its response; its duration is the gap from this call's end to the
    session's next call (when both are logged)."""
    parsed: list[tuple[int, dict]] = []
    for line, d in lines:
        if not isinstance(d, dict):
            raise TraceError(f"{source}:{line}: a log entry must be a JSON object")
        try:
            parsed.append((line, _openai_entry(d, source, line)))
        except (AttributeError, TypeError, KeyError, IndexError) as exc:
            raise TraceError(f"{source}:{line}: malformed log entry ({type(exc).__name__}: "
                             f"{exc})") from None
    by_session: dict[str, list[tuple[int, dict]]] = {}
    for line, r in parsed:
        by_session.setdefault(r["session_id"], []).append((line, r))
    for calls in by_session.values():
        # usage and estimates do not mix within a task: the estimate runs 10-30 % low on
        # code, so a session half measured, half estimated would look like a condensed one
        if not all(r["_usage"] for _, r in calls):
            for _, r in calls:
                r["prompt_tokens"], r["output_tokens"] = r["_estimate"]
        for (line, r), nxt in zip(calls, [*calls[1:], None]):
            end, r_next = r.pop("_end"), (nxt[1] if nxt else None)
            if r_next is not None and end is not None and r_next.get("start_s") is not None:
                r["tool_duration_s"] = max(0.0, r_next["start_s"] - end)
    for line, r in parsed:
        r.pop("_usage")
        r.pop("_estimate")
        yield line, r


def _timestamp(v: Any) -> float | None:
    """A timestamp: a finite number (epoch seconds) or an ISO 8601 string; else None."""
    if isinstance(v, str):
        try:
            return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _time(d: dict, *keys: str) -> float | None:
    """The first of ``keys`` that holds a timestamp."""
    for k in keys:
        t = _timestamp(d.get(k))
        if t is not None:
            return t
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise TraceError(f"{path}: not JSON ({e})") from None


def _round_tool(calls: list[tuple[float, str, str | None]]) -> tuple[str | None, float]:
    """The tool kind and duration after one round from its tool calls ``(duration, name,
    command)``: they run one after another, so durations add up; the longest names the kind."""
    if not calls:
        return None, 0.0
    _, name, command = max(calls, key=lambda c: c[0])
    return classify_tool(name, command), sum(d for d, _, _ in calls)


def _openai_entry(d: dict, source: str, line: int) -> dict:
    """One log line as a call record (helper fields ``_end``, ``_usage``, ``_estimate``)."""
    req = d.get("request") if isinstance(d.get("request"), dict) else d
    messages = req.get("messages")
    if not isinstance(messages, list):
        raise TraceError(f"{source}:{line}: no 'messages' list (or request.messages)")
    meta = d.get("metadata") if isinstance(d.get("metadata"), dict) else {}
    sid = d.get("session_id") or meta.get("session_id") or meta.get("job_id") or d.get("user")
    if not isinstance(sid, (str, int)) or isinstance(sid, bool) or sid == "":
        raise TraceError(f"{source}:{line}: no session id (session_id, metadata.session_id,"
                         " metadata.job_id or user)")
    resp = d.get("response") if isinstance(d.get("response"), dict) else d
    usage = resp.get("usage") if isinstance(resp.get("usage"), dict) else \
        (d.get("usage") if isinstance(d.get("usage"), dict) else {})
    choice = (resp.get("choices") or [{}])[0] if isinstance(resp.get("choices"), list) else {}
    msg = choice.get("message") or {}
    tool_calls = msg.get("tool_calls") or []
    fn = tool_calls[0].get("function", {}) if tool_calls and isinstance(tool_calls[0], dict) \
        else {}
    command = None
    if fn.get("arguments"):
        try:
            args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) \
                else fn["arguments"]
            command = args.get("command") or args.get("cmd") if isinstance(args, dict) else None
        except ValueError:
            command = None
    estimate = (max(1, estimate_message_tokens(messages)),
                max(1, estimate_text_tokens(_content_text(msg.get("content")))
                    + (estimate_text_tokens(json.dumps(tool_calls)) if tool_calls else 0)))
    prompt = usage.get("prompt_tokens")
    output = usage.get("completion_tokens")
    has_usage = all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                    for x in (prompt, output))
    if not has_usage:
        prompt, output = estimate
    start = _time(d, "start_s", "timestamp", "created")
    end = _time(d, "end_s")
    if end is None and start is not None and _num(d, "latency_s") is not None:
        end = start + _num(d, "latency_s")  # type: ignore[operator]
    return {"session_id": str(sid), "prompt_tokens": prompt, "output_tokens": output,
            "tool": classify_tool(fn.get("name"), command if isinstance(command, str)
                                  else None),
            "start_s": start, "_end": end, "_usage": has_usage, "_estimate": estimate}


# --------------------------------------------------------------------------- SWE-agent
def swe_agent_records(path: Path) -> list[tuple[int, dict]]:
    """Records from one SWE-agent ``.traj`` file: one call per trajectory step. A step's
    prompt is its ``query`` (the messages sent; SWE-agent >= 1.0), its output the
    ``response``; the tool is the step's ``action``, run for ``execution_time`` seconds.
    Without ``query`` the prompt is derived append-only from the previous step."""
    doc = _read_json(path)
    steps = doc.get("trajectory") if isinstance(doc, dict) else None
    if not isinstance(steps, list) or not steps:
        raise TraceError(f"{path}: not a SWE-agent trajectory (no 'trajectory' list)")
    sid = path.stem
    history = doc.get("history") if isinstance(doc.get("history"), list) else []
    first_prompt = estimate_message_tokens(
        [m for m in history[:2] if isinstance(m, dict)]) if history else 1
    prompts, outputs, obs = [], [], []
    for k, st in enumerate(steps):
        if not isinstance(st, dict):
            raise TraceError(f"{path}: trajectory[{k}] is not an object")
        out = max(1, estimate_text_tokens(st.get("response") or st.get("thought") or ""))
        if isinstance(st.get("query"), list) and st["query"]:
            p = estimate_message_tokens(st["query"])
        elif k == 0:
            p = max(1, first_prompt)
        else:
            p = prompts[-1] + outputs[-1] + obs[-1] + TOKENS_PER_MESSAGE * 2
        prompts.append(p)
        outputs.append(out)
        obs.append(estimate_text_tokens(st.get("observation") or ""))
    stats = ((doc.get("info") or {}).get("model_stats") or {}) if isinstance(doc, dict) else {}
    sent, received = stats.get("tokens_sent"), stats.get("tokens_received")
    if isinstance(sent, int) and sent > 0:  # calibrate the estimates to the recorded totals
        f = sent / sum(prompts)
        prompts = [max(1, round(p * f)) for p in prompts]
    if isinstance(received, int) and received > 0:
        f = received / sum(outputs)
        outputs = [max(1, round(o * f)) for o in outputs]
    # prompts and outputs are rescaled by different factors, which can make a prompt shorter
    # than the previous prompt + output: keep the history append-only (the totals then come
    # out a little above the recorded ones)
    for k in range(1, len(prompts)):
        prompts[k] = max(prompts[k], prompts[k - 1] + outputs[k - 1])
    recs = []
    for k, (st, p, o) in enumerate(zip(steps, prompts, outputs)):
        dur = st.get("execution_time")
        recs.append((k + 1, {"session_id": sid, "call_index": k, "prompt_tokens": p,
                             "output_tokens": o,
                             "tool": classify_swe_agent_action(str(st.get("action") or "")),
                             "tool_duration_s": float(dur) if isinstance(dur, (int, float))
                             and not isinstance(dur, bool) and dur >= 0 else 0.0}))
    return recs


# ---------------------------------------------------------------------------- OpenHands
def openhands_records(path: Path) -> list[tuple[int, dict]]:
    """Records from one session log of our instrumented OpenHands runs
    (``sessions/<id>.json``: ``llm_calls`` with the LLM's reported ``prompt_tokens`` /
    ``completion_tokens`` and timestamps, ``tool_calls`` with their round and duration).
    Several tool calls after one round run one after another: their durations add up and the
    longest names the round's tool kind."""
    doc = _read_json(path)
    calls = doc.get("llm_calls") if isinstance(doc, dict) else None
    if not isinstance(calls, list):
        raise TraceError(f"{path}: not an OpenHands session log (no 'llm_calls')")
    sid = str((doc.get("result") or {}).get("session_id") or path.stem)
    tools: dict[int, list[dict]] = {}
    for t in doc.get("tool_calls") or []:
        if isinstance(t, dict) and isinstance(t.get("round"), int):
            tools.setdefault(t["round"], []).append(t)
    recs = []
    ok = [c for c in calls if isinstance(c, dict) and c.get("status") in ("ok", "done", None)
          and isinstance(c.get("round"), int)]
    for k, c in enumerate(sorted(ok, key=lambda c: c["round"])):
        if not isinstance(c.get("prompt_tokens"), int) or not isinstance(
                c.get("completion_tokens"), int):
            raise TraceError(f"{path}: llm_calls round {c['round']} has no token usage")
        kind, dur = _round_tool([
            (float(t.get("duration_s") or 0.0), str(t.get("tool")),
             _command(t.get("args"))) for t in tools.get(c["round"], [])])
        recs.append((k + 1, {"session_id": sid, "call_index": k,
                             "prompt_tokens": max(1, c["prompt_tokens"]),
                             "output_tokens": max(1, c["completion_tokens"]),
                             "tool": kind, "tool_duration_s": dur,
                             "start_s": c.get("submit_ts")}))
    if not recs:
        raise TraceError(f"{path}: no completed LLM calls")
    return recs


# ------------------------------------------------------------------- OpenHands SDK store
def _command(d: Any) -> str | None:
    cmd = d.get("command") if isinstance(d, dict) else None
    return cmd if isinstance(cmd, str) else None


def openhands_sdk_records(conv: Path) -> list[tuple[int, dict]]:
    """Records from one conversation persisted by the OpenHands SDK (1.x): the directory
    holding ``base_state.json`` and ``events/event-NNNNN-<id>.json``.

    The agent LLM's calls are the ``token_usages`` of the ``agent`` usage in
    ``base_state.json`` (``stats.usage_to_metrics``; other usages, e.g. a condenser's LLM,
    are not agent rounds), in order, with their reported prompt and completion tokens. The
    tools after call k are the ``ActionEvent`` s whose ``llm_response_id`` is that usage's
    ``response_id``; each runs from its timestamp to its ``ObservationEvent``'s (one after
    another: durations add up, the longest names the kind). The session arrives at its first
    event."""
    base = _read_json(conv / "base_state.json")
    metrics = ((base.get("stats") or {}).get("usage_to_metrics") or {}) \
        if isinstance(base, dict) else {}
    if not isinstance(metrics, dict) or not metrics:
        raise TraceError(f"{conv}/base_state.json: no stats.usage_to_metrics (token usage)")
    chosen = [metrics["agent"]] if "agent" in metrics else list(metrics.values())
    usages = [u for m in chosen if isinstance(m, dict)
              for u in (m.get("token_usages") or []) if isinstance(u, dict)]
    events = [e for e in (_read_json(p) for p in sorted((conv / "events").glob("event-*.json")))
              if isinstance(e, dict)]
    obs_at = {e.get("action_id"): _timestamp(e.get("timestamp")) for e in events
              if e.get("kind") == "ObservationEvent"}
    acts: dict[Any, list[dict]] = {}
    for e in events:
        if e.get("kind") == "ActionEvent":
            acts.setdefault(e.get("llm_response_id"), []).append(e)
    times = [t for t in (_timestamp(e.get("timestamp")) for e in events) if t is not None]
    sid = str(base.get("id") or conv.name)
    recs = []
    for k, u in enumerate(usages):
        p, o = u.get("prompt_tokens"), u.get("completion_tokens")
        if not (isinstance(p, int) and isinstance(o, int)):
            raise TraceError(f"{conv}: token_usages[{k}] has no prompt/completion tokens")
        runs = []
        for a in acts.get(u.get("response_id"), []):
            t0, t1 = _timestamp(a.get("timestamp")), obs_at.get(a.get("id"))
            runs.append((max(0.0, t1 - t0) if t0 is not None and t1 is not None else 0.0,
                         str(a.get("tool_name")), _command(a.get("action"))))
        kind, dur = _round_tool(runs)
        recs.append((k + 1, {"session_id": sid, "call_index": k, "prompt_tokens": max(1, p),
                             "output_tokens": max(1, o), "tool": kind,
                             "tool_duration_s": dur,
                             "start_s": min(times) if k == 0 and times else None}))
    if not recs:
        raise TraceError(f"{conv}: no agent LLM calls in base_state.json")
    return recs


# ------------------------------------------------------------------------- dispatch
def detect_format(path: Path) -> str:
    """``swe-agent`` for ``.traj`` files (or a directory of them), ``openhands`` for a run
    directory with ``sessions/`` or a JSON with ``llm_calls``, ``openai-log`` for JSONL whose
    first entry has ``messages`` / ``request``, else ``recording``."""
    if path.is_dir():
        if any(path.glob("*.traj")) or any(path.glob("*/*.traj")):
            return "swe-agent"
        if (path / "base_state.json").exists() or any(path.glob("*/base_state.json")):
            return "openhands-sdk"
        return "openhands"
    if path.suffix == ".traj":
        return "swe-agent"
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    if path.suffix == ".json" and '"llm_calls"' in head:
        return "openhands"
    first = head.lstrip().split("\n", 1)[0]
    try:
        d = json.loads(first)
    except ValueError:
        return "recording"
    if isinstance(d, dict) and ("messages" in d or "request" in d):
        return "openai-log"
    return "recording"


def read_recording(path: str | PathLike[str]) -> list[tuple[int, dict]]:
    """``(line number, record)`` for every non-blank line of a recording file (the
    ``recording`` format; also the line reader of ``openai-log``)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{n}: invalid JSON: {e.msg} (column {e.colno})") from None
    return out


def records_from(path: str | PathLike[str], fmt: str) -> tuple[list[tuple[int, Any]], str]:
    """``(records, source label)`` of ``path`` in format ``fmt`` (see :data:`FORMATS`)."""
    p = Path(path)
    if fmt == "auto":
        fmt = detect_format(p)
    if fmt == "recording":
        return read_recording(p), str(p)
    if fmt == "openai-log":
        return list(openai_log_records(read_recording(p), str(p))), str(p)
    if fmt == "swe-agent":
        files = sorted(p.glob("*.traj")) + sorted(p.glob("*/*.traj")) if p.is_dir() else [p]
        if not files:
            raise TraceError(f"{p}: no .traj files")
        return [r for f in files for r in swe_agent_records(f)], str(p)
    if fmt == "openhands":
        if p.is_dir():
            d = p / "sessions" if (p / "sessions").is_dir() else p
            files = sorted(d.glob("*.json"))
            if not files:
                raise TraceError(f"{p}: no session logs (expected sessions/<id>.json)")
        else:
            files = [p]
        return [r for f in files for r in openhands_records(f)], str(p)
    if fmt == "openhands-sdk":
        convs = [p] if (p / "base_state.json").exists() else \
            sorted(c.parent for c in p.glob("*/base_state.json"))
        if not convs:
            raise TraceError(f"{p}: no OpenHands conversation (base_state.json + events/)")
        return [r for c in convs for r in openhands_sdk_records(c)], str(p)
    raise ValueError(f"unknown format {fmt!r}; known: auto, {', '.join(FORMATS)}")
