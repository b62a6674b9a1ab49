"""vLLM's own ``EngineCore`` in this process, on the emulated GPU, in virtual time.

The simulator (``mars sim``) decides nothing itself: every step is vLLM's ``EngineCore.step``
(our scheduler class loaded through ``--scheduler-cls`` as ``mars-vllm serve`` loads it, vLLM's
KV cache manager and block pool sized by the emulated executor for the target card and model),
built from the *same* arguments ``mars-vllm serve --emulate GPU:MODEL --policy P`` parses. What
differs from the served engine is only where time comes from and where events go:

* the executor's pacer is a :class:`~mars.emulate.pacing.VirtualPacer`: a step advances the
  virtual clock by exactly the step-time model's time for the batch vLLM scheduled, instead
  of sleeping until it is due (under async scheduling, the default as on the card, the clock
  moves to the end of each step on the device's timeline when the engine reads its outputs);
* the scheduler reads that clock (``set_mars_clock``), so windows, ticks, tool-time
  estimates and pin decisions see virtual seconds;
* its events go to a callback (the simulator's event hub) instead of a ZMQ socket.

vLLM's in-process engine client (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) uses ``EngineCore`` the
same way; no engine method is overridden here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mars.emulate.pacing import PacerStats, VirtualPacer, set_active


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one request got from one engine step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    #: prefix-cache hit of the request's prompt (vLLM's count; set on its first output)
    cached_tokens: int | None


class CallbackPublisher:
    """The scheduler's event publisher, delivering each event synchronously to ``sink``
    (same ``publish`` / ``close`` interface as :class:`mars.stream.publisher.EventPublisher`)."""

    def __init__(self, sink: Callable[[dict[str, Any]], None]) -> None:
        self.publish = sink

    def close(self) -> None:
        pass


@contextlib.contextmanager
def in_process_engine():
    """vLLM's executor in this process while an engine is built here
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as vLLM's in-process client sets it), and the
    variable restored afterwards: left set, every engine a later child process starts (a
    server a test or a bench launches) would run the in-process executor too."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    old = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def engine_args_for(emulate: str | None, policy: str, extra: Sequence[str] = ()):
    """The ``argparse`` namespace ``mars-vllm serve [--emulate TARGET] --policy P EXTRA``
    builds (mars defaults applied), with no events socket or file. ``emulate``: ``GPU:MODEL``
    or a device profile file; None: the real engine on this machine."""
    from mars.engine.serve.cli import _is_cpu_platform, apply_mars_defaults, build_parser

    argv = ["serve", *(["--emulate", emulate] if emulate else []), "--policy", policy, *extra]
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    apply_mars_defaults(args, argv[1:], _is_cpu_platform())
    args.additional_config["mars"]["events_endpoint"] = None
    args.additional_config["mars"]["events_file"] = None
    return args


