"""Confinement primitives: path checks, the sandboxed shell, the process sweep."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest
from oh_support import requires_bwrap

from mars.openhands_integration.workspace import (
    PathOutsideWorkspace,
    Workspace,
    kill_tagged,
    resolve_inside,
    resolve_mode,
    tagged_pids,
)

pytestmark = pytest.mark.timeout(60)


def test_resolve_inside(ws_base):
    ws = Workspace.create(ws_base, "t", mode="unconfined", files={"a/b.txt": "x"})
    root = ws.root
    assert resolve_inside(root, "a/b.txt") == root / "a" / "b.txt"
    assert resolve_inside(root, str(root / "new" / "file.py")) == root / "new" / "file.py"
    assert resolve_inside(root, str(root)) == root
    for bad in ("/etc/passwd", "../escape.txt", "a/../../escape", str(root) + "/../runtime/x",
                str(root) + "_sibling/x", "", "a\0b"):
        with pytest.raises(PathOutsideWorkspace):
            resolve_inside(root, bad)
    os.symlink("/etc", root / "etc_link")
    with pytest.raises(PathOutsideWorkspace):
        resolve_inside(root, "etc_link/passwd")


def test_files_outside_are_refused_at_creation(ws_base):
    with pytest.raises(PathOutsideWorkspace):
        Workspace.create(ws_base, "t", mode="unconfined", files={"../evil": "x"})


def test_mode_resolution():
    assert resolve_mode("unconfined") == "unconfined"
    assert resolve_mode("auto") in ("bwrap", "unconfined")
    with pytest.raises(ValueError):
        resolve_mode("docker")


@requires_bwrap
def test_bwrap_shell_cannot_write_outside(ws_base, tmp_path):
    ws = Workspace.create(ws_base, "t", mode="bwrap")
    outside = tmp_path / f"outside-{uuid.uuid4().hex}"
    home_outside = f"/root/mars-escape-{uuid.uuid4().hex}"
    res = ws.run(f"echo in > inside.txt; echo out > {outside}; echo out > {home_outside}; "
                 f"touch /tmp/private-{uuid.uuid4().hex}; echo $HOME; ls /tmp | wc -l; echo $$")
    assert (ws.root / "inside.txt").read_text() == "in\n"
    assert not outside.exists() and not os.path.exists(home_outside)
    lines = res.stdout.split()
    assert lines[0] == str(ws.root)
    assert int(lines[-1]) < 10  # its own PID namespace
    assert "Read-only file system" in res.stderr or "No such file" in res.stderr
    # the runtime dir (conversation state) is invisible from inside
    res = ws.run(f"ls {ws.runtime}")
    assert res.returncode != 0


def test_environment_is_scrubbed(ws_base, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    ws = Workspace.create(ws_base, "t", mode="auto")
    res = ws.run("env")
    assert "sk-should-not-leak" not in res.stdout
    assert f"HOME={ws.root}" in res.stdout


@pytest.mark.parametrize("mode", ["unconfined", pytest.param("bwrap", marks=requires_bwrap)])
def test_kill_tagged_finds_escaped_processes(ws_base, mode):
    ws = Workspace.create(ws_base, "t", mode=mode)
    marker = f"{time.time() % 1000 + 300:.4f}"
    # setsid + background: the process leaves the shell's process group and session
    proc = subprocess.Popen(ws.shell_argv(f"setsid sleep {marker} & sleep {marker}"),
                            cwd=ws.root, start_new_session=True)
    deadline = time.time() + 5
    while time.time() < deadline and len(tagged_pids(ws.token)) < 3:
        time.sleep(0.05)
    assert len(tagged_pids(ws.token)) >= 2
    n = kill_tagged(ws.token)
    assert n >= 2
    proc.wait(5)
    assert tagged_pids(ws.token) == []
    assert not _cmdline_has(f"sleep {marker}")


def _cmdline_has(needle: str) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if needle.encode() in fh.read().replace(b"\0", b" "):
                        return True
            except OSError:
                pass
    return False
