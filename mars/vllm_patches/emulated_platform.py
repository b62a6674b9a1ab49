"""vLLM's CPU platform, keeping async scheduling for the emulated GPU.

vLLM decides async scheduling in ``VllmConfig.__post_init__`` from the executor's capability
(``Executor.supports_async_scheduling``; on by default where supported, off with
``--no-async-scheduling``), and then lets the platform have the last word
(``check_and_update_config``). The CPU platform turns it off unconditionally ("not required
on CPU"): true of a model running on CPU cores, not of the emulated GPU, which stands for an
H100 or H200 where vLLM runs async scheduling by default and ``make_scheduler`` builds
``MarsAsyncScheduler``. So this platform keeps the executor's decision when, and only when,
the executor is :class:`~mars.vllm_patches.emulated_executor.EmulatedExecutor`; for every
other executor (the real CPU engine) it decides exactly as vLLM's CPU platform does.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

def runs_emulated_executor(vllm_config) -> bool:
    """The executor is ours (or a subclass): a class, or the qualified name vLLM accepts in
    ``--distributed-executor-backend``; vLLM's own backend names ("mp", "uni", "ray") are
    not."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    if isinstance(backend, str):
        if "." not in backend:
            return False
        from vllm.utils.import_utils import resolve_obj_by_qualname

        backend = resolve_obj_by_qualname(backend)
    if not isinstance(backend, type):
        return False
    from mars.vllm_patches.emulated_executor import EmulatedExecutor

    return issubclass(backend, EmulatedExecutor)


class EmulationAwareCpuPlatform(CpuPlatform):
    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        sc = vllm_config.scheduler_config
        decided = sc.async_scheduling  # the executor's capability and the user's flag
        super().check_and_update_config(vllm_config)
        if runs_emulated_executor(vllm_config):
            sc.async_scheduling = decided
