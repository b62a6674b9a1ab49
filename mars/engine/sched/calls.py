"""The per-request record the adapter keeps: formally the :class:`CallView` policies read.

One object per request, made at ``add_request`` and dropped when the request is freed. The
static fields are set once and the moving ones (computed / output tokens, blocks, status) are
read through from vLLM's ``Request`` when a policy looks, so refreshing keys costs no
allocation and no copying (building a fresh view per call per tick was most of the adapter's
cost per step).
"""

from __future__ import annotations

from vllm.v1.request import Request, RequestStatus

from mars.policy.engine.base import CallView
from mars.protocol.session import SessionMeta


class EngineCall(CallView):
    __slots__ = ("req", "request_id", "meta", "session_id", "round", "prompt_tokens",
                 "max_tokens", "arrival_time", "cached_tokens", "seen", "pending",
                 "last_served", "first_sched", "key", "horizon", "until", "_bs")

    def __init__(self, req: Request, meta: SessionMeta, block_size: int,
                 arrival_time: float) -> None:
        self.req = req
        self.request_id = req.request_id
        self.meta = meta
        self.session_id = meta.job_id
        self.round = meta.round
        self.prompt_tokens = req.num_prompt_tokens
        self.max_tokens = req.max_tokens
        #: on the adapter's clock (vLLM's own arrival stamp is wall time)
        self.arrival_time = arrival_time
        #: prefix-cache hit at (the latest) admission; 0 until admitted
        self.cached_tokens = 0
        #: computed tokens already observed, and those not yet charged to the ordering policy
        self.seen = 0
        self.pending = 0
        self.last_served = arrival_time
        #: when the request was first scheduled (None: not yet)
        self.first_sched: float | None = None
        self.key: tuple = ()
        #: the policy's promise: the key holds for ``horizon`` more tokens and until ``until``
        self.horizon: float = 0
        self.until = 0.0
        self._bs = block_size

    @property
    def computed_tokens(self) -> int:
        return self.req.num_computed_tokens

    @property
    def output_tokens(self) -> int:
        return self.req.num_output_tokens

    @property
    def num_blocks(self) -> int:
        return -(-self.req.num_tokens // self._bs)

    @property
    def running(self) -> bool:
        return self.req.status == RequestStatus.RUNNING
