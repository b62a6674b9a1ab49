"""One OpenHands conversation per task, against a mars server, with the instrumented tools.

:func:`run_session` is what a worker process runs: it creates the task's private workspace,
registers the session, builds a :class:`~.llm.MarsLLM` and an ``Agent`` with the three
instrumented tools, runs the conversation for at most ``max_rounds`` LLM rounds, runs the
task's check, cleans up (no process of the session survives) and returns a plain-dict
result.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .env import prepare_sdk_env

prepare_sdk_env()

from openhands.sdk import Agent, Conversation  # noqa: E402
from openhands.sdk.conversation.state import ConversationExecutionStatus  # noqa: E402

from .llm import make_llm  # noqa: E402
from .session import SessionContext, ToolLimits, register_session, unregister_session  # noqa: E402
from .sink import EventSink  # noqa: E402
from .tasks import Task  # noqa: E402
from .tools import make_event_callback, mars_tool_specs  # noqa: E402
from .workspace import Workspace  # noqa: E402

log = logging.getLogger(__name__)


@dataclass
class AgentConfig:
    """Everything a session needs besides its task (plain data: it crosses processes)."""

    url: str
    model: str
    api_key: str = "mars"
    #: sidecar base URL for tool events; None disables posting ("" = same as ``url``)
    events_url: str | None = ""
    #: bearer key for posting tool events (a sidecar's --events-api-key); None = ``api_key``
    events_api_key: str | None = None
    max_rounds: int = 6
    max_output_tokens: int | None = 256
    temperature: float | None = 0.0
    stream: bool = True
    tool_choice: str | None = "required"
    llm_timeout_s: int = 300
    num_retries: int = 2
    confinement: str = "auto"
    network: bool = True
    default_timeout_s: float = 60.0
    max_timeout_s: float = 300.0
    subkinds: bool = False
    #: where per-task workspaces go (None: a fresh temp dir per session)
    workspace_base: str | None = None
    keep_workspaces: bool = False
    #: run directory for per-session logs/events (None: nothing written)
    out_dir: str | None = None
    check_timeout_s: float = 60.0
    #: "default" = the SDK's system prompt; anything else is used verbatim
    system_prompt: str | None = None
    tools: tuple[str, ...] = ("terminal", "file_editor", "task_tracker")
    sink_max_buffer: int = 4096
    #: post a ``session_end`` event when the conversation is over (frees the session's
    #: admission slot in the sidecar at once instead of after its idle timeout)
    end_session_event: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AgentConfig":
        d = dict(d)
        if "tools" in d:
            d["tools"] = tuple(d["tools"])
        return cls(**d)


def _status(conv: Any, error: BaseException | None) -> str:
    state = conv.state
    st = state.execution_status
    if st == ConversationExecutionStatus.FINISHED:
        return "finished"
    if st == ConversationExecutionStatus.STUCK:
        return "stuck"
    codes = []
    try:
        for ev in list(state.events)[-5:]:
            code = getattr(ev, "code", None)
            if code:
                codes.append(code)
    except Exception:
        pass
    if "MaxIterationsReached" in codes:
        return "max_rounds"
    return "error" if (error is not None or st == ConversationExecutionStatus.ERROR) else str(st.value)


def run_session(task: Task | dict, cfg: AgentConfig | dict, *, session_id: str | None = None,
                sink: EventSink | None = None, tool_slots: Any = None,
                arrival_ts: float | None = None) -> dict[str, Any]:
    """Run one task to completion (or to ``max_rounds``); never raises for agent failures."""
    task = task if isinstance(task, Task) else Task.from_dict(task)
    cfg = cfg if isinstance(cfg, AgentConfig) else AgentConfig.from_dict(cfg)
    session_id = session_id or f"{task.id}-{uuid.uuid4().hex[:8]}"
    start_ts = time.time()
    arrival_ts = start_ts if arrival_ts is None else arrival_ts
    max_rounds = task.max_rounds or cfg.max_rounds
    out_dir = Path(cfg.out_dir) if cfg.out_dir else None

    result: dict[str, Any] = {
        "task_id": task.id, "session_id": session_id, "pid": os.getpid(),
        "arrival_ts": arrival_ts, "start_ts": start_ts, "max_rounds": max_rounds,
    }
    own_sink = sink is None
    if own_sink:
        events_url = cfg.url if cfg.events_url == "" else cfg.events_url
        path = out_dir / "events" / f"{session_id}.jsonl" if out_dir else None
        key = cfg.events_api_key or cfg.api_key
        sink = EventSink(events_url, path=path, max_buffer=cfg.sink_max_buffer,
                         headers={"authorization": f"Bearer {key}"} if key else None,
                         session_headers=({"authorization": f"Bearer {cfg.api_key}"}
                                          if cfg.api_key else {}))
    ws = Workspace.create(cfg.workspace_base, session_id, mode=cfg.confinement, network=cfg.network,
                          files=task.files)
    result["confinement"] = ws.mode
    limits = ToolLimits(default_timeout_s=cfg.default_timeout_s, max_timeout_s=cfg.max_timeout_s,
                        subkinds=cfg.subkinds)
    ctx = register_session(SessionContext(session_id=session_id, workspace=ws, sink=sink, limits=limits,
                                          max_rounds=max_rounds, tool_slots=tool_slots))
    conv = None
    error: BaseException | None = None
    try:
        if task.setup:
            res = ws.run(task.setup, timeout_s=cfg.check_timeout_s)
            if res.returncode != 0:
                raise RuntimeError(f"task setup failed ({res.returncode}): {res.stderr[-300:]}")
        llm = make_llm(session_id, cfg.url, cfg.model, api_key=cfg.api_key,
                       max_output_tokens=cfg.max_output_tokens, temperature=cfg.temperature,
                       timeout_s=cfg.llm_timeout_s, num_retries=cfg.num_retries, stream=cfg.stream,
                       tool_choice=cfg.tool_choice)
        agent_kwargs: dict[str, Any] = {}
        if cfg.system_prompt and cfg.system_prompt != "default":
            agent_kwargs["system_prompt"] = cfg.system_prompt
        agent = Agent(llm=llm, tools=mars_tool_specs(session_id, cfg.tools), **agent_kwargs)
        conv = Conversation(
            agent=agent,
            workspace=str(ws.root),
            persistence_dir=str(ws.runtime / "state"),
            conversation_id=uuid.uuid4(),
            callbacks=[make_event_callback(ctx)],
            max_iteration_per_run=max_rounds,
            stuck_detection=False,
            visualizer=None,
            delete_on_close=False,
        )
        conv.send_message(task.prompt)
        result["setup_s"] = time.time() - start_ts
        try:
            conv.run()
        except Exception as exc:  # ConversationRunError and friends: the agent failed
            error = exc
            log.warning("session %s: %s: %s", session_id, type(exc).__name__, str(exc)[:300])
        result["status"] = _status(conv, error)
    except Exception as exc:
        error = exc
        result["status"] = "error"
        log.exception("session %s failed before/while running", session_id)
    finally:
        end_ts = time.time()
        if conv is not None:
            try:
                conv.close()
            except Exception:
                log.debug("conversation close failed", exc_info=True)
        check = None
        if task.check and conv is not None:
            try:
                res = ws.run(task.check, timeout_s=cfg.check_timeout_s)
                check = res.returncode == 0
            except Exception:
                check = False
        leftovers = ws.cleanup(remove=not cfg.keep_workspaces)
        summary = ctx.summary()
        if cfg.end_session_event:
            ctx.emit("session_end", reason="error" if result.get("status") == "error" else "last_round")
        unregister_session(session_id)
        if own_sink:
            sink.close(timeout_s=2.0)
        result.update({
            "end_ts": end_ts,
            "queue_s": max(0.0, start_ts - arrival_ts),
            "run_s": end_ts - start_ts,
            "completion_s": end_ts - arrival_ts,
            "check_passed": check,
            "error": None if error is None else f"{type(error).__name__}: {str(error)[:500]}",
            "leftover_processes": leftovers,
            "events": sink.stats.as_dict() if sink is not None else None,
            "workspace": str(ws.root) if cfg.keep_workspaces else None,
            **summary,
        })
        if out_dir is not None:
            _write_session_log(out_dir, session_id, ctx, result)
    return result


def _write_session_log(out_dir: Path, session_id: str, ctx: SessionContext, result: dict) -> None:
    """``sessions/<id>.json``: per-round LLM timings and sanitised tool calls."""
    try:
        d = out_dir / "sessions"
        d.mkdir(parents=True, exist_ok=True)
        doc = {
            "result": result,
            "llm_calls": [c.as_dict() for c in ctx.llm_calls],
            "tool_calls": [{**{k: v for k, v in t.__dict__.items()}, "duration_s": t.duration_s}
                           for t in ctx.tool_calls],
        }
        (d / f"{session_id}.json").write_text(json.dumps(doc, indent=1, default=str))
    except OSError:
        log.warning("could not write the session log for %s", session_id, exc_info=True)
