"""Who may call which sidecar endpoint: bearer keys, checked before anything else happens.

The sidecar is the public port of ``mars-vllm serve``, so it must be at least as closed as
the vLLM server it fronts, and more: its own endpoints hold every session's events and can
end any session, and a generation request takes an admission slot *before* the engine sees
it (an unauthenticated request that the engine would refuse with 401 must never occupy the
window). The check therefore runs first, on the raw ASGI scope, before a body is read or a
session is created.

Three audiences (see docs/sidecar.md, "Trust model"):

* **API clients** (``--api-key``, vLLM's flag and ``VLLM_API_KEY``): generation, the
  ``/v1/mars/*`` control endpoints, everything forwarded under vLLM's guarded prefixes,
  and ``/metrics`` unless ``--open-metrics``.
* **Tool runners** (``--events-api-key``): may only post CPU-plane events
  (``POST /v1/mars/events``); an API key is accepted there too.
* **Probes**: ``/v1/mars/health`` and the engine's liveness paths (``/health``, ``/ping``,
  ``/version``) stay open, as vLLM leaves them; they reveal no session.

Everything else is closed by default, including paths vLLM itself leaves open outside its
guarded prefixes (``/invocations`` generates text, ``/tokenize``, ``/metrics/...``): the
sidecar is the public port, and an allow-list cannot miss a route a later vLLM adds.

Keys are compared as SHA-256 digests with ``secrets.compare_digest`` over every key (no
early exit), as vLLM's own middleware does, so timing does not tell which prefix matched.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

EVENTS_PATH = "/v1/mars/events"
#: liveness probes: open with or without keys (vLLM leaves the last three open too)
OPEN_PATHS = frozenset({"/v1/mars/health", "/health", "/ping", "/version"})
METRICS_PATH = "/metrics"

#: how ``mars-vllm serve`` hands its keys to the sidecar child (newline-separated; the
#: environment, not argv, so that they do not show in ``ps``)
KEYS_ENV = "MARS_SIDECAR_API_KEYS"
EVENTS_KEYS_ENV = "MARS_EVENTS_API_KEY"


class Access(enum.Enum):
    OPEN = "open"
    API = "api"
    EVENTS = "events"


def required_access(method: str, path: str, open_metrics: bool) -> Access:
    """The audience an endpoint belongs to (pure: unit-tested without a server). Deny by
    default: only the probes (and ``/metrics`` with ``--open-metrics``) are open."""
    if method == "OPTIONS" or path in OPEN_PATHS:
        return Access.OPEN
    if path == EVENTS_PATH and method == "POST":
        return Access.EVENTS
    if open_metrics and path.rstrip("/") == METRICS_PATH:
        return Access.OPEN
    return Access.API


def _digests(keys: Iterable[str]) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(k.encode("utf-8")).digest() for k in keys if k)


@dataclass(frozen=True, slots=True)
class Authenticator:
    """Holds key digests; ``allows(method, path, authorization)`` is the whole decision."""

    api: tuple[bytes, ...] = ()
    events: tuple[bytes, ...] = ()
    open_metrics: bool = False

    @classmethod
    def from_keys(cls, api_keys: Iterable[str] = (), events_keys: Iterable[str] = (),
                  open_metrics: bool = False) -> "Authenticator":
        return cls(_digests(api_keys), _digests(events_keys), open_metrics)

    @property
    def enabled(self) -> bool:
        return bool(self.api or self.events)

    def allows(self, method: str, path: str, authorization: str | None) -> bool:
        return self.grant(method, path, authorization) is not None

    def grant(self, method: str, path: str, authorization: str | None) -> Access | None:
        """The audience the caller proved it belongs to for this request (``API`` for an API
        key, ``EVENTS`` for a tool-runner key, ``OPEN`` where no key is needed or none is
        configured), or None: refuse with 401. Endpoints use it to limit what a tool-runner
        key may do (it may post tool events, not end sessions)."""
        if not self.enabled:
            return Access.API
        need = required_access(method, path, self.open_metrics)
        if need is Access.OPEN:
            return Access.OPEN
        # with only an events key configured, the API stays as open as vLLM without --api-key
        if need is Access.API and not self.api:
            return Access.API
        token = _bearer(authorization)
        if token is None:
            return None
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        api = _matches(digest, self.api)
        if api:
            return Access.API
        if need is Access.EVENTS and _matches(digest, self.events):
            return Access.EVENTS
        return None


def _matches(digest: bytes, keys: tuple[bytes, ...]) -> bool:
    match = False
    for k in keys:  # every key, no early exit: timing does not tell which one matched
        match |= secrets.compare_digest(digest, k)
    return match


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
