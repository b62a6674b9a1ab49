"""The mars scheduler classes, loaded by vLLM's EngineCore through ``--scheduler-cls``.

They subclass vLLM's own ``Scheduler`` / ``AsyncScheduler`` and override only narrow hooks
(request arrival, output, free, preemption, and the step entry); ``schedule()`` itself is never
copied. ``make_scheduler`` is what ``--scheduler-cls`` names: it picks the async flavour when
vLLM decided on async scheduling (on by default on GPU, forced off on CPU), which is only
known after the config is finalised inside the EngineCore, so it cannot be chosen on the CLI.

With ``--policy fcfs`` the hooks only observe (events), so behaviour is exactly stock vLLM.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from mars.policy.base import SessionMeta
from mars.policy.events import make_event
from mars.stream.publisher import EventPublisher

logger = logging.getLogger("mars.scheduler")

#: key in vLLM's ``--additional-config`` under which ``mars-vllm serve`` passes our settings
CONFIG_KEY = "mars"


def mars_settings(vllm_config) -> dict[str, Any]:
    extra = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(extra, dict):
        return dict(extra.get(CONFIG_KEY) or {})
    return {}


class _MarsSchedulerMixin:
    """Hooks shared by both flavours. Keep every method cheap: it runs inside the step."""

    def _mars_init(self) -> None:
        cfg = mars_settings(self.vllm_config)
        self.mars_policy: str = cfg.get("policy", "fcfs")
        self.mars_snapshot_interval_s: float = float(cfg.get("snapshot_interval_s", 0.5))
        self.mars_events = EventPublisher(
            endpoint=cfg.get("events_endpoint") or None,
            jsonl_path=cfg.get("events_file") or None,
        )
        self._mars_meta: dict[str, SessionMeta] = {}
        #: prefix-cache hit of each request at its (first) admission, for gpu_1st_token
        self._mars_cached: dict[str, int] = {}
        self.mars_telemetry_errors = 0
        self._mars_next_snapshot = 0.0
        self.mars_counters = {"submitted": 0, "finished": 0, "preempted": 0, "steps": 0}
        pool = self.kv_cache_manager.block_pool
        # The null block is never handed out; report usable blocks only.
        self._mars_total_blocks = pool.num_gpu_blocks - 1
        self.mars_events.publish(make_event(
            "scheduler_start",
            scheduler_cls=f"{type(self).__module__}.{type(self).__qualname__}",
            policy=self.mars_policy,
            total_blocks=self._mars_total_blocks,
            block_size=self.block_size,
            pid=os.getpid(),
        ))
        logger.info("mars scheduler %s active (policy=%s, %d KV blocks of %d tokens)",
                    type(self).__name__, self.mars_policy, self._mars_total_blocks,
                    self.block_size)

    # ----------------------------------------------------------------- helpers
    def _mars_session(self, request: Request) -> SessionMeta:
        meta = self._mars_meta.get(request.request_id)
        if meta is None:
            sp = request.sampling_params
            extra = sp.extra_args if sp is not None else None
            meta = SessionMeta.from_extra_args(extra, getattr(request, "session_id", None))
            self._mars_meta[request.request_id] = meta
        return meta

    def _mars_blocks_of(self, request_id: str) -> int:
        try:
            groups = self.kv_cache_manager.get_block_ids(request_id)
        except Exception:
            return 0
        return len(groups[0]) if groups else 0

    def _mars_snapshot(self, now: float) -> None:
        pool = self.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        self.mars_events.publish(make_event(
            "kv_snapshot", ts=now,
            total_blocks=self._mars_total_blocks,
            free_blocks=free,
            used_blocks=max(self._mars_total_blocks - free, 0),
            pinned_blocks=self._mars_pinned_blocks(),
            running=len(self.running),
            waiting=len(self.waiting),
        ))

    def _mars_pinned_blocks(self) -> int:
        return 0

    # ------------------------------------------------------------------- hooks
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        meta = self._mars_session(request)
        self.mars_counters["submitted"] += 1
        n = request.num_prompt_tokens
        self.mars_events.publish(make_event(
            "gpu_submit", session_id=meta.job_id, request_id=request.request_id,
            round=meta.round, prompt_tokens=n,
            projected_blocks=-(-n // self.block_size),
        ))

    def schedule(self, *args, **kwargs):
        now = time.time()
        if now >= self._mars_next_snapshot:
            self._mars_next_snapshot = now + self.mars_snapshot_interval_s
            self._mars_snapshot(now)
        self.mars_counters["steps"] += 1
        out = super().schedule(*args, **kwargs)
        for new in out.scheduled_new_reqs:
            # computed tokens at admission of a fresh request = its prefix-cache hit
            self._mars_cached.setdefault(new.req_id, new.num_computed_tokens)
        return out

    def _update_request_with_output(self, request: Request, new_token_ids, *args, **kwargs):
        new_token_ids, stopped = super()._update_request_with_output(
            request, new_token_ids, *args, **kwargs)
        if new_token_ids and request.num_output_tokens == len(new_token_ids):
            meta = self._mars_session(request)
            self.mars_events.publish(make_event(
                "gpu_1st_token", session_id=meta.job_id, request_id=request.request_id,
                round=meta.round,
                launch_delay_s=max(time.time() - request.arrival_time, 0.0),
                cached_tokens=self._mars_cached.pop(request.request_id, 0),
            ))
        return new_token_ids, stopped

    def _free_request(self, request: Request, *args, **kwargs):
        blocks = self._mars_blocks_of(request.request_id)
        result = super()._free_request(request, *args, **kwargs)
        meta = self._mars_meta.pop(request.request_id, None) or SessionMeta()
        self._mars_cached.pop(request.request_id, None)
        self.mars_counters["finished"] += 1
        self.mars_events.publish(make_event(
            "gpu_end", session_id=meta.job_id, request_id=request.request_id,
            round=meta.round, freed_blocks=blocks,
            output_tokens=request.num_output_tokens,
            status=request.status.name.lower(),
        ))
        return result

    def _preempt_request(self, request: Request, *args, **kwargs) -> None:
        blocks = self._mars_blocks_of(request.request_id)
        super()._preempt_request(request, *args, **kwargs)
        meta = self._mars_session(request)
        self.mars_counters["preempted"] += 1
        self.mars_events.publish(make_event(
            "preempt", session_id=meta.job_id, request_id=request.request_id,
            round=meta.round, blocks=blocks,
        ))

    def shutdown(self) -> None:
        try:
            self._mars_snapshot(time.time())
            self.mars_events.close()
        finally:
            super().shutdown()


class MarsScheduler(_MarsSchedulerMixin, Scheduler):
    """Synchronous flavour (CPU, or GPU with async scheduling off)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mars_init()


class MarsAsyncScheduler(_MarsSchedulerMixin, AsyncScheduler):
    """Async flavour: keeps vLLM's overlap of scheduling and model execution on GPU."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mars_init()


def make_scheduler(*args, vllm_config, **kwargs):
    """What ``--scheduler-cls`` points at: the flavour matching vLLM's async decision."""
    cls = MarsAsyncScheduler if vllm_config.scheduler_config.async_scheduling else MarsScheduler
    return cls(*args, vllm_config=vllm_config, **kwargs)
