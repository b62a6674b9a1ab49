"""Instrumented, confined OpenHands tools: terminal, file_editor, task_tracker.

Importing this module registers :class:`MarsTerminalTool`, :class:`MarsFileEditorTool` and
:class:`MarsTaskTrackerTool` under the stock names (``terminal``, ``file_editor``,
``task_tracker``), replacing the stock tools in this process; the model sees the usual tool
names and schemas. A tool spec must name its session::

    Tool(name="terminal", params={"mars_session": session_id})

(:func:`mars_tool_specs` builds the three). Without ``mars_session`` the stock,
uninstrumented tool is created (with a warning).

What the wrappers add around the stock executors (which do the real work):

* ``tool_enqueue`` (when the model's tool call is emitted as an ``ActionEvent``, through the
  conversation callback from :func:`make_event_callback`), ``tool_start`` and ``tool_end``
  (``duration_s``, ``status`` ok|error|timeout|interrupted) events with the session id,
  LLM round, tool type and call id, shipped by the session's :class:`~.sink.EventSink`;
* terminal hygiene: every command gets a timeout (the agent's, else a default, always
  clamped to a maximum); on expiry the command is interrupted and every process it left is
  killed (the SDK's own timeout returns but leaves the command running);
* confinement (see :mod:`.workspace`): the shell runs under bubblewrap when available, the
  file editor refuses paths outside the workspace;
* sanitised argument logging (file contents as length + hash, secrets redacted).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any, ClassVar

from .env import prepare_sdk_env

prepare_sdk_env()

from openhands.sdk.event import ActionEvent  # noqa: E402
from openhands.sdk.llm import TextContent  # noqa: E402
from openhands.sdk.tool import Tool, ToolExecutor, register_tool  # noqa: E402
from openhands.tools.file_editor import (  # noqa: E402
    FileEditorAction,
    FileEditorExecutor,
    FileEditorObservation,
    FileEditorTool,
)
from openhands.tools.task_tracker import TaskTrackerExecutor, TaskTrackerTool  # noqa: E402
from openhands.tools.terminal import (  # noqa: E402
    TerminalAction,
    TerminalExecutor,
    TerminalObservation,
    TerminalTool,
    create_terminal_session,
)
from openhands.tools.terminal.constants import CMD_OUTPUT_PS1_END  # noqa: E402

from .sanitize import sanitize_args  # noqa: E402
from .session import SessionContext, ToolCallRecord, ToolLimits, get_session  # noqa: E402
from mars.procfs import children_of, comm  # noqa: E402
from .workspace import (  # noqa: E402
    PathOutsideWorkspace,
    Workspace,
    alive,
    kill_tagged,
    resolve_inside,
)

if TYPE_CHECKING:
    from openhands.sdk.conversation.state import ConversationState

log = logging.getLogger("mars.openhands_integration.tools")

INSTRUMENTED = ("terminal", "file_editor", "task_tracker")


def tool_kind(tool: str, action: Any, limits: ToolLimits | None) -> str:
    """The ``tool`` value for events and ``prev_tool``: ``terminal`` or ``file_editor.view``..."""
    if limits is None or not limits.subkinds:
        return tool
    sub = getattr(action, "command", None)
    if tool == "terminal":
        return "terminal.input" if getattr(action, "is_input", False) else "terminal.run"
    return f"{tool}.{sub}" if isinstance(sub, str) and sub else tool


def _action_args(action: Any) -> dict[str, Any]:
    try:
        raw = action.model_dump(exclude_none=True)
    except Exception:
        return {}
    raw.pop("kind", None)
    return sanitize_args(raw)


# --------------------------------------------------------------------------- instrumentation
class InstrumentedExecutor(ToolExecutor):
    """Wraps a stock executor with enqueue/start/end events and a sanitised call log."""

    def __init__(self, inner: ToolExecutor, ctx: SessionContext, tool: str) -> None:
        self.inner = inner
        self.ctx = ctx
        self.tool = tool
        self._interrupted = threading.Event()

    def __getattr__(self, name: str) -> Any:  # is_pooled, working_dir, session, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, action: Any, conversation: Any = None) -> Any:
        ctx = self.ctx
        rec: ToolCallRecord | None = ctx.claim_enqueued(id(action), self.tool)
        if rec is None:  # no conversation callback (direct use): enqueue == start
            rec = ctx.tool_enqueued(tool_kind(self.tool, action, ctx.limits), None,
                                    args=_action_args(action))
        slots = ctx.tool_slots
        if slots is not None:
            slots.acquire()
        self._interrupted.clear()
        status = "error"
        try:
            ctx.tool_started(rec)
            obs = self.inner(action, conversation)
            status = self._status(obs)
            return obs
        finally:
            if slots is not None:
                with suppress(Exception):
                    slots.release()
            ctx.tool_ended(rec, status)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("session=%s round=%s tool=%s call=%s status=%s %.3fs args=%s",
                         ctx.session_id, rec.round, rec.tool, rec.call_id, status,
                         rec.duration_s, rec.args)

    def _status(self, obs: Any) -> str:
        if self._interrupted.is_set():
            return "interrupted"
        if getattr(obs, "timeout", False):
            return "timeout"
        if getattr(obs, "is_error", False):
            return "error"
        return "ok"

    def interrupt(self) -> None:
        self._interrupted.set()
        self.inner.interrupt()

    def close(self) -> None:
        self.inner.close()


def make_event_callback(ctx: SessionContext):
    """Conversation callback: ``tool_enqueue`` when the model's tool call is emitted.

    Also keeps ``prev_tool`` right for tools that are not instrumented (``think``,
    ``finish``): the next LLM call reports them as the tool that just ran.
    """

    def on_event(event: Any) -> None:
        if not isinstance(event, ActionEvent) or event.action is None:
            return
        name = event.tool_name
        if name in INSTRUMENTED:
            ctx.tool_enqueued(tool_kind(name, event.action, ctx.limits), event.tool_call_id,
                              action_key=id(event.action), args=_action_args(event.action))
        else:
            ctx.last_tool = name

    return on_event


# --------------------------------------------------------------------------- terminal
class ConfinedTerminalExecutor(TerminalExecutor):
    """The stock terminal on a confined subprocess shell, with enforced timeouts.

    Always the ``subprocess`` backend (tmux would start the shell outside the sandbox), with
    the workspace's wrapper script as the shell. Interrupts go to the shell's own process
    group (under bwrap ``--new-session`` puts the shell in a session of its own, and a SIGINT
    to the outer bwrap process would kill the sandbox).
    """

    def __init__(self, workspace: Workspace, limits: ToolLimits, *,
                 full_output_save_dir: str | None = None) -> None:
        self.workspace = workspace
        self.limits = limits
        self._shell_pid: int | None = None
        self._lock = threading.RLock()
        wrapper = workspace.write_shell_wrapper()
        super().__init__(
            working_dir=str(workspace.root),
            terminal_type="subprocess",
            shell_path=str(wrapper),
            # commands always carry a timeout, so the SDK's no-change soft timeout never applies
            no_change_timeout_seconds=int(max(1, limits.max_timeout_s)),
            full_output_save_dir=full_output_save_dir,
        )
        self._prepare_shell()

    def _prepare_shell(self) -> None:
        """Make the shell's output trackable: settled start, no job control, plain newlines.

        No job control: a shell that got a controlling terminal (the unconfined mode) prints job
        notifications (``[1] 123``, ``[1]+ Done ...``) at unpredictable moments, which the
        SDK's prompt tracking mistakes for a finished command; it also puts the foreground
        command in a process group of its own, out of reach of the interrupt.
        """
        # The SDK waits a fixed 1 s for the first prompt, then clears the screen; if the
        # prompt was late (a loaded host) it "nudges" the shell with an ENTER, and the extra
        # prompt that follows would end the first command early. Let the output settle first.
        self._settle(max_s=10.0, quiet_s=0.2)
        # `stty -onlcr`: the SDK's subprocess terminal looks for "\n###PS1JSON###\n" in the
        # raw PTY output, which the tty turns into "\r\n..."; it never finds it, so after
        # every command it clears everything and sends an ENTER to get a fresh prompt, and
        # that extra prompt races with the next command (under load it ends the next
        # command early, with the output shifted by one). Plain "\n" output avoids it all.
        with suppress(Exception):
            self.session.execute(TerminalAction(command="set +m; stty -onlcr 2>/dev/null; true", timeout=10))
        self._settle(max_s=2.0, quiet_s=0.05)

    def _settle(self, max_s: float, quiet_s: float) -> bool:
        """Wait for the shell's output to settle at a prompt, then drop what is before it."""
        sess = self._session
        if sess is None:
            return False
        settled = self._wait_quiet(max_s=max_s, quiet_s=quiet_s)
        if settled:
            with suppress(Exception):
                sess.terminal.clear_screen()
            sess.prev_status = None
            sess.prev_output = ""
        return settled

    # -- processes -------------------------------------------------------
    def _outer_pid(self) -> int | None:
        sess = self._session
        proc = getattr(getattr(sess, "terminal", None), "process", None) if sess else None
        return proc.pid if proc is not None else None

    def shell_pid(self) -> int | None:
        """PID of the interactive bash (under bwrap: below bwrap and its namespace init)."""
        outer = self._outer_pid()
        if outer is None:
            return None
        if self._shell_pid is not None and alive(self._shell_pid):
            return self._shell_pid
        if self.workspace.mode != "bwrap":
            self._shell_pid = outer
            return outer
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # bwrap -> its namespace init -> bash
            todo, seen = [outer], set()
            while todo:
                pid = todo.pop(0)
                if pid in seen:
                    continue
                seen.add(pid)
                if pid != outer and comm(pid) == "bash":
                    self._shell_pid = pid
                    return pid
                todo.extend(children_of(pid))
            time.sleep(0.02)
        return None

    def _keep_pids(self) -> set[int]:
        """The shell and its ancestors up to the SDK's process: never swept."""
        keep: set[int] = set()
        outer = self._outer_pid()
        pid = self.shell_pid()
        while pid and pid > 1:
            keep.add(pid)
            if pid == outer:
                break
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    pid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        if outer:
            keep.add(outer)
        return keep

    def _signal_shell_group(self, sig: int) -> bool:
        pid = self.shell_pid()
        if pid is None:
            return False
        try:
            os.killpg(os.getpgid(pid), sig)
            return True
        except OSError:
            return False

    def _at_prompt(self) -> bool:
        try:
            screen = self.session.terminal.read_screen()
        except Exception:
            return False
        return screen.rstrip().endswith(CMD_OUTPUT_PS1_END.rstrip())

    def _wait_quiet(self, max_s: float, quiet_s: float) -> bool:
        """Wait until the screen ends at a prompt and has not changed for ``quiet_s``."""
        deadline = time.monotonic() + max_s
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            try:
                screen = self.session.terminal.read_screen()
            except Exception:
                return False
            now = time.monotonic()
            if screen != last:
                last, since = screen, now
            elif now - since >= quiet_s and screen.rstrip().endswith(CMD_OUTPUT_PS1_END.rstrip()):
                return True
            time.sleep(0.03)
        return last is not None and last.rstrip().endswith(CMD_OUTPUT_PS1_END.rstrip())

    def kill_running(self) -> int:
        """Interrupt the running command and kill everything the shell started.

        Returns the number of processes killed after the SIGINT. The shell survives; if it
        does not come back to its prompt the terminal is reset.
        """
        with self._lock:
            self._signal_shell_group(signal.SIGINT)
            deadline = time.monotonic() + self.limits.interrupt_grace_s
            while time.monotonic() < deadline and not self._at_prompt():
                time.sleep(0.05)
            killed = kill_tagged(self.workspace.token, keep=self._keep_pids())
            # the shell may print more than one prompt (one when the job dies, one more for
            # the SIGINT it saw meanwhile): wait until its output settles, or the next
            # command would take a late prompt for its own completion
            if not self._settle(max_s=2.0, quiet_s=0.2):
                log.warning("terminal of %s did not return to its prompt; resetting it",
                            self.workspace.root)
                self._reset_single_session()
            return killed

    # -- SDK overrides ---------------------------------------------------
    def __call__(self, action: TerminalAction, conversation: Any = None) -> TerminalObservation:
        timeout = self.limits.clamp(action.timeout)
        if action.timeout != timeout:
            action = action.model_copy(update={"timeout": timeout})
        if not action.is_input and self._session is not None and not self._at_prompt():
            # output of the previous command still arriving (or a late prompt): let it
            # settle, or this command would complete at that prompt with the wrong output
            self._settle(max_s=2.0, quiet_s=0.05)
        obs = super().__call__(action, conversation)
        if getattr(obs, "timeout", False) or (obs.exit_code == -1 and not obs.is_error):
            killed = self.kill_running()
            note = (f"\n[mars: the command did not finish within {timeout:g} s; it was interrupted"
                    f"{f' and {killed} leftover process(es) were killed' if killed else ''}. "
                    "The terminal is ready for the next command.]")
            obs = obs.model_copy(update={
                "content": [TextContent(text=obs.text + note)],
                "timeout": True,
            })
        return obs

    def interrupt(self) -> None:
        if self._session is None:
            return
        if self.workspace.mode == "bwrap":
            self._signal_shell_group(signal.SIGINT)
        else:
            super().interrupt()

    def _reset_single_session(self) -> TerminalObservation:
        """Like the SDK's reset, but the new shell is the confined subprocess shell again."""
        assert self._session is not None
        with suppress(Exception):
            end_shell_before_close(self._session)
        with suppress(Exception):
            self._session.close()
        kill_tagged(self.workspace.token)
        self._shell_pid = None
        self._session = create_terminal_session(
            work_dir=self._working_dir,
            username=self._username,
            no_change_timeout_seconds=self._no_change_timeout_seconds,
            terminal_type="subprocess",
            shell_path=self.shell_path,
            env=self._env,
        )
        self._session.initialize()
        self._prepare_shell()
        return TerminalObservation.from_text(text=self._RESET_TEXT, command="[RESET]", exit_code=0)

    def close(self) -> None:
        with suppress(Exception):
            if self._session is not None:
                end_shell_before_close(self._session)
        with suppress(Exception):
            super().close()
        kill_tagged(self.workspace.token)

    def __del__(self) -> None:
        # an executor dropped unclosed (a conversation that failed to start after its tools
        # were built): the SDK session's own __del__ would close the PTY under a live reader
        with suppress(Exception):
            if self._session is not None:
                end_shell_before_close(self._session)


