"""What ``mars top`` shows, folded from what the sidecar says: sans-IO, so it is tested on plain
dicts and the terminal view (:mod:`mars.top.view`) only draws it.

Two inputs: the control plane's state (``GET /v1/mars/state``: window, caps, queue, the
dual-pressure signals, KV blocks) with its sessions (``GET /v1/mars/sessions``), polled;
and the unified event stream (``GET /v1/mars/events/stream``), which alone says what a
session is doing between its requests: in a tool, holding a pin (and for how much longer),
preempted. A session's row is the two joined on its id.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: the event kinds the view needs from the stream
KINDS = ("gpu_submit", "preempt", "pin", "unpin", "tool_start", "tool_end", "session_end")
#: what a session row can show, in the order the filter key cycles through them
STATES = ("running", "in tool", "pinned", "idle", "queued")
FILTERS = ("all", *STATES)
#: the columns the sort key cycles through
SORTS = ("context", "age", "state", "session")
RECENT_PREEMPTIONS = 8


@dataclass
class SessionRow:
    session_id: str
    state: str = "idle"
    inflight: int = 0
    requests: int = 0
    age_s: float = 0.0
    #: KV blocks the session's latest call needs for its whole prompt (its context, as the
    #: engine counts it; not what it holds now)
    kv_blocks: int = 0
    pin_blocks: int = 0
    #: seconds of τ left on its pin (negative: past τ, the pin awaits its next check)
    pin_left_s: float | None = None
    tool: str | None = None
    preemptions: int = 0


@dataclass
class _Stream:
    """Per-session facts only the stream carries."""

    kv_blocks: int = 0
    tool: str | None = None
    pin_blocks: int = 0
    pin_until: float | None = None
    preemptions: int = 0


@dataclass
class TopModel:
    state: dict[str, Any] = field(default_factory=dict)
    sessions: list[dict[str, Any]] = field(default_factory=list)
    sort: str = "context"
    filter: str = "all"
    events_seen: int = 0
    #: the event stream's state as the command last saw it ("live", "connecting", "lost: ...")
    stream_status: str = "connecting"
    _stream: dict[str, _Stream] = field(default_factory=dict)
    recent_preemptions: deque = field(default_factory=lambda: deque(maxlen=RECENT_PREEMPTIONS))

    # ------------------------------------------------------------------ inputs
    def poll(self, state: dict[str, Any], sessions: list[dict[str, Any]]) -> None:
        """Raises ValueError where the answers are not what a mars sidecar says."""
        if not isinstance(state, dict) or not isinstance(sessions, list) or not all(
                isinstance(s, dict) and isinstance(s.get("session_id"), str) for s in sessions):
            raise ValueError("state or sessions not in the sidecar's shape")
        self.state, self.sessions = state, sessions
        # forget stream facts of sessions the sidecar no longer knows (ended, reaped)
        known = {s["session_id"] for s in sessions}
        for sid in [s for s in self._stream if s not in known]:
            if self._stream[sid].pin_until is None:
                del self._stream[sid]

    def event(self, ev: dict[str, Any]) -> None:
        self.events_seen += 1
        kind, sid = ev.get("kind"), ev.get("session_id")
        if not isinstance(sid, str) or not sid:
            return  # one-shot calls carry no session: they have no row
        if kind == "session_end":
            self._stream.pop(sid, None)
            return
        st = self._stream.setdefault(sid, _Stream())
        if kind == "gpu_submit":
            st.kv_blocks = _int(ev.get("projected_blocks"))
        elif kind == "preempt":
            st.preemptions += 1
            self.recent_preemptions.appendleft((_num(ev.get("ts")), sid, _int(ev.get("blocks"))))
        elif kind == "pin":
            st.pin_blocks = _int(ev.get("blocks"))
            st.pin_until = _num(ev.get("ts")) + _num(ev.get("tau_s"))
        elif kind == "unpin":
            st.pin_blocks, st.pin_until = 0, None
        elif kind == "tool_start":
            st.tool = str(ev.get("tool"))
        elif kind == "tool_end":
            st.tool = None

    # ------------------------------------------------------------------ keys
    def next_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]

    def next_filter(self) -> None:
        self.filter = FILTERS[(FILTERS.index(self.filter) + 1) % len(FILTERS)]

    # ------------------------------------------------------------------ outputs
    def rows(self, now: float) -> list[SessionRow]:
        out = []
        for s in self.sessions:
            st = self._stream.get(s["session_id"], _Stream())
            # a tool that started before this view joined the stream is known only from the
            # sidecar's count of the session's running tools: its name is not
            tool = st.tool or ("?" if _int(s.get("tools")) > 0 else None)
            row = SessionRow(session_id=s["session_id"], inflight=int(s.get("inflight") or 0),
                             requests=int(s.get("requests") or 0),
                             age_s=float(s.get("age_s") or 0.0), kv_blocks=st.kv_blocks,
                             pin_blocks=st.pin_blocks, tool=tool,
                             preemptions=st.preemptions,
                             pin_left_s=None if st.pin_until is None else st.pin_until - now)
            row.state = ("queued" if s.get("state") == "queued" else
                         "running" if row.inflight else
                         "in tool" if row.tool else
                         "pinned" if row.pin_left_s is not None else "idle")
            out.append(row)
        if self.filter != "all":
            out = [r for r in out if r.state == self.filter]
        key = {"context": lambda r: (-r.kv_blocks, r.session_id),
               "age": lambda r: (-r.age_s, r.session_id),
               "state": lambda r: (STATES.index(r.state), r.session_id),
               "session": lambda r: r.session_id}[self.sort]
        return sorted(out, key=key)

    def binding(self) -> str | None:
        """Which of the window and the caps bounds the admitted sessions now."""
        return {"window": "window", "cpu": "CPU cap", "kv": "KV cap"}.get(
            self.state.get("binding"))


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0


def _int(x: Any) -> int:
    return int(_num(x))
