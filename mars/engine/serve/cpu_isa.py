"""Let vLLM's CPU attention use AMX in every process that runs it.

On x86 Linux a process must ask the kernel for the AMX tile state (``arch_prctl``
``ARCH_REQ_XCOMP_PERM`` for ``XTILEDATA``, Linux >= 5.16) before its first AMX instruction;
without it that instruction is a SIGILL. vLLM's CPU attention picks its ``amx`` kernel from
CPUID alone (``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py``: AMX present,
bf16, block size a multiple of 32) and never asks. In a process where oneDNN has already run a
bf16 matmul (which asks) it works; in ``mars-vllm serve``'s worker process the attention
kernel came first, and the worker died of the illegal instruction on the first request
(found on a Sapphire Rapids host: every real-engine test failed with "the inference engine
died"). The request is cheap, idempotent, and refused harmlessly where AMX is absent.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx() -> bool:
    """Ask the kernel for the AMX tile state for this process; True if granted. False
    (nothing done) off x86-64 Linux or where the CPU or the kernel has no AMX."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM,
                            ctypes.c_ulong(_XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def grant_amx() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``), loaded in the API server,
    the EngineCore and every worker: :func:`request_amx` there, before any kernel runs."""
    request_amx()
