"""vLLM's own KV offloading on the emulated GPU: its connector decides, the emulated link times.

``--kv-offloading-size GiB`` turns on vLLM's native offloading (``OffloadingConnector`` with
its CPU backend): the scheduler side (real vLLM, unchanged) stores computed blocks to host
memory, keeps an LRU of what the host holds, and on a prefix hit that the GPU no longer has
loads the blocks back (the request waits in ``WAITING_FOR_REMOTE_KVS`` until they land).
The worker side is vLLM's ``OffloadingConnectorWorker`` too, driven here as vLLM's GPU model
runner drives it (``kv_connector_model_runner_mixin``): preemptions, bind the step's
metadata, start loads and deferred stores, queue this step's stores, report what finished.

What an emulated GPU cannot do is copy bytes, so the one piece replaced is the transfer
engine under it (vLLM's ``OffloadingWorker`` interface, :class:`EmulatedTransfers`): each job
goes on the emulated link (:class:`mars.emulate.host_link.HostLinkTimeline`) and is reported
finished once the link has moved its bytes on the engine's clock (the pacer's: wall time
when served, virtual time under ``mars sim``). A transfer occupies the link, not the SMs.

Every vLLM internal this touches is here: the connector factory, the worker role, the worker
slot of ``OffloadingConnectorWorker`` (set instead of registering KV tensors the emulated GPU
does not have), and the KV cache config's group layout for the bytes of a block.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from mars.emulate.host_link import LOAD, STORE, HostLinkTimeline
from mars.policy.engine.host_tier import HostLink

#: the connector vLLM 0.32 builds for ``--kv-offloading-backend native``
SUPPORTED_CONNECTOR = "OffloadingConnector"


def block_bytes_by_group(kv_cache_config) -> list[int]:
    """Bytes one GPU block holds in each offloaded KV cache group, in the order vLLM's
    ``GPULoadStoreSpec.group_sizes`` lists them (every layer of the group, K and V)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_offloading_group_ids)
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    out = []
    for gid in get_offloading_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        out.append(spec.page_size_bytes if isinstance(spec, UniformTypeKVCacheSpecs)
                   else spec.page_size_bytes * len(group.layer_names))
    return out


def host_tier_for(vllm_config, kv_cache_config, block_size: int,
                  prior_read_bytes_per_s: float | None = None):
    """What MARS's retention needs to price a release when vLLM offloads to host memory
    (:class:`~mars.policy.engine.base.HostTier`), or None when it does not: the KV bytes per
    token of this model's layout (sliding-window groups: their window), whether vLLM stores
    prompts only (its ``offload_prompt_only``, default on), the host pool's size
    (``--kv-offloading-size``), and a prior for the link's read rate -- the one given (the
    emulated card's link), else PCIe Gen5 x16's measured rate
    (:data:`~mars.emulate.specs.PCIE_GEN5_X16_GB_S`) -- which the first measured loads
    replace."""
    from mars.emulate.specs import PCIE_GEN5_X16_GB_S
    from mars.policy.engine.base import HostTier

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_offloading_group_ids)
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    ktc = vllm_config.kv_transfer_config
    if ktc is None or ktc.kv_connector != SUPPORTED_CONNECTOR:
        return None
    extra_cfg = ktc.kv_connector_extra_config
    # vLLM divides the host pool among the workers (each keeps its own shard of every block;
    # kv_offload/cpu/spec.py), and this layout is one worker's
    capacity = float(extra_cfg.get("cpu_bytes_to_use") or 0) / max(
        1, vllm_config.parallel_config.world_size)
    # every token of a full-attention group comes back; of a sliding-window group, its window
    per_token = window = 0.0
    groups = [kv_cache_config.kv_cache_groups[g] for g in get_offloading_group_ids(
        kv_cache_config)]
    for group, nbytes in zip(groups, block_bytes_by_group(kv_cache_config)):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            window += spec.sliding_window * nbytes / spec.block_size
        else:
            per_token += nbytes / spec.block_size
    rate = prior_read_bytes_per_s or PCIE_GEN5_X16_GB_S * 1e9
    if per_token <= 0:
        return None  # nothing keeps every token: the host tier holds only windows
    return HostTier(per_token, capacity, rate, window_bytes=window, block_tokens=block_size,
                    prompt_only=bool(extra_cfg.get("offload_prompt_only", True)))


