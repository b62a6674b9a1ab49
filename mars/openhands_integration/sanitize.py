"""Argument sanitisation for tool-call logs.

Tool arguments are logged (for debugging a run) but never verbatim: file contents become
``<N chars sha256:abcdef012345>`` and anything that looks like a credential is redacted.
Events never carry arguments at all (the schema forbids extra fields); this is for logs only.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

#: argument names whose value is file content (or a large blob): length + hash only
CONTENT_KEYS = frozenset({"file_text", "old_str", "new_str", "content", "text", "patch", "data"})
#: argument names whose value is a secret whatever it looks like
SECRET_KEYS = re.compile(r"(?i)(pass(word|wd)?|secret|token|api[_-]?key|auth|credential|private[_-]?key)")
MAX_STR = 300

_REDACTIONS: list[tuple[re.Pattern[str], str]] = [
    # NAME=value / NAME: value for secret-looking names (export API_KEY=..., password: ...)
    (re.compile(r"(?i)\b([A-Z0-9_.\-]*(?:pass(?:word|wd)?|secret|token|api[_-]?key|access[_-]?key)[A-Z0-9_\-]*)"
                r"(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s;&|]+)"), r"\1\2***"),
    # --password value / --api-key value
    (re.compile(r"(?i)(--?[A-Z0-9_\-]*(?:pass(?:word|wd)?|secret|token|api[_-]?key)[A-Z0-9_\-]*)"
                r"(\s+)(\"[^\"]*\"|'[^']*'|[^\s;&|]+)"), r"\1\2***"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=\-]{8,}"), r"\1 ***"),
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"), "sk-***"),
    (re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"), r"\1***"),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), "gh*_***"),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"), "xox*-***"),
    (re.compile(r"(?i)(https?://)[^/\s:@]+:[^/\s@]+@"), r"\1***:***@"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(-----END [A-Z ]*PRIVATE KEY-----|$)", re.S),
     "<private key redacted>"),
]


def digest(value: str | bytes) -> str:
    """``<N chars sha256:12hex>``: enough to tell two contents apart, nothing more."""
    raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
    return f"<{len(value)} chars sha256:{hashlib.sha256(raw).hexdigest()[:12]}>"


def redact(text: str) -> str:
    """Redact credential-looking substrings of a free-form string (a shell command)."""
    for pat, repl in _REDACTIONS:
        text = pat.sub(repl, text)
    return text


def _clip(text: str, limit: int = MAX_STR) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"...<+{len(text) - limit} chars>"


def sanitize_args(args: Any, *, _key: str | None = None) -> Any:
    """Return a copy of tool arguments that is safe to log."""
    if isinstance(args, dict):
        return {k: sanitize_args(v, _key=str(k)) for k, v in args.items()}
    if isinstance(args, (list, tuple)):
        return [sanitize_args(v, _key=_key) for v in args]
    if isinstance(args, str):
        if _key is not None and SECRET_KEYS.search(_key):
            return "***"
        if _key in CONTENT_KEYS:
            return digest(args)
        return _clip(redact(args))
    if isinstance(args, bytes):
        return digest(args)
    return args
