"""The replay's HTTP side: probe an OpenAI-compatible server, stream one completion, scrape
``/metrics``. Works against ``mars-vllm serve``, the mars sidecar, or stock ``vllm serve``.

One LLM round is one streamed ``POST /v1/completions`` with a token-id prompt. Streaming is
what lets the client measure time to first token; ``stream_options.include_usage`` brings the
server's token counts (and, when the server runs with ``--enable-prompt-tokens-details``, its
prefix-cache hit ``usage.prompt_tokens_details.cached_tokens``) in a final chunk;
``return_token_ids`` brings the generated ids, which the next round's prompt must extend.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from mars.protocol.sse import aiter_sse_lines


class ReplayError(RuntimeError):
    """A problem the user must fix (unreachable server, unsupported server, bad input);
    the CLI prints its message as one line and exits non-zero."""


class CallError(RuntimeError):
    """One LLM call failed (HTTP error, broken stream); the task it belongs to fails."""


@dataclass(frozen=True, slots=True)
class ServerInfo:
    url: str
    model: str
    #: the model's path or hub id as the server reports it (``root`` in ``/v1/models``)
    root: str | None
    max_model_len: int | None
    #: the mars sidecar's event API answered (tool events are posted, its SSE is recorded)
    sidecar: bool = False
    #: from ``/metrics`` ``vllm:cache_config_info`` when readable (block_size, ...)
    cache_config: Mapping[str, str] = field(default_factory=dict)


async def probe_server(client: httpx.AsyncClient, url: str, model: str | None = None,
                       events_headers: dict[str, str] | None = None) -> ServerInfo:
    """Ask ``/v1/models`` what is served; one clear :class:`ReplayError` if that fails."""
    try:
        r = await client.get(url + "/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise ReplayError(f"cannot reach {url}: {type(e).__name__}: {e or 'no response'}") from None
    if r.status_code == 401:
        raise ReplayError(f"{url}/v1/models answered 401: the server requires an API key "
                          "(--api-key or $MARS_API_KEY)")
    if r.status_code != 200:
        raise ReplayError(f"{url}/v1/models answered HTTP {r.status_code}: is this an "
                          "OpenAI-compatible server?")
    try:
        data = r.json()["data"]
    except (ValueError, KeyError, TypeError):
        raise ReplayError(f"{url}/v1/models did not return an OpenAI model list") from None
    if not data:
        raise ReplayError(f"{url} serves no model")
    ids = [m.get("id") for m in data]
    if model is None:
        entry = data[0]
    else:
        match = [m for m in data if m.get("id") == model]
        if not match:
            raise ReplayError(f"{url} does not serve model {model!r} (it serves {', '.join(map(str, ids))})")
        entry = match[0]
    mml = entry.get("max_model_len")
    sidecar = await probe_sidecar(client, url, events_headers)
    metrics_text = await fetch_metrics_text(client, url)
    cache_cfg = parse_cache_config(metrics_text) if metrics_text else {}
    return ServerInfo(url=url, model=str(entry["id"]), root=entry.get("root"),
                      max_model_len=int(mml) if isinstance(mml, int) else None,
                      sidecar=sidecar, cache_config=cache_cfg)


async def probe_sidecar(client: httpx.AsyncClient, url: str,
                        headers: dict[str, str] | None = None) -> bool:
    """``POST /v1/mars/events`` with an empty batch: 200 means the mars sidecar is there."""
    try:
        r = await client.post(url + "/v1/mars/events", json=[], timeout=5.0, headers=headers)
    except httpx.HTTPError:
        return False
    if r.status_code == 401:
        raise ReplayError(f"{url}/v1/mars/events answered 401: the sidecar does not accept "
                          "the events key (--events-api-key, $MARS_EVENTS_API_KEY)")
    return r.status_code == 200


# ----------------------------------------------------------------------------- one LLM call


@dataclass(slots=True)
class CallResult:
    """What the client observed for one streamed completion (monotonic clock seconds)."""

    #: the server's response id (``cmpl-<request_id>`` on vLLM)
    response_id: str | None
    submit: float
    first_token: float | None
    end: float
    token_ids: list[int]
    prompt_tokens: int | None
    completion_tokens: int | None
    #: prefix-cache hit reported in ``usage.prompt_tokens_details``; None when not reported
    cached_tokens: int | None
    finish_reason: str | None
    system_fingerprint: str | None = None


def completion_body(model: str, prompt: list[int], output_tokens: int,
                    xargs: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    """The request for one round: exact prompt ids, exactly ``output_tokens`` out, streamed."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "min_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "request_id": request_id,
        "session_id": xargs.get("job_id"),
        "vllm_xargs": dict(xargs),
    }


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            timeout_s: float) -> CallResult:
    """POST ``body`` to ``/v1/completions`` and read the SSE stream to the end.

    TTFT is stamped at the first chunk carrying generated tokens (vLLM's first chunk for a
    token-id prompt echoes the prompt ids, without generated ids when prefill is chunked).
    """
    ids: list[int] = []
    first: float | None = None
    usage: dict[str, Any] | None = None
    resp_id = fingerprint = finish = None
    saw_token_ids = False
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    submit = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                raise CallError(f"HTTP {r.status_code}: {_error_message(text)}")
            async for line in aiter_sse_lines(r.aiter_bytes()):
                if not line.startswith("data:"):
                    continue
                now = time.monotonic()  # stamped before parsing: a long prompt echo is slow
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    raise CallError(f"stream error: {_error_message(json.dumps(chunk))}")
                resp_id = resp_id or chunk.get("id")
                fingerprint = fingerprint or chunk.get("system_fingerprint")
                for choice in chunk.get("choices") or ():
                    tids = choice.get("token_ids")
                    if tids is not None:
                        saw_token_ids = True
                    if tids:
                        if first is None:
                            first = now
                        ids.extend(tids)
                    elif choice.get("text") and first is None:
                        first = now
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as e:
        raise CallError(f"{type(e).__name__}: {e or 'connection failed'}") from None
    end = time.monotonic()
    if not saw_token_ids:
        raise CallError("the server returned no token_ids: it must support `return_token_ids` "
                        "(vLLM >= 0.10.2) so that the next round can extend the real output")
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return CallResult(
        response_id=resp_id, submit=submit, first_token=first, end=end, token_ids=ids,
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        completion_tokens=(usage or {}).get("completion_tokens"),
        cached_tokens=int(cached) if isinstance(cached, int) else None,
        finish_reason=finish, system_fingerprint=fingerprint)


def _error_message(text: str) -> str:
    try:
        obj = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:300]
    return str(err)[:300]


# ---------------------------------------------------------------------------------- metrics

#: server-side counters the results compare the client's measurements with
METRIC_NAMES = (
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


async def fetch_metrics_text(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        r = await client.get(url + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def parse_metrics(text: str, names: tuple[str, ...] = METRIC_NAMES) -> dict[str, float]:
    """Sum each wanted Prometheus sample over its label sets (engines, models)."""
    out: dict[str, float] = {}
    wanted = set(names)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m and m.group(1) in wanted:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                continue
    return out


def parse_cache_config(text: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` that describe the server (block size, caching)."""
    keep = ("block_size", "enable_prefix_caching", "kv_cache_size_tokens", "cache_dtype")
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            return {k: labels[k] for k in keep if k in labels}
    return {}


def metrics_delta(before: Mapping[str, float] | None, after: Mapping[str, float] | None
                  ) -> dict[str, float] | None:
    if not before or not after:
        return None
    return {k: after[k] - before.get(k, 0.0) for k in after}