class SimEngine:
    """One ``EngineCore`` on the emulated GPU, stepped by the simulator.

    ``emulate``: ``GPU:MODEL`` or a device profile file (``mars-vllm serve --emulate``);
    ``clock``: the virtual clock (``now()`` and ``advance(dt)``), shared with the scheduler;
    ``sink``: receives every scheduler event as it is published.
    """

    def __init__(self, emulate: str, policy: str, *, clock, sink: Callable[[dict], None],
                 extra_args: Sequence[str] = ()) -> None:
        with in_process_engine():
            from vllm.engine.arg_utils import EngineArgs
            from vllm.sampling_params import SamplingParams
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine import EngineCoreRequest
            from vllm.v1.engine.core import EngineCore

            from mars.engine.executor.emulated_executor import EmulatedExecutor

            self._SP, self._ECR = SamplingParams, EngineCoreRequest
            args = engine_args_for(emulate, policy, extra_args)
            self.vllm_config = EngineArgs.from_cli_args(args).create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER)
            self.core = EngineCore(self.vllm_config, EmulatedExecutor, log_stats=False)
        # vLLM's own loop body: step() (sync), or step_with_batch_queue() (async scheduling,
        # the default on the card: a step is launched before the last one's outputs are read)
        self.async_scheduling = self.core.batch_queue is not None
        worker = self.core.model_executor.driver_worker
        self.pacer = VirtualPacer(clock.advance, now=clock)
        #: engine calls that launched a batch or read one's outputs (the simulator's
        #: liveness check: a call that did neither leaves only time to help)
        self.progress = 0
        worker.pacer = self.pacer
        set_active(self.pacer)
        self.step_model = worker.step_model
        #: vLLM's KV offloading on the emulated host link, when ``--kv-offloading-size``
        self.offload = worker.offload
        self.clock = clock
        sched = self.core.scheduler
        sched.set_mars_clock(clock)
        # the publisher built from the config has no socket and no file: what it had
        # (scheduler_start) is published again to the sink, on the virtual clock
        sched.mars_events.close()
        sched.mars_events = CallbackPublisher(sink)
        sched.mars_publish_start()
        self.scheduler = sched
        mc = self.vllm_config.model_config
        self.served_model = mc.served_model_name
        self.max_model_len = mc.max_model_len
        self.block_size = self.vllm_config.cache_config.block_size
        self.num_blocks = self.vllm_config.cache_config.num_gpu_blocks
        self.token_hi = worker.table.out.token_hi

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, prompt: list[int], max_tokens: int,
            extra_args: dict[str, Any] | None = None) -> None:
        """A completion call as the API server hands it to the engine: exact token ids,
        exactly ``max_tokens`` generated (``min_tokens`` = ``max_tokens``, ``ignore_eos``)."""
        sp = self._SP(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                      extra_args=extra_args or None, detokenize=False)
        req = self._ECR(request_id=request_id, prompt_token_ids=list(prompt), mm_features=None,
                        sampling_params=sp, pooling_params=None, arrival_time=self.clock(),
                        lora_request=None, cache_salt=None, data_parallel_rank=None)
        self.core.add_request(*self.core.preprocess_add_request(req))

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    @property
    def has_work(self) -> bool:
        """Requests to schedule, or (async) steps launched whose outputs are still to read;
        vLLM's busy loop asks the same."""
        return self.scheduler.has_requests() or bool(self.core.batch_queue)

    def wake_at(self) -> float | None:
        """When the next KV transfer in flight on the host link ends, on this engine's clock
        (None: none in flight). An engine whose requests wait only for a load schedules
        nothing until then: the simulator advances its clock there, as the engine's busy
        loop would have polled until the load landed."""
        return None if self.offload is None else self.offload.next_done()

    def _load_marks(self) -> tuple[int, int]:
        from mars.engine.executor.offload import load_marks

        return load_marks(self.offload, self.scheduler)

    def link_stats(self) -> dict[str, Any] | None:
        """Bytes and transfers each way on the host link (None without offloading)."""
        return None if self.offload is None else self.offload.stats()

    # ------------------------------------------------------------------ steps
    def step(self) -> list[StepOutput]:
        """One pass of vLLM's engine loop: schedule and run a step (sync: the clock advances
        by its modeled time), or (async) launch a step and, when the queue is full or
        nothing more can be scheduled, read the oldest step's outputs (the clock moves to
        its end)."""
        read = self.pacer.read
        # with offloading, a step that only reports a load landed (or only reads that
        # report, or only schedules nothing until the request it freed is ready) moves too
        loads = self._load_marks()
        # the stats this engine's snapshots report (several engines share the process)
        set_active(self.pacer)
        outputs, executed = self.core.step_fn()
        if executed or self.pacer.read != read or self._load_marks() != loads:
            self.progress += 1
        got: list[StepOutput] = []
        for eco in (outputs or {}).values():
            for o in eco.outputs:
                ps = o.prefill_stats  # what the API server reports as cached_tokens
                got.append(StepOutput(o.request_id, list(o.new_token_ids),
                                      o.finish_reason is not None,
                                      ps.num_cached_tokens if ps is not None else None))
        return got

    # ------------------------------------------------------------------ state
    @property
    def pacer_stats(self) -> PacerStats:
        return self.pacer.stats

    def counters(self) -> dict[str, int]:
        return dict(self.scheduler.mars_counters)

    def kv_balanced(self) -> tuple[bool, dict[str, int]]:
        """Conservation: every block is free, held by a request, or pinned; none leaked."""
        from dataclasses import asdict

        from mars.engine.harness.offline import kv_account

        acc = kv_account(self.scheduler, self.scheduler.mars_cosched.pins)
        return acc.balanced, asdict(acc)

    def close(self) -> None:
        try:
            self.core.shutdown()
        finally:
            set_active(None)
