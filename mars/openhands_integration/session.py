"""Per-session state shared by the session-tagged LLM and the instrumented tools.

The OpenHands tool registry is per process, so per-session values cannot live in the tool
classes: a tool spec carries only ``{"mars_session": <id>}`` (``Tool(name, params)``) and
the tool's ``create`` looks the :class:`SessionContext` up here. Several sessions may share a
process (tests do); the runner uses one process per task.

No OpenHands import here.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mars.protocol.session import SessionMeta
from mars.protocol.events import make_event

from .sink import EventSink
from .workspace import Workspace

log = logging.getLogger(__name__)

#: the tool type names the serving side sees (``tool`` in events, ``prev_tool`` in xargs)
TOOL_TYPES = ("terminal", "file_editor", "task_tracker")


@dataclass
class ToolLimits:
    """Runtime hygiene for tool calls."""

    #: terminal timeout when the agent gives none (seconds)
    default_timeout_s: float = 60.0
    #: hard ceiling on any terminal timeout the agent asks for (seconds)
    max_timeout_s: float = 300.0
    #: how long to wait for the prompt after interrupting a timed-out command
    interrupt_grace_s: float = 2.0
    #: tag event ``tool`` with a sub-kind (``file_editor.create``, ``task_tracker.plan``)
    subkinds: bool = False

    def clamp(self, requested: float | None) -> float:
        t = self.default_timeout_s if requested is None or requested <= 0 else float(requested)
        return max(0.1, min(t, self.max_timeout_s))


@dataclass
class LLMCallRecord:
    round: int
    submit_ts: float
    first_token_ts: float | None = None
    done_ts: float | None = None
    status: str = "pending"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    last_round: bool = False
    prev_tool: str | None = None
    streamed: bool = False
    attempts: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_ts is None else self.first_token_ts - self.submit_ts

    @property
    def duration_s(self) -> float | None:
        return None if self.done_ts is None else self.done_ts - self.submit_ts

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["ttft_s"] = self.ttft_s
        d["duration_s"] = self.duration_s
        return d


@dataclass
class ToolCallRecord:
    tool: str
    round: int | None
    call_id: str | None
    enqueue_ts: float
    start_ts: float | None = None
    end_ts: float | None = None
    status: str | None = None
    args: dict[str, Any] | None = None  # sanitised

    @property
    def duration_s(self) -> float:
        if self.start_ts is None or self.end_ts is None:
            return 0.0
        return self.end_ts - self.start_ts


@dataclass
class SessionContext:
    """Everything one agent session's LLM and tools share."""

    session_id: str
    workspace: Workspace
    sink: EventSink | None = None
    limits: ToolLimits = field(default_factory=ToolLimits)
    #: rounds the agent may take (LLM calls); the call numbered ``max_rounds - 1`` is last
    max_rounds: int | None = None
    #: number of the LLM round in progress or last finished (0-based); -1 before the first
    round: int = -1
    #: tool that ran most recently (sent as ``prev_tool`` with the next LLM call)
    last_tool: str | None = None
    llm_calls: list[LLMCallRecord] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    #: ActionEvent bookkeeping: id(action) -> (call_id, enqueue record)
    _pending: dict[int, ToolCallRecord] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    #: optional host-wide limit on concurrently running tools (multiprocessing semaphore)
    tool_slots: Any = None

    # ------------------------------------------------------------------ rounds
    def next_round(self) -> int:
        with self._lock:
            self.round += 1
            return self.round

    def is_last_round(self, rnd: int) -> bool:
        return self.max_rounds is not None and rnd >= self.max_rounds - 1

    def session_meta(self, rnd: int) -> SessionMeta:
        return SessionMeta(job_id=self.session_id, round=rnd, last_round=self.is_last_round(rnd),
                           prev_tool=self.last_tool)

    # ------------------------------------------------------------------ events
    def emit(self, kind: str, **fields: Any) -> None:
        if self.sink is None:
            return
        try:
            self.sink.emit(make_event(kind, session_id=self.session_id, **fields))
        except Exception:  # pragma: no cover - telemetry must never break the agent
            log.debug("event emit failed", exc_info=True)

    def tool_enqueued(self, tool: str, call_id: str | None, action_key: int | None = None,
                      args: dict[str, Any] | None = None) -> ToolCallRecord:
        rnd = self.round if self.round >= 0 else None
        rec = ToolCallRecord(tool=tool, round=rnd, call_id=call_id, enqueue_ts=time.time(), args=args)
        with self._lock:
            self.tool_calls.append(rec)
            if action_key is not None:
                self._pending[action_key] = rec
        self.emit("tool_enqueue", tool=tool, round=rnd, call_id=call_id, ts=rec.enqueue_ts)
        return rec

    def claim_enqueued(self, action_key: int, tool_base: str | None = None) -> ToolCallRecord | None:
        """The enqueue record the conversation callback made for this action, if any.

        Matched by the action object's identity; if the SDK handed the executor a copy,
        the oldest pending record of the same tool type is taken (actions run in order).
        """
        with self._lock:
            rec = self._pending.pop(action_key, None)
            if rec is None and tool_base is not None:
                for key, cand in self._pending.items():
                    if cand.tool.split(".", 1)[0] == tool_base:
                        rec = self._pending.pop(key)
                        break
            return rec

    def tool_started(self, rec: ToolCallRecord) -> None:
        rec.start_ts = time.time()
        self.emit("tool_start", tool=rec.tool, round=rec.round, call_id=rec.call_id, ts=rec.start_ts)

    def tool_ended(self, rec: ToolCallRecord, status: str) -> None:
        rec.end_ts = time.time()
        rec.status = status
        with self._lock:
            self.last_tool = rec.tool
        self.emit("tool_end", tool=rec.tool, round=rec.round, call_id=rec.call_id,
                  duration_s=max(0.0, rec.duration_s), status=status, ts=rec.end_ts)

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict[str, Any]:
        with self._lock:
            tools = [t for t in self.tool_calls if t.end_ts is not None]
            by_kind: dict[str, dict[str, float]] = {}
            for t in tools:
                k = by_kind.setdefault(t.tool, {"calls": 0, "time_s": 0.0})
                k["calls"] += 1
                k["time_s"] += t.duration_s
            llm = [c for c in self.llm_calls if c.done_ts is not None]
            ttfts = [c.ttft_s for c in llm if c.ttft_s is not None and c.streamed]
            return {
                "rounds": self.round + 1,
                "llm_calls": len(self.llm_calls),
                "llm_errors": sum(1 for c in self.llm_calls if c.status == "error"),
                "llm_time_s": sum(c.duration_s or 0.0 for c in llm),
                "ttft_mean_s": (sum(ttfts) / len(ttfts)) if ttfts else None,
                "prompt_tokens": sum(c.prompt_tokens or 0 for c in llm),
                "completion_tokens": sum(c.completion_tokens or 0 for c in llm),
                "tool_calls": len(tools),
                "tool_time_s": sum(t.duration_s for t in tools),
                "tool_wait_s": sum((t.start_ts or t.enqueue_ts) - t.enqueue_ts for t in tools),
                "tool_timeouts": sum(1 for t in tools if t.status == "timeout"),
                "tool_errors": sum(1 for t in tools if t.status == "error"),
                "tools": by_kind,
            }


_SESSIONS: dict[str, SessionContext] = {}
_REG_LOCK = threading.Lock()


def register_session(ctx: SessionContext) -> SessionContext:
    with _REG_LOCK:
        if ctx.session_id in _SESSIONS and _SESSIONS[ctx.session_id] is not ctx:
            raise ValueError(f"session {ctx.session_id!r} already registered in this process")
        _SESSIONS[ctx.session_id] = ctx
    return ctx


def get_session(session_id: str) -> SessionContext:
    with _REG_LOCK:
        try:
            return _SESSIONS[session_id]
        except KeyError:
            raise KeyError(f"no mars session {session_id!r} in this process "
                           "(register_session() before creating the conversation)") from None


def unregister_session(session_id: str) -> None:
    with _REG_LOCK:
        _SESSIONS.pop(session_id, None)