def end_shell_before_close(session: Any, timeout_s: float = 5.0) -> bool:
    """End a terminal session's shell and wait for its PTY reader thread to stop, before the
    SDK's ``close()`` closes the PTY.

    The SDK's ``SubprocessTerminal.close`` closes the PTY's master fd first and joins its
    reader thread after (for 1 s); the reader keeps ``select()`` / ``os.read()`` on that fd
    *number* until it sees the shell gone. In a process that opens a file or socket meanwhile
    (two sessions in one process, a runner's worker) the kernel hands out the number at once,
    and the reader reads the next owner's bytes: measured, a socket opened right after the
    close lost all it was sent in 1 of 8 closes; in the agent tests, another session's
    request was read half by the LLM server and half by this reader, and the server waited
    for the rest until the client's 300 s timeout. Here the shell ends first (``exit``, then
    SIGKILL to its group), the reader notices within one 0.1 s poll and returns, and only
    then may the fd close. Returns whether the reader stopped (False: it is still running
    after ``timeout_s``; the fd is then left open, never closed under it)."""
    term = getattr(session, "terminal", None)
    proc = getattr(term, "process", None)
    reader = getattr(term, "reader_thread", None)
    if proc is not None and proc.poll() is None:
        fd = getattr(term, "_pty_master_fd", None)
        if fd is not None:
            with suppress(OSError):
                os.write(fd, b"exit\n")
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            with suppress(OSError):
                os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
    if reader is not None and reader.is_alive() and reader is not threading.current_thread():
        reader.join(timeout=timeout_s)
    if reader is not None and reader.is_alive():
        # the shell could not be reaped (a process stuck in the kernel): leak the PTY's fd
        # rather than let its number go to the next file or socket under a live reader
        term._pty_master_fd = None
        log.warning("terminal: the PTY reader did not stop; its fd is left open")
        return False
    return True


