"""A session-tagged OpenHands LLM for a mars (vLLM) server.

Every chat-completion call of :class:`MarsLLM` carries the session metadata mars schedules
by, in the request body::

    "vllm_xargs": {"job_id": <session id>, "round": <0-based LLM round>,
                   "last_round": true (only on the final allowed round),
                   "prev_tool": <tool that ran just before this round>}

and the headers ``x-mars-session-id`` / ``x-mars-round`` (next to the SDK's own
``x-litellm-session-id``, which is the conversation UUID). With tools it sends
``tool_choice="required"`` by default, so a server without ``--enable-auto-tool-choice``
still returns valid tool calls (guided decoding). Each call's submit, first-token and done
times are recorded in the session's :class:`~.session.SessionContext` (first-token needs a
streamed response: streaming is on by default and a no-op token consumer is supplied when the
agent has none, since the SDK only streams when something consumes tokens).

The injection happens at the transport call, after the SDK has assembled the final request,
which sidesteps two SDK traps: a non-empty ``litellm_extra_body`` replaces any per-call
``extra_body``, and per-call ``extra_headers`` replace the configured ones.
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Any

from .env import prepare_sdk_env

prepare_sdk_env()

from openhands.sdk.llm import LLM  # noqa: E402
from pydantic import Field, SecretStr  # noqa: E402

from .endpoints import discover_model, openai_base  # noqa: E402,F401
from .session import LLMCallRecord, get_session  # noqa: E402

log = logging.getLogger(__name__)

#: the call in flight in this thread/task: (record, vllm_xargs, headers)
_CURRENT: contextvars.ContextVar[tuple[LLMCallRecord, dict, dict] | None] = contextvars.ContextVar(
    "mars_llm_call", default=None)

#: capabilities of an unknown ``openai/<served-name>`` model: without these the SDK assumes a
#: reasoning model (sends reasoning_effort, drops temperature) and probes for other APIs
SERVED_MODEL_CAPABILITIES: dict[str, bool | str] = {
    "supports_reasoning_effort": False,
    "supports_sampling_params": True,
    "thinking_mode": "none",
    "supports_responses_api": False,
    "supports_vision": False,
    "supports_prompt_cache": False,
    "supports_prompt_cache_retention": False,
    "supports_stop_words": True,
}


def _noop_token(_chunk: Any) -> None:
    return None


def _chunk_has_output(chunk: Any) -> bool:
    try:
        for choice in chunk.choices or ():
            delta = getattr(choice, "delta", None)
            if delta is None:
                continue
            if getattr(delta, "content", None) or getattr(delta, "tool_calls", None) or getattr(
                    delta, "reasoning_content", None):
                return True
    except Exception:
        return True
    return False


class MarsLLM(LLM):
    """``LLM`` whose every call is tagged with the mars session (see module docs)."""

    mars_session: str = Field(description="mars session id (job_id); must be registered")
    mars_tool_choice: str | None = Field(
        default="required", description="tool_choice sent when tools are offered (None: omit)")
    mars_stream: bool = Field(default=True, description="stream to measure first-token time")

    # ------------------------------------------------------------------ per round
    def _begin(self, kwargs: dict[str, Any]) -> tuple[LLMCallRecord, Any]:
        ctx = get_session(self.mars_session)
        rnd = ctx.next_round()
        meta = ctx.session_meta(rnd)
        rec = LLMCallRecord(round=rnd, submit_ts=time.time(), last_round=meta.last_round,
                            prev_tool=meta.prev_tool)
        with ctx._lock:
            ctx.llm_calls.append(rec)
        headers = {"x-mars-session-id": ctx.session_id, "x-mars-round": str(rnd)}
        token = _CURRENT.set((rec, meta.to_extra_args(), headers))
        return rec, token

    def _end(self, rec: LLMCallRecord, token: Any, resp: Any = None, exc: BaseException | None = None) -> None:
        _CURRENT.reset(token)
        rec.done_ts = time.time()
        if exc is not None:
            rec.status = "error"
            rec.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            return
        rec.status = "ok"

    def completion(self, messages, tools=None, add_security_risk_prediction: bool = False,
                   on_token=None, call_context=None, **kwargs):
        if self.mars_stream:
            kwargs.setdefault("stream", True)
            if on_token is None:
                on_token = _noop_token
        rec, token = self._begin(kwargs)
        try:
            resp = super().completion(messages, tools, add_security_risk_prediction=add_security_risk_prediction,
                                      on_token=on_token, call_context=call_context, **kwargs)
        except BaseException as exc:
            self._end(rec, token, exc=exc)
            raise
        self._end(rec, token, resp)
        return resp

    async def acompletion(self, messages, tools=None, add_security_risk_prediction: bool = False,
                          on_token=None, call_context=None, **kwargs):
        if self.mars_stream:
            kwargs.setdefault("stream", True)
            if on_token is None:
                on_token = _noop_token
        rec, token = self._begin(kwargs)
        try:
            resp = await super().acompletion(messages, tools,
                                             add_security_risk_prediction=add_security_risk_prediction,
                                             on_token=on_token, call_context=call_context, **kwargs)
        except BaseException as exc:
            self._end(rec, token, exc=exc)
            raise
        self._end(rec, token, resp)
        return resp

    # ------------------------------------------------------------------ per attempt
    def _tag(self, kwargs: dict[str, Any]) -> LLMCallRecord | None:
        cur = _CURRENT.get()
        if cur is None:  # a call outside completion() (e.g. a title/condenser helper)
            return None
        rec, xargs, headers = cur
        body = dict(kwargs.get("extra_body") or {})
        body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), **xargs}
        kwargs["extra_body"] = body
        kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), **headers}
        if kwargs.get("tools") and self.mars_tool_choice and "tool_choice" not in kwargs:
            kwargs["tool_choice"] = self.mars_tool_choice
        if rec.attempts:
            rec.first_token_ts = None
        rec.attempts += 1
        rec.streamed = bool(kwargs.get("stream"))
        return rec

    @staticmethod
    def _first_token_wrapper(rec: LLMCallRecord | None, on_token):
        if rec is None or on_token is None:
            return on_token

        def wrapped(chunk):
            if rec.first_token_ts is None and _chunk_has_output(chunk):
                rec.first_token_ts = time.time()
            return on_token(chunk)

        return wrapped

    @staticmethod
    def _usage(rec: LLMCallRecord | None, resp: Any) -> None:
        if rec is None:
            return
        usage = getattr(resp, "usage", None)
        if usage is not None:
            rec.prompt_tokens = getattr(usage, "prompt_tokens", None)
            rec.completion_tokens = getattr(usage, "completion_tokens", None)

    def _transport_call(self, *, messages, enable_streaming: bool = False, on_token=None, **kwargs):
        rec = self._tag(kwargs)
        resp = super()._transport_call(messages=messages, enable_streaming=enable_streaming,
                                       on_token=self._first_token_wrapper(rec, on_token), **kwargs)
        self._usage(rec, resp)
        return resp

    async def _atransport_call(self, *, messages, enable_streaming: bool = False, on_token=None, **kwargs):
        rec = self._tag(kwargs)
        resp = await super()._atransport_call(messages=messages, enable_streaming=enable_streaming,
                                              on_token=self._first_token_wrapper(rec, on_token), **kwargs)
        self._usage(rec, resp)
        return resp


def make_llm(session_id: str, url: str, model: str, *, api_key: str = "mars",
             max_output_tokens: int | None = 256, temperature: float | None = 0.0,
             timeout_s: int = 300, num_retries: int = 2, stream: bool = True,
             tool_choice: str | None = "required", usage_id: str | None = None,
             **overrides: Any) -> MarsLLM:
    """A :class:`MarsLLM` for a served model (``model`` is the server's model id)."""
    name = model if "/" in model and model.split("/", 1)[0] in ("openai", "hosted_vllm") else f"openai/{model}"
    fields: dict[str, Any] = dict(
        model=name,
        base_url=openai_base(url),
        api_key=SecretStr(api_key),
        api_mode="chat",
        capability_overrides=dict(SERVED_MODEL_CAPABILITIES),
        native_tool_calling=True,
        temperature=temperature,
        max_output_tokens=max_output_tokens,
        timeout=timeout_s,
        num_retries=num_retries,
        retry_min_wait=1,
        retry_max_wait=4,
        retry_multiplier=1.0,
        caching_prompt=False,
        drop_params=True,
        # a served model has no price; zero costs keep LiteLLM from warning on every call
        input_cost_per_token=0.0,
        output_cost_per_token=0.0,
        usage_id=usage_id or f"mars-{session_id}",
        mars_session=session_id,
        mars_stream=stream,
        mars_tool_choice=tool_choice,
    )
    fields.update(overrides)
    return MarsLLM(**fields)
