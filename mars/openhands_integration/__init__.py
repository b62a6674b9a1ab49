"""OpenHands as a mars client: instrumented tools, a session-tagged LLM, confined workspaces
and a concurrent agent runner (paper §5 "Integration with OpenHands", §6.4).

Runs in its own Python 3.12 environment (``.venv-agents``, ``scripts/setup_agents.sh``) and
talks to mars over HTTP only; nothing here imports vLLM or FastAPI. Importing this package
does not import the OpenHands SDK either: the SDK-dependent names below are loaded on first
use.

Modules (SDK-free unless marked):

- :mod:`.sink` -- :class:`EventSink`: bounded, batched, background POSTs of tool events to
  ``{sidecar}/v1/mars/events``; never blocks the agent, counts what it drops.
- :mod:`.workspace` -- :class:`Workspace`: a private directory per task, the bubblewrap (or
  loudly unconfined) shell, ``resolve_inside`` for paths, the process sweep.
- :mod:`.session` -- :class:`SessionContext`: per-session round counter, tool/LLM timings,
  event emission; a per-process registry keyed by session id.
- :mod:`.sanitize` -- argument sanitisation for logs.
- :mod:`.tasks` -- task files and the bundled offline task set (``data/tasks.jsonl``).
- :mod:`.runner` -- forkserver worker pool, arrivals, results and summary.
- :mod:`.tools` (SDK) -- ``terminal`` / ``file_editor`` / ``task_tracker`` registered under
  the stock names with instrumented, confined executors; :func:`mars_tool_specs`.
- :mod:`.llm` (SDK) -- :class:`MarsLLM` / :func:`make_llm`: ``vllm_xargs`` on every call,
  ``tool_choice="required"``, submit/first-token/done times.
- :mod:`.agent` (SDK) -- :func:`run_session`: one task, one conversation, one result.

CLI: ``python -m mars.openhands_integration {run,check,tasks}`` (``mars openhands ...``).
"""

from __future__ import annotations

from typing import Any

from .session import SessionContext, ToolLimits, get_session, register_session, unregister_session
from .sink import EventSink
from .tasks import Task, load_tasks
from .workspace import PathOutsideWorkspace, Workspace, resolve_inside

_LAZY = {
    "AgentConfig": ".agent",
    "run_session": ".agent",
    "MarsLLM": ".llm",
    "make_llm": ".llm",
    "mars_tool_specs": ".tools",
    "make_event_callback": ".tools",
    "register_mars_tools": ".tools",
    "run_tasks": ".runner",
    "summarize": ".runner",
}

__all__ = [
    "EventSink", "SessionContext", "ToolLimits", "get_session", "register_session",
    "unregister_session", "Task", "load_tasks", "PathOutsideWorkspace", "Workspace",
    "resolve_inside", *_LAZY,
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod, __name__), name)
