"""Linux /proc readers for process trees: what the OpenHands workspace's sweep and the
server harness's renice both walk. Stdlib only (imported by both virtual environments);
every reader answers empty where /proc or a process is gone."""

from __future__ import annotations

import os


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (all threads' children)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids.extend(int(x) for x in fh.read().split())
        except OSError:
            continue
    return kids


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    seen = {pid}
    while todo:
        for c in children_of(todo.pop()):
            if c not in seen:
                seen.add(c)
                out.append(c)
                todo.append(c)
    return out


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""
