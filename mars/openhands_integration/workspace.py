"""Per-task confinement: a private workspace, path checks, and a sandboxed shell.

Modes (``Workspace.mode``):

``bwrap``
    The terminal's shell runs under bubblewrap: the host file system is mounted read-only,
    the workspace read-write, ``/tmp`` is a private tmpfs, ``/proc`` and the PID namespace
    are the sandbox's own (``--unshare-pid``), IPC and UTS are unshared, and the shell gets a
    session of its own (``--new-session``, which also blocks TIOCSTI). Optionally the network
    is unshared too. ``--die-with-parent`` is deliberately not used: the SDK creates
    executors in a short-lived thread, and the parent-death signal is tied to that thread.
``unconfined``
    bubblewrap is missing (or cannot create namespaces here). The shell is a plain host
    process that starts in the workspace with a scrubbed environment; nothing stops a
    command from writing elsewhere. A loud warning is logged and the mode is recorded in
    every result, so a run in this mode is never mistaken for a confined one.

In both modes every process the shell starts carries ``MARS_SANDBOX_TOKEN=<random>`` in its
environment; :func:`kill_tagged` finds them through ``/proc`` and kills leftovers after a
timeout and at session end, including processes that escaped the shell's process group with
``setsid``/double forks (a process that scrubs its own environment escapes this sweep in the
unconfined mode; under bwrap the PID namespace catches it when the sandbox's init dies).

The file editor is confined separately in both modes (:func:`resolve_inside`).

No OpenHands import here.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

TOKEN_ENV = "MARS_SANDBOX_TOKEN"
TOKEN_FILE = "sandbox.token"
MODES = ("auto", "bwrap", "unconfined")
_BWRAP_OK: dict[str, bool] = {}
_WARNED = False


class ConfinementError(RuntimeError):
    """The requested confinement mode is not available here."""


class PathOutsideWorkspace(ValueError):
    """A tool argument names a path outside the task's workspace."""


# --------------------------------------------------------------------------- bwrap probing
def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def bwrap_works(bwrap: str | None = None) -> bool:
    """True when bubblewrap is installed and can create the namespaces we use (cached)."""
    bwrap = bwrap or bwrap_path()
    if not bwrap:
        return False
    if bwrap in _BWRAP_OK:
        return _BWRAP_OK[bwrap]
    try:
        res = subprocess.run(
            [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
             "--unshare-pid", "--unshare-ipc", "--new-session", "--", "/bin/sh", "-c", "echo ok"],
            capture_output=True, text=True, timeout=10,
        )
        ok = res.returncode == 0 and res.stdout.strip() == "ok"
        if not ok:
            log.warning("bubblewrap is installed but does not work here: %s", res.stderr.strip()[:300])
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("bubblewrap probe failed: %s", exc)
        ok = False
    _BWRAP_OK[bwrap] = ok
    return ok


def resolve_mode(mode: str = "auto") -> str:
    """``auto`` -> ``bwrap`` when it works, else ``unconfined`` (with a loud warning)."""
    global _WARNED
    if mode not in MODES:
        raise ValueError(f"confinement mode must be one of {MODES}, not {mode!r}")
    if mode == "unconfined":
        return mode
    if bwrap_works():
        return "bwrap"
    if mode == "bwrap":
        raise ConfinementError(
            "confinement mode 'bwrap' requested but bubblewrap is missing or cannot create "
            "namespaces here (install it: apt-get install -y bubblewrap)")
    if not _WARNED:
        _WARNED = True
        log.warning(
            "\n" + "!" * 78 + "\n"
            "!! MARS OPENHANDS: bubblewrap is NOT available; agent terminals run UNCONFINED as\n"
            "!! host processes. Only the file editor is confined to the workspace; a shell\n"
            "!! command can read and write anything this user can. Install bubblewrap\n"
            "!! (scripts/setup_agents.sh does) or pass --confinement bwrap to refuse to run.\n"
            + "!" * 78)
    return "unconfined"


