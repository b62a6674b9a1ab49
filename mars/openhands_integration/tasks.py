"""Agent tasks: a prompt, files to seed the workspace with, and an optional check.

Task files are JSONL (one object a line) or a JSON list; ``bundled`` names the small offline
task set shipped in ``data/tasks.jsonl``. Fields::

    {"id": "fix-add", "prompt": "...", "files": {"calc.py": "..."},
     "setup": "optional shell command run in the workspace first",
     "check": "optional shell command; exit 0 means solved", "max_rounds": 6}

No OpenHands import here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
BUNDLED = DATA_DIR / "tasks.jsonl"


@dataclass
class Task:
    id: str
    prompt: str
    files: dict[str, str] = field(default_factory=dict)
    setup: str | None = None
    check: str | None = None
    max_rounds: int | None = None
    tags: list[str] = field(default_factory=list)
    #: a reference solution (shell command) for tests of the task set itself
    solution: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Task":
        known = {k: d[k] for k in ("id", "prompt", "files", "setup", "check", "max_rounds", "tags", "solution") if k in d}
        if "id" not in known or "prompt" not in known:
            raise ValueError(f"a task needs 'id' and 'prompt': {str(d)[:200]}")
        known["id"] = str(known["id"])
        return cls(**known)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_tasks(spec: str | os.PathLike = "bundled") -> list[Task]:
    path = BUNDLED if str(spec) == "bundled" else Path(spec)
    text = path.read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        items = json.loads(stripped)
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    tasks = [Task.from_dict(d) for d in items]
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate task ids in {path}")
    return tasks
