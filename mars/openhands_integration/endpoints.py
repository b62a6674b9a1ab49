"""URLs of a mars server as the agents use them (no SDK import)."""

from __future__ import annotations

import httpx

from .sink import EVENTS_PATH, events_url  # noqa: F401  (re-exported)


def openai_base(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1`` (idempotent)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def discover_model(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model id the server lists at ``GET /v1/models``."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(openai_base(url) + "/models", headers=headers, timeout=timeout_s)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{url} lists no models")
    return str(data[0]["id"])