# --------------------------------------------------------------------------- paths
def resolve_inside(root: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Resolve ``path`` (absolute, or relative to ``root``) and require it inside ``root``.

    Symlinks are resolved first, so a link inside the workspace that points out of it is
    rejected too. Raises :class:`PathOutsideWorkspace`.
    """
    root_real = Path(os.path.realpath(root))
    raw = os.fspath(path)
    if not raw or "\x00" in raw:
        raise PathOutsideWorkspace(f"invalid path {raw!r}")
    p = Path(os.path.expanduser(raw)) if raw.startswith("~") else Path(raw)
    if not p.is_absolute():
        p = root_real / p
    real = Path(os.path.realpath(p))
    if real != root_real and not real.is_relative_to(root_real):
        raise PathOutsideWorkspace(
            f"path {raw!r} resolves to {real}, which is outside the task workspace {root_real}")
    return real


# --------------------------------------------------------------------------- workspace
@dataclass
class Workspace:
    """One task's private directories.

    ``root`` is the agent's working directory (the only place it may write); ``runtime`` is
    a private directory next to it for conversation state, logs and the shell wrapper,
    which the sandboxed shell cannot see.
    """

    root: Path
    runtime: Path
    mode: str
    token: str = field(default_factory=lambda: secrets.token_hex(12))
    network: bool = True
    owned_base: Path | None = None

    @classmethod
    def create(cls, base: str | os.PathLike | None = None, name: str = "task", *,
               mode: str = "auto", network: bool = True,
               files: dict[str, str] | None = None) -> "Workspace":
        mode = resolve_mode(mode)
        owned = None
        if base is None:
            base = tempfile.mkdtemp(prefix="mars-oh-")
            owned = Path(base)
        base = Path(base)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "task"
        top = base / safe
        root = top / "work"
        runtime = top / "runtime"
        root.mkdir(parents=True, exist_ok=True)
        runtime.mkdir(parents=True, exist_ok=True)
        os.chmod(top, 0o700)
        ws = cls(root=Path(os.path.realpath(root)), runtime=Path(os.path.realpath(runtime)),
                 mode=mode, network=network, owned_base=owned)
        # lets whoever owns the base directory sweep this session's processes even if the
        # worker that created it died (see sweep_base)
        (ws.runtime / TOKEN_FILE).write_text(ws.token)
        for rel, content in (files or {}).items():
            dest = resolve_inside(ws.root, rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(content)
        return ws

    # ------------------------------------------------------------------ shell
    def shell_env(self) -> dict[str, str]:
        """The whole environment the agent's shell gets (nothing else leaks in)."""
        path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        # the agents' own venv must not be the shell's python
        venv = os.environ.get("VIRTUAL_ENV")
        if venv:
            path = os.pathsep.join(p for p in path.split(os.pathsep) if not p.startswith(venv))
        return {
            "PATH": path,
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp" if self.mode == "bwrap" else str(self.runtime / "tmp"),
            "USER": os.environ.get("USER", "agent"),
            "PYTHONDONTWRITEBYTECODE": "1",
            "GIT_PAGER": "cat",
            "PAGER": "cat",
            TOKEN_ENV: self.token,
        }

    def sandbox_prefix(self) -> list[str]:
        """The ``bwrap ... --`` prefix (empty in the unconfined mode)."""
        if self.mode != "bwrap":
            return []
        bw = bwrap_path()
        if not bw:
            raise ConfinementError("bwrap vanished")
        argv = [bw, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        # hide every task's directories (other sessions' workspaces, this session's runtime
        # state) before binding this task's workspace back in, writable
        base = self.root.parent.parent
        if not base.is_relative_to("/tmp") and base != Path("/"):
            argv += ["--tmpfs", str(base)]
        argv += ["--bind", str(self.root), str(self.root),
                 "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "mars-sandbox",
                 "--new-session", "--chdir", str(self.root)]
        if not self.network:
            argv.append("--unshare-net")
        return argv + ["--"]

    def shell_argv(self, command: str | None = None, shell: str = "/bin/bash") -> list[str]:
        """argv of the confined shell: interactive (``-i``) or running one ``command``."""
        env = [f"{k}={v}" for k, v in self.shell_env().items()]
        inner = [shell, "--noprofile", "--norc"] + (["-c", command] if command is not None else ["--noediting", "-i"])
        if self.mode != "bwrap":
            (self.runtime / "tmp").mkdir(exist_ok=True)
        return ["/usr/bin/env", "-i", *env, *self.sandbox_prefix(), *inner]

    def write_shell_wrapper(self) -> Path:
        """A script the SDK's subprocess terminal runs as its ``shell_path``.

        The SDK runs ``[nice -n 10] <shell_path> -i`` with ``PS1``/``PS2``/``TERM`` in the
        environment; the wrapper drops everything else from the environment and execs the
        confined shell (the SDK's ``-i`` is ignored: the wrapper always passes it).
        """
        argv = self.shell_argv()
        keep = 'PS1="$PS1" PS2="$PS2" TERM="${TERM:-xterm-256color}"'
        cmd = "/usr/bin/env -i " + keep + " " + " ".join(shlex.quote(a) for a in argv[2:])
        script = self.runtime / "shell.sh"
        script.write_text(
            "#!/bin/sh\n"
            f"# mars: {self.mode} shell for workspace {self.root}\n"
            f"cd {shlex.quote(str(self.root))} || exit 1\n"
            f"exec {cmd}\n")
        os.chmod(script, 0o700)
        return script

    def run(self, command: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run one non-interactive command in the same confinement (task set-up and checks)."""
        try:
            return subprocess.run(self.shell_argv(command), cwd=self.root, capture_output=True,
                                  text=True, timeout=timeout_s, start_new_session=True)
        finally:
            kill_tagged(self.token)

    def cleanup(self, remove: bool = False) -> int:
        """Kill every process still carrying this workspace's token; optionally delete files."""
        n = kill_tagged(self.token)
        if remove:
            target = self.owned_base or self.root.parent
            shutil.rmtree(target, ignore_errors=True)
        return n


# --------------------------------------------------------------------------- processes
def _read_environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def tagged_pids(token: str) -> list[int]:
    """PIDs (in this PID namespace) whose environment carries ``MARS_SANDBOX_TOKEN=token``."""
    needle = f"{TOKEN_ENV}={token}".encode()
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me:
            continue
        env = _read_environ(pid)
        if env and needle in env.split(b"\0"):
            out.append(pid)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill_pids(pids: list[int], grace_s: float = 0.3) -> int:
    """SIGTERM, short grace, SIGKILL; returns how many were alive at the start."""
    live = [p for p in pids if alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in live):
            time.sleep(0.02)
        if not any(alive(p) for p in live):
            break
    return len(live)


def kill_tagged(token: str, keep: set[int] | frozenset[int] = frozenset(), grace_s: float = 0.3) -> int:
    """Kill every process tagged with ``token`` except ``keep``; returns how many."""
    n = 0
    for _ in range(3):  # a dying parent may still fork once
        pids = [p for p in tagged_pids(token) if p not in keep]
        if not pids:
            break
        n += kill_pids(pids, grace_s)
    return n


def sweep_base(base: str | os.PathLike) -> int:
    """Kill the processes of every workspace under ``base`` (``<base>/<name>/runtime/sandbox.token``)."""
    n = 0
    for tok in Path(base).glob(f"*/runtime/{TOKEN_FILE}"):
        try:
            n += kill_tagged(tok.read_text().strip())
        except OSError:
            continue
    return n
