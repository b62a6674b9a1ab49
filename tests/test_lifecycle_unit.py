"""The lifecycle plugin's process mechanics without a server (``mars.engine.serve.lifecycle``):
a child that ``mars-vllm serve``'s processes fork is armed as a spawned one is."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_forked_child_dies_with_its_parent_and_leaves_the_group():
    """vLLM forks its EngineCore and workers on GPUs, and a forked child never loads the
    plugin again (vLLM loads plugins once per process; the flag is inherited): the at-fork
    hook arms it -- SIGKILL at its parent's death, its own process group."""
    code = textwrap.dedent("""
        import ctypes, os, signal
        os.environ["MARS_DIE_WITH_PARENT"] = "1"
        from mars.engine.serve import lifecycle
        lifecycle.arm_forked_children()
        lifecycle.arm_forked_children()  # idempotent: one hook
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            sig = ctypes.c_int(0)
            libc.prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
            os.write(w, f"{sig.value} {os.getpgid(0)} {os.getpid()}".encode())
            os._exit(0)
        os.close(w)
        got = os.read(r, 100).decode().split()
        os.waitpid(pid, 0)
        print(got[0], int(got[1]) == int(got[2]), int(got[1]) != os.getpgid(0))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, start_new_session=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [str(int(signal.SIGKILL)), "True", "True"], r.stdout


def test_stale_event_sockets_are_swept_and_live_ones_kept(tmp_path):
    """A killed server leaves its events socket behind (no exit hook runs): the next
    ``mars-vllm serve`` removes socket files nothing listens on, and nothing else."""
    import os
    import socket

    from mars.engine.serve.lifecycle import sweep_stale_ipc

    stale = tmp_path / "mars-engine-1.ipc"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(stale))
    dead.close()  # the file stays, as after a SIGKILL
    live_path = tmp_path / "mars-engine-2.ipc"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(live_path))
    live.listen(1)
    plain = tmp_path / "mars-engine-3.ipc"
    plain.write_text("not a socket")
    other = tmp_path / "other-1.ipc"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(other))
    dead.close()
    young = tmp_path / "mars-engine-4.ipc"  # perhaps a server between its bind and listen
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(young))
    dead.close()
    old = os.stat(stale).st_mtime - 60
    for p in (stale, live_path, plain, other):
        os.utime(p, (old, old))
    try:
        assert sweep_stale_ipc(str(tmp_path)) == [str(stale)]
        assert not stale.exists()
        assert live_path.exists() and plain.exists() and other.exists() and young.exists()
    finally:
        live.close()
        os.unlink(live_path)


def test_a_stop_during_the_engine_handshake_is_not_swallowed(tmp_path, monkeypatch):
    """vLLM's handshake socket context swallows KeyboardInterrupt (its SIGTERM during
    start-up): the start-up went on and both sides waited 600 s for each other. After
    ``propagate_startup_interrupts`` the interrupt leaves the context, which is still
    cleaned up."""
    pytest.importorskip("vllm")
    import zmq
    import vllm.v1.engine.utils as engine_utils

    from mars.engine.serve.lifecycle import propagate_startup_interrupts

    monkeypatch.setattr(engine_utils, "zmq_socket_ctx", engine_utils.zmq_socket_ctx)
    addr = f"ipc://{tmp_path}/handshake.ipc"

    def interrupted_handshake() -> zmq.Socket:
        with engine_utils.zmq_socket_ctx(addr, zmq.ROUTER, bind=True) as sock:
            raise KeyboardInterrupt("terminated")
        return sock  # reached only when the interrupt was swallowed

    sock = interrupted_handshake()  # vLLM 0.32 as shipped: the stop is lost
    assert sock.closed
    propagate_startup_interrupts()
    propagate_startup_interrupts()  # idempotent: wrapped once
    with pytest.raises(KeyboardInterrupt):
        interrupted_handshake()
    with engine_utils.zmq_socket_ctx(addr, zmq.ROUTER, bind=True) as sock:
        pass  # the context was destroyed: the address can be bound again
    assert sock.closed
