"""What the sidecar reads from a generation request: the session it belongs to.

Session identity, first match wins:

1. ``vllm_xargs.job_id`` (the mars convention; what the scheduler keys sessions by);
2. the body's ``session_id`` (vLLM's own field, which vLLM itself prefers to the header);
3. the ``X-Session-ID`` header (vLLM's), then ``x-mars-session-id`` (our agent integration),
   then ``x-litellm-session-id`` (sent by OpenHands through LiteLLM);
4. none: the request is a one-round session of its own.

When the id came from 2 or 3 it is copied into ``vllm_xargs.job_id`` so that the engine's
scheduler and its events see the same session as the sidecar. That is the only change ever
made to a body; a body that already carries ``job_id`` is forwarded byte for byte (no
re-serialisation on the hot path).

Everything else in the body is the engine's business: unknown top-level fields and the other
``vllm_xargs`` keys are passed through and vLLM answers for them. Only what the sidecar itself
relies on is checked here (a JSON object, ``vllm_xargs`` an object, the session metadata by
the one rule set of :mod:`mars.protocol.session`), and a violation is a 400 with a message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from mars.protocol.events import Event, EventError, parse_events
from mars.protocol.session import SessionMeta, SessionMetaError, session_id_value

#: header fallbacks for the session id, in order
SESSION_HEADERS = ("x-session-id", "x-mars-session-id", "x-litellm-session-id")


class BadRequest(ValueError):
    """The request cannot be forwarded: answered with an OpenAI-style 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # keeps ``param`` when raised in the body parser's child process
        return (BadRequest, (str(self), self.param))


@dataclass(slots=True)
class GenerateRequest:
    """A parsed ``/v1/chat/completions`` or ``/v1/completions`` request: what the sidecar
    needs from it, nothing of the parsed body (it may be huge, and crosses processes)."""

    #: None: no identity anywhere, a one-round session
    session_id: str | None
    #: where the id came from: "vllm_xargs", "body", a header name, or None
    source: str | None
    round: int | None
    last_round: bool
    #: the bytes to send upstream: the original body unless job_id was injected
    body: bytes
    #: rough prompt length, for the KV-block estimate of a *new* session (:func:`prompt_size`)
    prompt_tokens: int


def prompt_size(obj: dict[str, Any], body: bytes, bytes_per_token: float) -> int:
    """Rough prompt length: token-id prompts are counted exactly; text is estimated from its
    size, a chat from the body's (chat templates add the tool schemas and the role markup,
    which the body size includes)."""
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if all(isinstance(p, list) for p in prompt):
            return sum(len(p) for p in prompt)
    if isinstance(prompt, str):
        # surrogatepass: an estimate must not fail on a lone surrogate (vLLM answers it)
        return int(len(prompt.encode("utf-8", "surrogatepass")) / bytes_per_token) + 1
    return int(len(body) / bytes_per_token) + 1


def _decode(body: bytes, error: type[ValueError], what: str) -> Any:
    """The body's JSON, or ``error`` with a message (nesting too deep is the client's error
    too: the decoder's RecursionError)."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what}: {exc}") from None
    except RecursionError:
        raise error(f"{what}: nested too deeply") from None


def _session_value(v: Any, where: str) -> str:
    try:
        return session_id_value(v, where)
    except SessionMetaError as exc:
        raise BadRequest(str(exc), param=exc.param) from None


def parse_generate(body: bytes, headers: Mapping[str, str],
                   bytes_per_token: float = 4.0) -> GenerateRequest:
    """Parse and check a generation request; raises :class:`BadRequest`.
    ``bytes_per_token``: for the estimate of a text prompt's length (SidecarConfig's)."""
    if not body:
        raise BadRequest("request body is empty: expected a JSON object")
    obj = _decode(body, BadRequest, "malformed JSON body")
    if not isinstance(obj, dict):
        raise BadRequest(f"expected a JSON object, got {type(obj).__name__}")
    xargs = obj.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise BadRequest("vllm_xargs must be a JSON object", param="vllm_xargs")

    try:
        # the one rule set for session metadata (the engine reads it leniently)
        meta = SessionMeta.parse(xargs, strict=True)
    except SessionMetaError as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    sid: str | None = meta.job_id
    source: str | None = "vllm_xargs" if sid is not None else None
    if sid is None:
        body_sid = obj.get("session_id")
        if body_sid is not None:
            sid, source = _session_value(body_sid, "session_id"), "body"
        else:
            for h in SESSION_HEADERS:
                v = headers.get(h)
                if v:
                    sid, source = _session_value(v.strip(), h), h
                    break

    rnd, last = meta.round, meta.last_round

    if sid is not None and source != "vllm_xargs":
        new_xargs = dict(xargs or {})
        new_xargs["job_id"] = sid
        obj["vllm_xargs"] = new_xargs
        try:
            body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise BadRequest(f"the body is not valid Unicode ({exc.reason} at character "
                             f"{exc.start} of a string): lone surrogates cannot be encoded")
        except RecursionError:
            raise BadRequest("malformed JSON body: nested too deeply") from None
    return GenerateRequest(sid, source, rnd, last, body, prompt_size(obj, body, bytes_per_token))


#: most events one post may carry
MAX_EVENT_BATCH = 10000
#: how far ahead of the sidecar's clock a posted ``ts`` may be (seconds). Tool runners share
#: the host or an NTP-synced clock; an event from the future would keep a tool call open (and
#: its session from idling out) past ``tool_stale_s``. Old events are harmless: they age out.
MAX_CLOCK_AHEAD_S = 60.0


def parse_event_batch(body: bytes, now: float | None = None) -> list[Event]:
    """A posted event batch (a JSON list of events, or one object), validated whole; raises
    :class:`~mars.protocol.events.EventError` with a message naming what is wrong. With
    ``now`` (the sidecar's clock), no ``ts`` may be more than :data:`MAX_CLOCK_AHEAD_S`
    ahead of it."""
    if not body:
        raise EventError("empty body: expected a JSON list of events")
    raw = _decode(body, EventError, "malformed JSON")
    if isinstance(raw, dict):
        raw = [raw]
    if isinstance(raw, list) and len(raw) > MAX_EVENT_BATCH:
        raise EventError(f"batch of {len(raw)} events exceeds {MAX_EVENT_BATCH}")
    events = parse_events(raw)
    if now is not None:
        for i, ev in enumerate(events):
            if ev.ts > now + MAX_CLOCK_AHEAD_S:
                raise EventError(f"{i}.{ev.kind}.ts: {ev.ts - now:.0f} s ahead of the "
                                 f"sidecar's clock (at most {MAX_CLOCK_AHEAD_S:.0f} s)")
    return events
