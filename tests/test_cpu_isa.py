"""The AMX grant vLLM's CPU attention needs in every process that runs it
(mars/engine/serve/cpu_isa.py). Without it `mars-vllm serve`'s worker died of SIGILL on its
first request on AMX hosts; tests/test_lifecycle.py exercises the served path end to end."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest


def test_vllm_loads_the_grant_in_every_process():
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("mars_cpu_amx") == "mars.engine.serve.cpu_isa:grant_amx"


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _has_amx(), reason="this CPU has no AMX")
def test_the_grant_gives_a_fresh_process_the_tile_state():
    code = """
import ctypes
from mars.engine.serve.cpu_isa import request_amx
libc = ctypes.CDLL(None, use_errno=True)
v = ctypes.c_ulong(0)
def tiles():
    assert libc.syscall(158, 0x1022, ctypes.byref(v)) == 0  # ARCH_GET_XCOMP_PERM
    return bool(v.value & (1 << 18))
before = tiles()
print(before, request_amx(), tiles(), request_amx())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    before, granted, after, again = out.stdout.split()
    assert before == "False"  # a fresh process has no tile state: AMX would be SIGILL
    assert (granted, after, again) == ("True", "True", "True")


def test_off_x86_linux_nothing_is_requested(monkeypatch):
    from mars.engine.serve import cpu_isa

    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "aarch64")
    assert cpu_isa.request_amx() is False
