"""The lifecycle plugin's process mechanics without a server (``mars.vllm_patches.lifecycle``):
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
        from mars.vllm_patches import lifecycle
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