# --------------------------------------------------------------------------- file editor
class ConfinedFileEditorExecutor(FileEditorExecutor):
    """The stock file editor, refusing any path that resolves outside the workspace.

    Relative paths are taken relative to the workspace (the stock editor wants absolute
    ones); symlinks are resolved before the check.
    """

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace
        super().__init__(workspace_root=str(workspace.root))

    def __call__(self, action: FileEditorAction, conversation: Any = None) -> FileEditorObservation:
        try:
            real = resolve_inside(self.workspace.root, action.path)
        except PathOutsideWorkspace as exc:
            return FileEditorObservation.from_text(
                text=f"ERROR: {exc}. Only files inside {self.workspace.root} can be viewed or edited.",
                command=action.command, path=action.path, is_error=True)
        if not os.path.isabs(action.path):
            action = action.model_copy(update={"path": str(real)})
        return super().__call__(action, conversation)


# --------------------------------------------------------------------------- tool classes
def _ctx_or_none(tool: str, mars_session: str | None) -> SessionContext | None:
    if mars_session is None:
        log.warning("tool %r created without mars_session: stock tool, no events, no confinement", tool)
        return None
    return get_session(mars_session)


class MarsTerminalTool(TerminalTool):
    """``terminal``: confined shell + timeouts + events (see module docs)."""

    name: ClassVar[str] = "terminal"

    @classmethod
    def create(cls, conv_state: "ConversationState", mars_session: str | None = None,
               **params: Any) -> Sequence["MarsTerminalTool"]:
        ctx = _ctx_or_none("terminal", mars_session)
        if ctx is None:
            return super().create(conv_state, **params)
        inner = ConfinedTerminalExecutor(ctx.workspace, ctx.limits,
                                         full_output_save_dir=conv_state.env_observation_persistence_dir)
        tools = super().create(conv_state, executor=inner)
        return [t.set_executor(InstrumentedExecutor(inner, ctx, "terminal")) for t in tools]


