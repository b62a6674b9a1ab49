"""vLLM's CPU platform, keeping async scheduling for the emulated GPU.

vLLM decides async scheduling in ``VllmConfig.__post_init__`` from the executor's capability
(``Executor.supports_async_scheduling``; on by default where supported, off with
``--no-async-scheduling``), and then lets the platform have the last word
(``check_and_update_config``). The CPU platform turns it off unconditionally ("not required
on CPU"): true of a model running on CPU cores, not of the emulated GPU, which stands for an
H100 or H200 where vLLM runs async scheduling by default and ``make_scheduler`` builds
``MarsAsyncScheduler``. So this platform keeps the executor's decision when, and only when,
the executor is :class:`~mars.engine.executor.emulated_executor.EmulatedExecutor`; for every
other executor (the real CPU engine) it decides exactly as vLLM's CPU platform does.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform


def runs_emulated_executor(vllm_config) -> bool:
    """The executor is ours (or a subclass), resolved by vLLM's own ``Executor.get_class``:
    the resolution ``VllmConfig`` decided async scheduling from."""
    if vllm_config.parallel_config.distributed_executor_backend is None:
        return False  # not resolved yet (VllmConfig sets it before the platform hook)
    from vllm.v1.executor.abstract import Executor

    from mars.engine.executor.emulated_executor import EmulatedExecutor

    return issubclass(Executor.get_class(vllm_config), EmulatedExecutor)


class EmulationAwareCpuPlatform(CpuPlatform):
    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        sc = vllm_config.scheduler_config
        decided = sc.async_scheduling  # the executor's capability and the user's flag
        super().check_and_update_config(vllm_config)
        if runs_emulated_executor(vllm_config):
            sc.async_scheduling = decided
