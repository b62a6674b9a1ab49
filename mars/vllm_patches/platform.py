"""The platform plugin that lets the emulated GPU decide async scheduling as a GPU does.

vLLM resolves one platform per process from its ``vllm.platform_plugins`` entry points; an
out-of-tree plugin that answers wins over the built-in detection. This module is that entry
point (``pyproject.toml``), and it stays light: vLLM loads it in every process before the
platform exists. It answers only where vLLM's own CPU platform would be chosen, with a
subclass of that platform that differs in one decision (:mod:`.emulated_platform`); on a
CUDA machine it answers None and vLLM's CUDA platform is used unchanged.
"""

from __future__ import annotations

QUALNAME = "mars.vllm_patches.emulated_platform.EmulationAwareCpuPlatform"


def detect() -> str | None:
    """vLLM's platform plugin hook: our CPU platform wherever vLLM's would be chosen."""
    from vllm.platforms import cpu_platform_plugin

    return QUALNAME if cpu_platform_plugin() is not None else None