class MarsFileEditorTool(FileEditorTool):
    """``file_editor``: stock editor confined to the workspace, with events."""

    name: ClassVar[str] = "file_editor"

    @classmethod
    def create(cls, conv_state: "ConversationState", mars_session: str | None = None,
               **params: Any) -> Sequence["MarsFileEditorTool"]:
        ctx = _ctx_or_none("file_editor", mars_session)
        tools = super().create(conv_state, **params)
        if ctx is None:
            return tools
        inner = ConfinedFileEditorExecutor(ctx.workspace)
        return [t.set_executor(InstrumentedExecutor(inner, ctx, "file_editor")) for t in tools]


class MarsTaskTrackerTool(TaskTrackerTool):
    """``task_tracker``: stock tracker (state in the private runtime dir), with events."""

    name: ClassVar[str] = "task_tracker"

    @classmethod
    def create(cls, conv_state: "ConversationState", mars_session: str | None = None,
               **params: Any) -> Sequence["MarsTaskTrackerTool"]:
        ctx = _ctx_or_none("task_tracker", mars_session)
        tools = super().create(conv_state, **params)
        if ctx is None:
            return tools
        out = []
        for t in tools:
            inner = t.executor if isinstance(t.executor, TaskTrackerExecutor) else TaskTrackerExecutor(
                save_dir=conv_state.persistence_dir)
            out.append(t.set_executor(InstrumentedExecutor(inner, ctx, "task_tracker")))
        return out


_REGISTERED = False


def register_mars_tools() -> None:
    """Register the instrumented tools under the stock names (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    reg_log = logging.getLogger("openhands.sdk.tool.registry")
    level = reg_log.level
    reg_log.setLevel(logging.ERROR)  # "Duplicate tool name registered" is the point here
    try:
        register_tool("terminal", MarsTerminalTool)
        register_tool("file_editor", MarsFileEditorTool)
        register_tool("task_tracker", MarsTaskTrackerTool)
    finally:
        reg_log.setLevel(level)
    _REGISTERED = True


def mars_tool_specs(session_id: str, tools: Sequence[str] = INSTRUMENTED) -> list[Tool]:
    """Tool specs for one session (the registry is per process: the session goes in params)."""
    register_mars_tools()
    return [Tool(name=name, params={"mars_session": session_id}) for name in tools]


register_mars_tools()
