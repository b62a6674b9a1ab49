"""The unified information stream's schema (paper §4.1, Table 1).

One schema for every producer and consumer: the scheduler inside vLLM's EngineCore emits
GPU-plane events, the instrumented OpenHands tools post CPU-plane events, the sidecar emits
control-plane events and merges all three. Keeping the schema here, in the framework-free
layer, is what lets the engine, the sidecar and the agent environment (a different Python)
agree on it without importing each other.

Producers on hot paths (the engine step) build plain dicts with :func:`make_event`, which
costs a dict literal; consumers that accept outside input validate with :func:`parse_event`
(pydantic), so a malformed event is rejected with a message and never crashes anything.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from mars.protocol.session import MAX_ROUND

SCHEMA_VERSION = 1

# Ranges of what enters the control state from outside. Each bound is far beyond any real
# value and exists so that a hostile one cannot overflow a float, never age out, or break the
# state's JSON: a 400-digit ``tool_num.active`` raised OverflowError in every control step, a
# ``ts`` of 1e300 kept a fake tool call open for ever.
#: Unix seconds (year 5138); virtual clocks start at 0
MAX_TS = 1e11
#: a tool call or a request of 30 days
MAX_DURATION_S = 30 * 86400.0
MAX_ACTIVE_TOOLS = 10**6
#: session ids, tool names, call ids (a job id is at most 256 characters: mars.protocol.session)
MAX_NAME_LEN = 256


#: a name from outside: 1..256 characters (pydantic refuses lone surrogates in any string)
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN)]
#: a tool call's id: the producer's (an OpenHands tool-call id, may be empty; the replay's
#: ``<job id>.r<round>``, a little longer than a job id)
CallId = Annotated[str, Field(max_length=2 * MAX_NAME_LEN)]
Round = Annotated[int, Field(ge=0, le=MAX_ROUND)]
Duration = Annotated[float, Field(ge=0, le=MAX_DURATION_S)]

#: GPU plane: emitted by the scheduler inside the EngineCore process.
ENGINE_KINDS = (
    "gpu_submit",
    "gpu_1st_token",
    "gpu_end",
    "preempt",
    "chunk_shrink",
    "pin",
    "unpin",
    "kv_snapshot",
    "scheduler_start",
)
#: CPU plane: posted by tool executors (or the replay harness standing in for them).
TOOL_KINDS = ("tool_enqueue", "tool_start", "tool_end", "tool_num")
#: Control plane: emitted by the sidecar.
CONTROL_KINDS = ("window_update", "session_admit", "session_end", "request_start", "request_end")


class _Base(BaseModel):
    #: every number that enters the control state must be finite: one ``Infinity`` duration
    #: used to turn the tool-duration EMA into inf, then NaN, and the state unserialisable
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    v: int = Field(default=SCHEMA_VERSION, ge=0, le=1000)
    ts: float = Field(ge=0, le=MAX_TS, description="Unix time in seconds at the producer")
    session_id: Name | None = None
    #: which of several engines behind one sidecar the event is about (its rank; set by the
    #: sidecar on that engine's events and on its control plane's); absent with one engine
    engine: int | None = Field(default=None, ge=0)


class _RequestEvent(_Base):
    request_id: str
    round: Round | None = None


class GpuSubmit(_RequestEvent):
    kind: Literal["gpu_submit"]
    prompt_tokens: int = Field(ge=0)
    projected_blocks: int = Field(ge=0, description="KV blocks the whole prompt will need")
    level: int | None = None


class GpuFirstToken(_RequestEvent):
    kind: Literal["gpu_1st_token"]
    launch_delay_s: float = Field(ge=0, description="arrival at the engine -> first token")
    cached_tokens: int = Field(ge=0, default=0)
    #: the call's prompt, beside its cached part: the prefix-cache hit rate over calls that
    #: were served (a call aborted before its first token has no hit to count)
    prompt_tokens: int | None = Field(ge=0, default=None)


class GpuEnd(_RequestEvent):
    kind: Literal["gpu_end"]
    freed_blocks: int = Field(ge=0)
    output_tokens: int = Field(ge=0, default=0)
    status: str = "finished"


class Preempt(_RequestEvent):
    kind: Literal["preempt"]
    blocks: int = Field(ge=0)
    level: int | None = None


class ChunkShrink(_RequestEvent):
    kind: Literal["chunk_shrink"]
    requested_tokens: int = Field(ge=0)
    granted_tokens: int = Field(ge=0)


class Pin(_Base):
    kind: Literal["pin"]
    blocks: int = Field(ge=0)
    tau_s: float = Field(ge=0)
    tool: str | None = None
    #: which of the retention policy's rules decided (e.g. Continuum-Dy's cold start)
    rule: str | None = None


class Unpin(_Base):
    kind: Literal["unpin"]
    blocks: int = Field(ge=0)
    reason: Literal["resumed", "expired", "pressure", "finished", "shutdown"]
    held_s: float = Field(ge=0, default=0.0)


class KvSnapshot(_Base):
    kind: Literal["kv_snapshot"]
    total_blocks: int = Field(ge=0)
    free_blocks: int = Field(ge=0)
    used_blocks: int = Field(ge=0)
    pinned_blocks: int = Field(ge=0, default=0)
    running: int = Field(ge=0, default=0)
    waiting: int = Field(ge=0, default=0)
    #: of ``waiting``, the requests whose KV is being loaded from another tier (host
    #: memory): they wait for the link, not for compute
    loading: int = Field(ge=0, default=0)
    #: the share of a decode step that grows with its batch, fitted over recent decode
    #: steps, at their mean batch (mars.policy.engine.step_stats.DecodeCost); null while
    #: unfitted (fewer than 64 decode steps, or neither the batch nor its context varied)
    batch_share: float | None = Field(ge=0, le=1, default=None)
    #: admit decisions per rule of the retention policy so far (e.g. Continuum-Dy's
    #: cold_start / dynamic); absent for rules with one rule
    retention_decisions: dict[str, int] | None = None
    #: on an emulated GPU, its pacer's running totals (mars/emulate/pacing.py: steps,
    #: modeled_s, host_cpu_s, late_steps, late_s); absent on real hardware
    emulated: dict[str, float] | None = None


class SchedulerStart(_Base):
    kind: Literal["scheduler_start"]
    scheduler_cls: str
    policy: str
    total_blocks: int = Field(ge=0)
    block_size: int = Field(ge=1)
    pid: int
    #: blocks of context the engine's host tier holds (vLLM's KV offloading); absent: none
    host_blocks: int | None = Field(ge=0, default=None)


class ToolEnqueue(_Base):
    kind: Literal["tool_enqueue"]
    session_id: Name
    tool: Name
    round: Round | None = None
    call_id: CallId | None = None


class ToolStart(_Base):
    kind: Literal["tool_start"]
    session_id: Name
    tool: Name
    round: Round | None = None
    call_id: CallId | None = None
    #: False for a tool that waits (network, sleep) rather than computes: it occupies no core
    #: and is not counted as CPU load
    cpu_bound: bool = True


class ToolEnd(_Base):
    kind: Literal["tool_end"]
    session_id: Name
    tool: Name
    duration_s: Duration
    status: Literal["ok", "error", "timeout", "interrupted"] = "ok"
    round: Round | None = None
    call_id: CallId | None = None


class ToolNum(_Base):
    kind: Literal["tool_num"]
    active: int = Field(ge=0, le=MAX_ACTIVE_TOOLS)


class WindowUpdate(_Base):
    kind: Literal["window_update"]
    window: float = Field(ge=0)
    cpu_cap: float = Field(ge=0)
    kv_cap: float = Field(ge=0)
    budget: int = Field(ge=0)
    admitted: int = Field(ge=0)
    queued: int = Field(ge=0)
    mode: str
    reason: str


class SessionAdmit(_Base):
    kind: Literal["session_admit"]
    session_id: str
    queued_s: float = Field(ge=0)
    est_blocks: int = Field(ge=0)


class SessionEnd(_Base):
    kind: Literal["session_end"]
    session_id: Name
    #: "moved" / "switched" / "requeued": the session left this engine for another of the
    #: sidecar's engines (its own was down / a per-call placement sent it away / it was
    #: still queued, and another engine could admit it now); the event carries ``engine``,
    #: and the session goes on there
    reason: Literal["last_round", "deleted", "idle", "one_shot", "disconnect", "error", "moved",
                    "switched", "requeued"]


class RequestStart(_Base):
    kind: Literal["request_start"]
    request_id: str
    round: int | None = None
    prompt_tokens: int | None = None


class RequestEnd(_Base):
    kind: Literal["request_end"]
    request_id: str
    status: int
    duration_s: Duration


Event = Annotated[
    Union[
        GpuSubmit, GpuFirstToken, GpuEnd, Preempt, ChunkShrink, Pin, Unpin, KvSnapshot,
        SchedulerStart, ToolEnqueue, ToolStart, ToolEnd, ToolNum, WindowUpdate, SessionAdmit,
        SessionEnd, RequestStart, RequestEnd,
    ],
    Field(discriminator="kind"),
]
_EVENT = TypeAdapter(Event)
_EVENT_LIST = TypeAdapter(list[Event])
ALL_KINDS = ENGINE_KINDS + TOOL_KINDS + CONTROL_KINDS


class EventError(ValueError):
    """A producer sent something that is not an event of this schema."""


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc or '<event>'}: {err.get('msg')}")
    return "; ".join(parts)


def parse_event(obj: Any) -> BaseModel:
    """Validate one event (a dict); raises :class:`EventError` with a readable message."""
    try:
        return _EVENT.validate_python(obj)
    except ValidationError as exc:
        raise EventError(_explain(exc)) from None


def parse_events(objs: Any) -> list[BaseModel]:
    """Validate a batch; the whole batch is rejected if one event is malformed."""
    if not isinstance(objs, list):
        raise EventError("expected a JSON list of events")
    try:
        return _EVENT_LIST.validate_python(objs)
    except ValidationError as exc:
        raise EventError(_explain(exc)) from None


def make_event(kind: str, *, session_id: str | None = None, ts: float | None = None,
               **fields: Any) -> dict[str, Any]:
    """Build an event as a plain dict (cheap enough for the engine step).

    No validation here on purpose: producers are our own code and tests validate their
    output with :func:`parse_event`; consumers of outside input validate on receipt.
    """
    ev = {"v": SCHEMA_VERSION, "kind": kind, "ts": time.time() if ts is None else ts,
          "session_id": session_id}
    ev.update(fields)
    return ev
