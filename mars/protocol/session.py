"""Session metadata carried in ``vllm_xargs``: one rule set, used by the sidecar and the engine.

Clients tag each LLM call with ``vllm_xargs`` (vLLM hands them to the scheduler as
``SamplingParams.extra_args``): ``job_id`` (the agent session, stable across rounds),
``round``, ``last_round``, ``next_tool`` and ``prev_tool``. The rules for a valid value are
defined once, here:

* ``job_id``: a string or an integer (not a boolean), 1..256 characters of valid Unicode once
  printed (no lone surrogate: the id is echoed in JSON responses and events);
* ``round``: an integer (a float only if integral; not a boolean), 0..10^9;
* ``last_round``: a boolean, 0 / 1, or one of "true", "false", "1", "0", "yes", "no", "";
* ``next_tool`` / ``prev_tool``: strings of at most 256 characters of valid Unicode (empty
  means absent).

The sidecar parses **strictly** (:meth:`SessionMeta.parse` with ``strict=True``): a bad value is
a :class:`SessionMetaError` naming the field, which it answers with HTTP 400 before anything is
queued. The engine parses **leniently** under the same rules: metadata is advisory there (a
client may reach the engine directly with ``--no-sidecar``), so a bad value is dropped and the
request is served without it, never failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_SESSION_ID_LEN = 256
MAX_ROUND = 10**9
#: tool names key the retention policy's duration estimates and travel in events
MAX_TOOL_LEN = 256


class SessionMetaError(ValueError):
    """A session-metadata value breaks the rules; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _encodable(s: str, where: str) -> str:
    """``s``, if it can be encoded: ids and tool names are echoed in JSON responses and
    events, which a lone surrogate makes unencodable."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise SessionMetaError(f"{where} must be valid Unicode (a lone surrogate cannot be "
                               "encoded)", where) from None
    return s


def session_id_value(v: Any, where: str) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise SessionMetaError(f"{where} must be a string or an integer", where)
    s = str(v)
    if not s or len(s) > MAX_SESSION_ID_LEN:
        raise SessionMetaError(f"{where} must be 1..{MAX_SESSION_ID_LEN} characters", where)
    return _encodable(s, where)


def round_value(v: Any, where: str = "vllm_xargs.round") -> int | None:
    if v is None:
        return None
    msg = f"{where} must be an integer from 0 to {MAX_ROUND}"
    if isinstance(v, bool):
        raise SessionMetaError(msg, where)
    try:
        r = int(v)
    except (TypeError, ValueError, OverflowError):
        raise SessionMetaError(msg, where) from None
    if (isinstance(v, float) and v != r) or not 0 <= r <= MAX_ROUND:
        raise SessionMetaError(msg, where)
    return r


def flag_value(v: Any, where: str = "vllm_xargs.last_round") -> bool:
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no", ""):
        return v.strip().lower() in ("true", "1", "yes")
    raise SessionMetaError(f"{where} must be a boolean", where)


def tool_value(v: Any, where: str) -> str | None:
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise SessionMetaError(f"{where} must be a string", where)
    if len(v) > MAX_TOOL_LEN:
        raise SessionMetaError(f"{where} must be at most {MAX_TOOL_LEN} characters", where)
    return _encodable(v, where)


#: field -> its rule (built once: both the sidecar and the engine parse on every request)
_RULES = (("job_id", lambda v: session_id_value(v, "vllm_xargs.job_id")),
          ("round", round_value), ("last_round", flag_value),
          ("next_tool", lambda v: tool_value(v, "vllm_xargs.next_tool")),
          ("prev_tool", lambda v: tool_value(v, "vllm_xargs.prev_tool")))


@dataclass(slots=True)
class SessionMeta:
    """Per-call session metadata, as carried in ``vllm_xargs``.

    ``job_id`` identifies the agent session across rounds; the engine-side request id must
    never be used for that (vLLM appends a random suffix to it).
    """

    job_id: str | None = None
    round: int | None = None
    last_round: bool = False
    #: tool the agent is expected to run after this round (the replay harness knows it)
    next_tool: str | None = None
    #: tool that ran just before this round (what the OpenHands integration knows)
    prev_tool: str | None = None

    KEYS = ("job_id", "round", "last_round", "next_tool", "prev_tool")

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, fallback_session: Any = None, *,
              strict: bool = False) -> "SessionMeta":
        """Read the fields of ``extra`` (``vllm_xargs``); ``fallback_session`` stands in for a
        missing ``job_id``. Strict: raise :class:`SessionMetaError`; lenient: drop bad fields."""
        extra = extra or {}
        fields: dict[str, Any] = {}
        for name, rule in _RULES:
            v = extra.get(name)
            if v is None:
                continue
            try:
                fields[name] = rule(v)
            except SessionMetaError:
                if strict:
                    raise
        if fields.get("job_id") is None and fallback_session is not None:
            try:
                fields["job_id"] = session_id_value(fallback_session, "session_id")
            except SessionMetaError:
                if strict:
                    raise
        return cls(**fields)

    @classmethod
    def from_extra_args(cls, extra: Mapping[str, Any] | None,
                        fallback_session: Any = None) -> "SessionMeta":
        """The engine's reading: lenient (see the module docstring)."""
        return cls.parse(extra, fallback_session, strict=False)

    def to_extra_args(self) -> dict:
        out: dict = {}
        if self.job_id is not None:
            out["job_id"] = self.job_id
        if self.round is not None:
            out["round"] = self.round
        if self.last_round:
            out["last_round"] = True
        if self.next_tool:
            out["next_tool"] = self.next_tool
        if self.prev_tool:
            out["prev_tool"] = self.prev_tool
        return out