def host_reads(model_runner_output) -> tuple[int, float] | None:
    """(bytes, seconds) of the loads from host memory a step's output reports landed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata)

    kvo = model_runner_output.kv_connector_output
    meta = kvo.kv_connector_worker_meta if kvo is not None else None
    if not isinstance(meta, OffloadingWorkerMetadata):
        return None
    load = meta.transfer_stats.load
    return (load.bytes, load.time) if load.bytes > 0 else None


def load_marks(offload: "EmulatedOffload | None", scheduler) -> tuple[int, int]:
    """(loads reported landed, loads vLLM's scheduler has read and not yet acted on). Each
    moves once per load: an engine step that changed neither, scheduled nothing and read no
    output has only the link left to wait for (how the simulator and the invariant harness
    tell an engine waiting on a transfer from one that is stuck)."""
    if offload is None:
        return (0, 0)
    return (offload.loads_reported, len(scheduler.finished_recving_kv_req_ids))


def _make_transfers_cls():
    from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

    class EmulatedTransfers(OffloadingWorker):
        """vLLM's transfer interface on the emulated link: a job ends when the link has
        moved its bytes (``now``: the engine's clock)."""

        def __init__(self, link: HostLinkTimeline, group_bytes: list[int],
                     now: Callable[[], float], wait_until: Callable[[float], None]) -> None:
            self.link = link
            self.group_bytes = group_bytes
            self._now = now
            self._wait_until = wait_until
            #: no copy starts before this (the engine sets it each step: the device's copy
            #: stream waits for the compute queued ahead of it)
            self.not_before = -math.inf
            #: job id -> (bytes, seconds the copy itself takes)
            self._jobs: dict[int, tuple[int, float]] = {}

        def _bytes(self, gpu_spec) -> int:
            sizes = gpu_spec.group_sizes or [len(gpu_spec.block_ids)]
            return sum(n * b for n, b in zip(sizes, self.group_bytes))

        def _submit(self, job_id: int, direction: str, gpu_spec) -> bool:
            n = self._bytes(gpu_spec)
            self.link.submit(job_id, direction, n, max(self._now(), self.not_before))
            ln = self.link.link
            self._jobs[job_id] = (n, ln.write_s(n) if direction == STORE else ln.read_s(n))
            return True

        def submit_store(self, job_id, src_spec, dst_spec) -> bool:
            return self._submit(job_id, STORE, src_spec)

        def submit_load(self, job_id, src_spec, dst_spec) -> bool:
            return self._submit(job_id, LOAD, dst_spec)

        def get_finished(self) -> list:
            out = []
            for job_id, _done in self.link.finished(self._now()):
                n, took = self._jobs.pop(job_id)
                # the copy's own time, as vLLM's worker measures it between CUDA events on
                # the transfer stream (waits for the link or the compute excluded)
                out.append(TransferResult(job_id=job_id, success=True, transfer_size=n,
                                          transfer_time=took))
            return out

        def wait(self, job_ids: set[int]) -> None:
            # vLLM blocks until these land (a preempted request's blocks are about to be
            # reused); on the emulated device, the engine's clock moves to their end
            ends = [t for j in job_ids if (t := self.link.done_at(j)) is not None]
            if ends:
                self._wait_until(max(ends))

    return EmulatedTransfers


class EmulatedOffload:
    """The worker side of vLLM's offloading for one emulated engine: its connector (worker
    role, this engine's own, not vLLM's process-wide one: several simulated engines share a
    process) and the link its transfers cross."""

    def __init__(self, vllm_config, kv_cache_config, link: HostLink,
                 now: Callable[[], float], wait_until: Callable[[float], None]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        name = vllm_config.kv_transfer_config.kv_connector
        if name != SUPPORTED_CONNECTOR:
            raise ValueError(
                f"the emulated GPU runs vLLM's native KV offloading ({SUPPORTED_CONNECTOR}, "
                f"--kv-offloading-size GiB), not the {name!r} connector")
        self.connector = KVConnectorFactory.create_connector(
            config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config)
        self.link = HostLinkTimeline(link)
        self._now = now
        #: requests whose loads were reported landed (a simulator's sign of progress: the
        #: engine can schedule them once it has read the report)
        self.loads_reported = 0
        # vLLM's worker would build its transfer engine over the registered KV tensors
        # (register_kv_caches -> spec.get_worker); the emulated one needs only the layout
        self.transfers = _make_transfers_cls()(
            self.link, block_bytes_by_group(kv_cache_config), now, wait_until)
        self.connector.connector_worker.worker = self.transfers

    def begin(self, scheduler_output, device_free: float, step_end: float) -> None:
        """The step is launched: preempted requests' stores flushed (their copies start
        when the device has done the compute queued before this step, ``device_free``),
        the step's metadata bound, its loads and the last step's deferred stores started
        (after this step's forward, ``step_end``: vLLM starts them after launching it and
        its copy stream waits for the compute)."""
        meta = scheduler_output.kv_connector_metadata
        if meta is None:
            raise RuntimeError("a step without KV connector metadata while offloading is on")
        conn = self.connector
        self.transfers.not_before = device_free
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        self.transfers.not_before = step_end
        conn.start_load_kv(None)

    def end(self, scheduler_output):
        """After the step's forward: its stores queued (they start with the next step, as in
        vLLM), and every transfer the link finished by now reported."""
        from vllm.v1.outputs import KVConnectorOutput

        conn = self.connector
        conn.wait_for_save()
        res = conn.get_transfer_results(scheduler_output.finished_req_ids)
        self.loads_reported += len(res.finished_recving or ())
        out = KVConnectorOutput(
            finished_sending=res.finished_sending, finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_stats=conn.get_kv_connector_stats(),
            kv_cache_events=conn.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=conn.build_connector_worker_meta())
        conn.clear_connector_metadata()
        return out

    def next_done(self) -> float | None:
        return self.link.next_done()

    def stats(self) -> dict[str, Any]:
        return self.link.stats.as_dict()

    def shutdown(self) -> None:
        self.connector.shutdown()
