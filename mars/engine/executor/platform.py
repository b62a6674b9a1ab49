"""The platform plugin that lets the emulated GPU decide async scheduling as a GPU does.

vLLM resolves one platform per process from its ``vllm.platform_plugins`` entry points; an
out-of-tree plugin that answers wins over the built-in detection. This module is that entry
point (``pyproject.toml``), and it stays light: vLLM loads it in every process before the
platform exists. It answers only where vLLM's own CPU platform would be chosen, with a
subclass of that platform that differs in one decision (:mod:`.emulated_platform`); on a
CUDA machine it answers None and vLLM's CUDA platform is used unchanged.
"""

from __future__ import annotations

QUALNAME = "mars.engine.executor.emulated_platform.EmulationAwareCpuPlatform"
#: the one built-in platform we extend; where vLLM picks another CPU platform (its
#: ZenCpuPlatform on AMD Zen with zentorch) we answer nothing and the emulated GPU runs sync
CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"


def detect() -> str | None:
    """vLLM's platform plugin hook: our CPU platform wherever vLLM's plain CpuPlatform would
    be chosen, nothing anywhere else."""
    from vllm.platforms import cpu_platform_plugin

    return QUALNAME if cpu_platform_plugin() == CPU_PLATFORM else None


def emulated_async_available() -> bool:
    """Whether an emulated engine built in this process can keep async scheduling (the
    plugin answered: not under ``VLLM_TARGET_DEVICE=cpu``, a ``VLLM_PLUGINS`` list without
    it, or vLLM's Zen platform)."""
    from vllm.platforms import current_platform

    return f"{type(current_platform).__module__}.{type(current_platform).__qualname__}" == \
        QUALNAME
