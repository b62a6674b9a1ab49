"""The instrumented OpenHands tools (real SDK tools, resolved through a real conversation)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

pytest.importorskip("openhands.sdk")
pytest.importorskip("openhands.tools.terminal")

from oh_support import requires_bwrap  # noqa: E402
from openhands.sdk import Agent, Conversation  # noqa: E402
from openhands.tools.file_editor import FileEditorAction  # noqa: E402
from openhands.tools.task_tracker import TaskTrackerAction  # noqa: E402
from openhands.tools.terminal import TerminalAction  # noqa: E402

from mars.openhands_integration.llm import make_llm  # noqa: E402
from mars.openhands_integration.session import (  # noqa: E402
    SessionContext,
    ToolLimits,
    register_session,
    unregister_session,
)
from mars.openhands_integration.sink import EventSink  # noqa: E402
from mars.openhands_integration.tools import (  # noqa: E402
    InstrumentedExecutor,
    MarsFileEditorTool,
    MarsTerminalTool,
    mars_tool_specs,
)
from mars.openhands_integration.workspace import Workspace, tagged_pids  # noqa: E402
from mars.protocol.events import parse_event  # noqa: E402

pytestmark = [pytest.mark.agents, pytest.mark.timeout(90)]


class Session:
    """A registered mars session with a conversation whose tools are resolved (no LLM call)."""

    def __init__(self, base, mode="auto", limits=None, tools=("terminal", "file_editor", "task_tracker")):
        self.sid = f"test-{uuid.uuid4().hex[:8]}"
        self.ws = Workspace.create(base, self.sid, mode=mode)
        self.sink = EventSink(None, path=self.ws.runtime / "events.jsonl")
        self.events: list[dict] = []
        orig = self.sink.emit
        self.sink.emit = lambda ev: (self.events.append(ev), orig(ev))[1]  # keep a copy
        self.ctx = register_session(SessionContext(self.sid, self.ws, self.sink,
                                                   limits or ToolLimits(default_timeout_s=10, max_timeout_s=20),
                                                   max_rounds=4))
        llm = make_llm(self.sid, "http://127.0.0.1:9", "unused")  # never called here
        agent = Agent(llm=llm, tools=mars_tool_specs(self.sid, tools))
        self.conv = Conversation(agent=agent, workspace=str(self.ws.root),
                                 persistence_dir=str(self.ws.runtime / "state"), visualizer=None)
        self.conv._ensure_agent_ready()
        self.tools = self.conv.agent.tools_map

    def call(self, name, action):
        return self.tools[name](action, self.conv)

    def close(self):
        self.conv.close()
        self.sink.close()
        unregister_session(self.sid)
        left = self.ws.cleanup(remove=True)
        return left


@pytest.fixture
def session(ws_base):
    s = Session(ws_base)
    yield s
    s.close()


def _by_kind(events, kind):
    return [e for e in events if e["kind"] == kind]


def test_stock_names_resolve_to_instrumented_tools(session):
    assert isinstance(session.tools["terminal"], MarsTerminalTool)
    assert isinstance(session.tools["file_editor"], MarsFileEditorTool)
    for name in ("terminal", "file_editor", "task_tracker"):
        assert isinstance(session.tools[name].executor, InstrumentedExecutor)
    # what the model sees is the stock schema under the stock name
    names = {t.to_openai_tool()["function"]["name"] for t in session.tools.values()}
    assert {"terminal", "file_editor", "task_tracker"} <= names


def test_file_editor_refuses_paths_outside_the_workspace(session, tmp_path):
    root = session.ws.root
    os.symlink("/etc", root / "etc_link")
    bad = [
        FileEditorAction(command="view", path="/etc/passwd"),
        FileEditorAction(command="view", path=str(root / ".." / ".." / "x")),
        FileEditorAction(command="create", path="../escape.txt", file_text="x"),
        FileEditorAction(command="create", path=str(tmp_path / "outside.txt"), file_text="x"),
        FileEditorAction(command="view", path=str(root / "etc_link" / "passwd")),
    ]
    for action in bad:
        obs = session.call("file_editor", action)
        assert obs.is_error, action.path
        assert "outside the task workspace" in obs.text
        assert "root:" not in obs.text  # /etc/passwd content never shown
    assert not (tmp_path / "outside.txt").exists()
    assert not (root.parent / "escape.txt").exists()
    # inside works, relative paths are taken relative to the workspace
    (root / "pkg").mkdir()
    obs = session.call("file_editor", FileEditorAction(command="create", path="pkg/mod.py", file_text="A = 1\n"))
    assert not obs.is_error, obs.text
    assert (root / "pkg" / "mod.py").read_text() == "A = 1\n"
    obs = session.call("file_editor", FileEditorAction(command="view", path=str(root / "pkg" / "mod.py")))
    assert "A = 1" in obs.text
    ends = _by_kind(session.events, "tool_end")
    assert [e["status"] for e in ends] == ["error"] * len(bad) + ["ok", "ok"]


def test_events_validate_and_carry_session_round_tool(session):
    session.ctx.round = 2  # as if the agent were in its third LLM round
    session.call("terminal", TerminalAction(command="echo hi"))
    session.call("file_editor", FileEditorAction(command="create", path="a.txt", file_text="a"))
    session.call("task_tracker", TaskTrackerAction(command="plan", task_list=[{"title": "t", "status": "todo"}]))
    session.call("task_tracker", TaskTrackerAction(command="view"))
    evs = session.events
    assert len(evs) == 12
    for e in evs:
        parse_event(e)
        assert e["session_id"] == session.sid and e["round"] == 2
    assert [e["kind"] for e in evs[:3]] == ["tool_enqueue", "tool_start", "tool_end"]
    assert [e["tool"] for e in _by_kind(evs, "tool_end")] == ["terminal", "file_editor", "task_tracker", "task_tracker"]
    assert all(e["status"] == "ok" for e in _by_kind(evs, "tool_end"))
    assert session.ctx.last_tool == "task_tracker"
    summ = session.ctx.summary()
    assert summ["tool_calls"] == 4 and summ["tools"]["task_tracker"]["calls"] == 2


def test_subkinds(ws_base):
    s = Session(ws_base, limits=ToolLimits(subkinds=True))
    try:
        s.call("file_editor", FileEditorAction(command="create", path="a.txt", file_text="a"))
        s.call("terminal", TerminalAction(command="true"))
        assert [e["tool"] for e in _by_kind(s.events, "tool_end")] == ["file_editor.create", "terminal.run"]
    finally:
        s.close()


@requires_bwrap
def test_terminal_cannot_create_files_outside_the_workspace(session, tmp_path):
    assert session.ws.mode == "bwrap"
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    for cmd in (f"echo x > {target}", f"touch {target}", f"cp /etc/hostname {target}",
                f"mkdir -p {target}", "echo x > ../escape.txt", f"echo x > /root/{target.name}"):
        session.call("terminal", TerminalAction(command=cmd))
    assert not target.exists()
    assert not (session.ws.root.parent / "escape.txt").exists()
    assert not os.path.exists(f"/root/{target.name}")
    obs = session.call("terminal", TerminalAction(command="echo ok > inside.txt && cat inside.txt && pwd"))
    assert "ok" in obs.text and (session.ws.root / "inside.txt").exists()


def _procs_with(needle: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if needle.encode() in fh.read().replace(b"\0", b" "):
                        out.append(int(pid))
            except OSError:
                pass
    return out


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=requires_bwrap), "unconfined"])
def test_timeout_interrupts_and_leaves_no_process(ws_base, mode):
    s = Session(ws_base, mode=mode, limits=ToolLimits(default_timeout_s=10, max_timeout_s=20,
                                                      interrupt_grace_s=1.0))
    try:
        marker = f"{300 + time.time() % 100:.5f}"
        # a background job, a setsid'ed one, and a foreground one that ignores SIGINT
        s.call("terminal", TerminalAction(command=f"sleep {marker} & setsid sleep {marker} &"))
        t0 = time.monotonic()
        obs = s.call("terminal", TerminalAction(command=f"bash -c \"trap '' INT; sleep {marker}\"", timeout=1))
        took = time.monotonic() - t0
        assert obs.timeout and took < 10, took  # 1 s + interrupt grace + settling; not 300 s
        assert "interrupted" in obs.text
        assert _procs_with(f"sleep {marker}") == []
        end = _by_kind(s.events, "tool_end")[-1]
        assert end["status"] == "timeout" and 1.0 <= end["duration_s"] < 10
        # the shell survived and is usable
        obs = s.call("terminal", TerminalAction(command="echo still-here"))
        assert "still-here" in obs.text and not obs.timeout
    finally:
        left = s.close()
    assert left == 0
    assert tagged_pids(s.ws.token) == []


def test_default_timeout_applies_and_is_clamped(ws_base):
    s = Session(ws_base, limits=ToolLimits(default_timeout_s=1.0, max_timeout_s=2.0, interrupt_grace_s=0.5))
    try:
        t0 = time.monotonic()
        obs = s.call("terminal", TerminalAction(command="sleep 30"))  # no timeout: default 1 s
        assert obs.timeout and time.monotonic() - t0 < 8
        t0 = time.monotonic()
        obs = s.call("terminal", TerminalAction(command="sleep 30", timeout=1000))  # clamped to 2 s
        took = time.monotonic() - t0
        assert obs.timeout and 2.0 <= took < 9, took
    finally:
        s.close()


def test_close_kills_background_jobs(ws_base):
    s = Session(ws_base)
    marker = f"{400 + time.time() % 100:.5f}"
    s.call("terminal", TerminalAction(command=f"nohup sleep {marker} >/dev/null 2>&1 &"))
    assert _procs_with(f"sleep {marker}")
    s.close()
    assert _procs_with(f"sleep {marker}") == []


def test_tool_calls_return_promptly_with_the_sidecar_down(ws_base, free_port):
    s = Session(ws_base)
    try:
        s.sink.close()
        s.sink = s.ctx.sink = EventSink(f"http://127.0.0.1:{free_port}", max_buffer=4, max_retry=2)
        t0 = time.monotonic()
        for i in range(10):
            s.call("file_editor", FileEditorAction(command="create", path=f"f{i}.txt", file_text="x"))
        assert time.monotonic() - t0 < 4.0
        assert s.sink.stats.max_emit_s < 0.25  # an emit never waits on the network
        s.sink.close(timeout_s=0.5)
        assert s.sink.stats.emitted == 30
        assert s.sink.stats.dropped == 30 and s.sink.stats.sent == 0
    finally:
        s.close()


def test_tool_slots_make_enqueue_and_start_differ(ws_base):
    """With a host-wide tool slot limit, a call waits for a slot between enqueue and start."""
    import threading

    s = Session(ws_base)
    try:
        s.ctx.tool_slots = threading.Semaphore(1)
        outs = []
        th = [threading.Thread(target=lambda i=i: outs.append(
            s.call("terminal" if i == 0 else "file_editor",
                   TerminalAction(command="sleep 1") if i == 0 else
                   FileEditorAction(command="create", path="late.txt", file_text="x"))))
              for i in range(2)]
        th[0].start()
        time.sleep(0.3)
        th[1].start()
        for t in th:
            t.join(30)
        recs = {r.tool: r for r in s.ctx.tool_calls}
        fe, term = recs["file_editor"], recs["terminal"]
        assert fe.start_ts >= term.end_ts - 0.01  # waited for the slot
        assert fe.start_ts - fe.enqueue_ts > 0.3
        assert s.ctx.summary()["tool_wait_s"] > 0.3
    finally:
        s.close()


def _close_then_reuse_the_fd(term, do_close, closed=None) -> tuple[bool, int]:
    """Run ``do_close`` and, the instant it closes the terminal's PTY fd, open a socket pair
    (the kernel gives it the lowest free number: that fd's) and send 100 bytes to it. Returns
    whether the PTY reader thread was alive when the fd closed, and how many of the bytes
    were still there for the socket's owner 0.5 s later. ``closed`` (an Event) is set once
    the bytes are sent."""
    import socket
    import threading

    import openhands.tools.terminal.terminal.subprocess_terminal as st

    fd, real_close, got = term._pty_master_fd, os.close, {}
    closed = closed or threading.Event()

    def close(x):
        if x == fd and "pair" not in got:
            got["alive"] = term.reader_thread.is_alive()
            real_close(x)
            a, b = socket.socketpair()
            got["pair"] = (a, b)
            (b if a.fileno() == fd else a).sendall(b"Z" * 100)
            closed.set()
            return
        real_close(x)

    st.os.close = close
    try:
        do_close()
    finally:
        st.os.close = real_close
    time.sleep(0.5)
    a, b = got["pair"]
    assert fd in (a.fileno(), b.fileno()), "the socket pair did not get the PTY's fd number"
    own = a if a.fileno() == fd else b
    own.setblocking(False)
    try:
        left = len(own.recv(1000))
    except BlockingIOError:
        left = 0
    a.close()
    b.close()
    return got["alive"], left


def test_a_closed_terminal_reads_nothing_that_reuses_its_pty_fd(ws_base, monkeypatch):
    """The SDK closes the PTY before its reader thread has stopped; the reader then reads
    whatever next gets that fd number in this process (once, in the agent tests, half of
    another session's request to the LLM server, which then waited for the rest until the
    client's 300 s timeout). The executor ends the shell and the reader first. The race is
    made certain here, not 1 in 8: against the SDK's close the reader's next poll waits until
    the fd has closed; against the executor's, each poll is slowed by 0.3 s."""
    import select as select_mod
    import threading

    import openhands.tools.terminal.terminal.subprocess_terminal as st

    from mars.openhands_integration.tools import ConfinedTerminalExecutor

    # the SDK's own close: the race this guards against (the reader steals the bytes)
    ex = ConfinedTerminalExecutor(Workspace.create(ws_base, "sdk"), ToolLimits())
    term = ex._session.terminal
    gate = threading.Event()

    class GatedSelect:
        def select(self, *args, **kwargs):
            if threading.current_thread() is term.reader_thread:
                gate.wait(10)  # the reader polls again only once the fd has closed
            return select_mod.select(*args, **kwargs)

    monkeypatch.setattr(st, "select", GatedSelect())
    alive, left = _close_then_reuse_the_fd(term, term.close, gate)
    ex.close()
    assert alive and left < 100, (alive, left)

    class SlowSelect:
        def select(self, *args, **kwargs):
            time.sleep(0.3)
            return select_mod.select(*args, **kwargs)

    monkeypatch.setattr(st, "select", SlowSelect())
    # the executor's close: the reader has stopped before the fd closes; nothing is lost
    ex = ConfinedTerminalExecutor(Workspace.create(ws_base, "mars"), ToolLimits())
    alive, left = _close_then_reuse_the_fd(ex._session.terminal, ex.close)
    assert not alive and left == 100, (alive, left)
