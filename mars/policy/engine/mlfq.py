"""MARS's Priority-Aware Coordinator: a windowed multi-level feedback queue (paper §4.3).

A call's level is a compact summary of three things (the paper's "priority grammar"):

* **initial KV footprint** -- the *base level* grows with ``log2`` of the prompt length, so a
  short continuation starts above a repository-scale prefill and is never stuck behind it;
* **service received** -- tokens the call was scheduled in the last ``window_s`` seconds are
  charged against per-level token quotas; each exhausted quota demotes it one level, so a call
  that keeps consuming the GPU sinks below interactive work;
* **waiting time** -- a call that has not been served for ``promote_after_s`` rises one level
  per period, which bounds how long anything can be starved.

The level is a pure function of the call's view, its windowed service and ``now``; nothing is
stepped by a timer, so ``key`` is idempotent for a given ``now`` and the adapter may call it
as often as it likes. Level 0 is the highest priority.

Definitions (what ``docs/policies.md`` states; tests pin them down):

``base(p) = min(L-1, ceil(log2(p / base_tokens)))`` for ``p > base_tokens`` else 0, where ``p``
is the prefill work the call still needs: its prompt minus its expected prefix-cache hit
(``discount_cached``, on by default). Level ``b``
therefore holds prompts in ``(base_tokens * 2**(b-1), base_tokens * 2**b]``.

``q(l) = quota_tokens * quota_growth**l`` is the quota of level ``l``. A call with base ``b``
and windowed service ``S`` is demoted ``d`` levels where ``d`` is the number of consecutive
quotas ``q(b), q(b+1), ...`` whose running sum is ``<= S``. ``natural = min(L-1, b + d)``.

*Windowed* service ``S(now)``: the tokens computed for the call's **session** (every call
with its ``session_id``; a session-less call is its own) during the last ``window_s`` seconds
(``on_scheduled``'s ``tokens``). Per session, because that is what the paper's grammar is
about: "calls that have consumed more GPU service are gradually pushed downward. This prevents
long-running sessions from repeatedly dominating decode opportunities simply because they
return often". An agent call computes a few hundred output tokens and a tool result, far
below its own level's quota, so per-call accounting never demoted anything; a session that
comes back round after round accumulates service across them and sinks below sessions that
have used less in the window (``service_scope="call"`` restores per-call accounting). Service is recorded in ``window_buckets``
buckets of width ``w = window_s / window_buckets`` (bucket ``k`` holds service at times in
``[k*w, (k+1)*w)``); a bucket leaves the window once its end is ``<= now - window_s``. So a
token counts for at least ``window_s`` and less than ``window_s + w`` seconds after it was
served. The window is what lets a demoted call recover: demotion reflects *recent*
consumption, not lifetime consumption, so a call that yielded the GPU for a window is judged
afresh.

Promotion: ``promo = floor((now - last_served) / promote_after_s)`` and
``level = max(0, natural - promo)``. ``last_served`` is the CallView field (arrival time for a
call never served). Promotion stops as soon as the call is served again.

**Promotion bound**: ``natural <= L-1``, so any call that has gone ``(L-1) * promote_after_s``
seconds without service is at level 0 (:attr:`WindowedMLFQ.promotion_bound_s`). Within a
level, a call with more elapsed promotion periods is ordered first, so a starved call at level
0 precedes every level-0 call that has waited fewer periods (in particular all freshly arrived
small calls). Hence, whenever the calls that have starved at least as long fit in one step's
budget, no call goes longer than ``promotion_bound_s`` plus one step between two services.

Sort key (ascending; front is served first, back is preempted first):
``(level, -promo, prompt_tokens, arrival_time)``. Running calls are served every step so their
``promo`` is 0, and the back of the running list is therefore the lowest level and, within it,
the largest *initial* KV footprint, newest first among equals -- the paper's eviction rule
("lower-priority calls are primary eviction candidates; among them, larger KV footprints are
preferred because they release more memory"). The footprint is the prompt, not the blocks a
call holds now: ordering by current size put the calls that had decoded the most -- the ones
closest to completion -- at the back, and under decode-growth pressure that preempted 96 times
where vLLM's newest-first preempted 42 (tests/test_scheduler_sim.py); a static footprint also
keeps the order stable, so a preempted call is not re-admitted only to be the next victim.

Incremental refresh: :meth:`WindowedMLFQ.horizon` tells the adapter how much more service and
how long a call's key cannot change, so a running call is re-keyed only when it may have
crossed a quota, a bucket expired or a promotion period passed (:meth:`served` charges the
service accumulated meanwhile).

Session continuity: a later round of a session is judged by its own remaining work (base) and
its session's service in the *window* -- unlike Autellix's program-level attained service
(:mod:`mars.policy.engine.baselines`), consumption older than the window is forgotten, so a session
that paused for a tool longer than the window is judged afresh. The horizon is a per-call
promise; a second call of the same session running at the same time may move the shared
service earlier, which the call then notices at its time horizon (at most one bucket later).

Cached tokens: ``on_scheduled``'s ``tokens`` must be the tokens the engine computed this step
(vLLM's ``num_scheduled_tokens``), which excludes prefix-cache hits, so a call is never
charged for KV it found already computed.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass

from mars.policy.engine.base import CallView, OrderingPolicy


@dataclass(frozen=True, slots=True)
class MLFQConfig:
    """Knobs of the windowed MLFQ. Defaults are chosen to separate both the GPU regime (prompts
    6K-260K tokens land on levels 3-8) and a tiny CPU model (100-16K tokens on levels 0-4)."""

    #: number of levels L; level 0 is the highest priority
    num_levels: int = 10
    #: prompts up to this length start at level 0; each further doubling is one level lower
    base_tokens: int = 1024
    #: quota of level 0 in service tokens; level l has ``quota_tokens * quota_growth**l``, so a
    #: call's quota at its base level is at least its own prompt (its prefill alone never
    #: demotes it; what it consumes beyond its size class does)
    quota_tokens: int = 1024
    quota_growth: float = 2.0
    #: length of the sliding service window, seconds
    window_s: float = 30.0
    #: resolution of the window (service older than window_s is dropped bucket by bucket)
    window_buckets: int = 16
    #: a call not served for this long rises one level per such period (<= 0 or inf: never)
    promote_after_s: float = 4.0
    #: base level from ``prompt_tokens - cached_tokens``: the prefill work the call still
    #: needs (its expected prefix-cache hit is known from the lookup at arrival), so a long
    #: session's continuation -- mostly cached, little new work -- is not ranked as a fresh
    #: repository-scale prompt. False: the prompt length.
    discount_cached: bool = True
    #: whose service demotes a call: ``"session"`` (all calls of its agent session in the
    #: window; session-less calls are their own) or ``"call"`` (the call alone)
    service_scope: str = "session"

    def __post_init__(self) -> None:
        if self.num_levels < 1:
            raise ValueError("num_levels must be >= 1")
        if self.base_tokens < 1 or self.quota_tokens < 1:
            raise ValueError("base_tokens and quota_tokens must be >= 1")
        if self.quota_growth < 1.0:
            raise ValueError("quota_growth must be >= 1")
        if self.window_s <= 0 or self.window_buckets < 1:
            raise ValueError("window_s must be > 0 and window_buckets >= 1")
        if self.service_scope not in ("session", "call"):
            raise ValueError("service_scope must be 'session' or 'call'")


class _WindowedService:
    """Tokens served in the last ``window`` seconds, bucketed so updates are O(1) amortised."""

    __slots__ = ("buckets", "total")

    def __init__(self) -> None:
        #: [bucket index, tokens] pairs, oldest first
        self.buckets: deque[list[int]] = deque()
        self.total = 0

    def add(self, bucket: int, tokens: int) -> None:
        b = self.buckets
        if b and b[-1][0] >= bucket:
            # same bucket (or a clock that stepped back: charge the newest bucket)
            b[-1][1] += tokens
        else:
            b.append([bucket, tokens])
        self.total += tokens

    def expire(self, oldest_live: int) -> int:
        """Drop buckets with index < ``oldest_live``; return the windowed total."""
        b = self.buckets
        while b and b[0][0] < oldest_live:
            self.total -= b.popleft()[1]
        return self.total


class WindowedMLFQ(OrderingPolicy):
    """The MARS ordering policy (``--policy mars``). See the module docstring for the rule."""

    name = "mars"

    def __init__(self, config: MLFQConfig | None = None) -> None:
        self.config = cfg = config or MLFQConfig()
        self._L1 = cfg.num_levels - 1
        self._base = cfg.base_tokens
        self._bucket_w = cfg.window_s / cfg.window_buckets
        p = cfg.promote_after_s
        self._promote = p if (p > 0 and math.isfinite(p)) else 0.0
        self._discount_cached = cfg.discount_cached
        self._per_session = cfg.service_scope == "session"
        quotas = [cfg.quota_tokens * cfg.quota_growth**lvl for lvl in range(cfg.num_levels)]
        #: _thresholds[b][k]: service that demotes a base-b call k+1 levels
        self._thresholds: list[tuple[float, ...]] = []
        for b in range(cfg.num_levels):
            acc, row = 0.0, []
            for lvl in range(b, self._L1):
                acc += quotas[lvl]
                row.append(acc)
            self._thresholds.append(tuple(row))
        self._window_s = cfg.window_s
        self._service: dict[str, _WindowedService] = {}
        self._levels: dict[str, int] = {}
        self._cached_now = math.nan
        self._cached_oldest = 0

    # ------------------------------------------------------------------ introspection
    @property
    def promotion_bound_s(self) -> float:
        """Longest time a call can go unserved before it is at level 0: ``(L-1) * period``.

        ``inf`` when promotion is disabled.
        """
        if not self._promote:
            return math.inf if self._L1 > 0 else 0.0
        return self._L1 * self._promote

    def base_level(self, prompt_tokens: int) -> int:
        """Level a call of this size starts at (no service, no waiting)."""
        if prompt_tokens <= self._base:
            return 0
        # ceil(log2(p / base)) without floats: ((p-1)//base).bit_length()
        return min(self._L1, ((prompt_tokens - 1) // self._base).bit_length())

    def quota(self, level: int) -> float:
        cfg = self.config
        return cfg.quota_tokens * cfg.quota_growth**level

    def windowed_service(self, owner: str, now: float) -> int:
        """Windowed service of a session (per-session scope) or of a session-less call."""
        svc = self._service.get(owner)
        if svc is None:
            return 0
        return svc.expire(self._oldest_live_bucket(now))

    def level_of(self, request_id: str) -> int | None:
        """Level computed by the latest ``key``/``level`` call for this request, if any."""
        return self._levels.get(request_id)

    # ------------------------------------------------------------------ policy contract
    def level(self, call: CallView, now: float) -> int:
        return self.key(call, now)[0]

    def key(self, call: CallView, now: float) -> tuple:
        # Called per call whenever its horizon runs out (and at arrival): locals only, no
        # allocation beyond the returned tuple, one dict probe for calls never served.
        lvl = self._base_of(call)
        L1 = self._L1
        rid = call.request_id
        sid = call.session_id  # self._owner(call), inlined: key runs per call per tick
        svc = self._service.get(sid if (sid is not None and self._per_session) else rid)
        if svc is not None:
            s = svc.total
            if s:
                if now != self._cached_now:  # once per step, not once per call
                    self._cached_now = now
                    self._cached_oldest = self._oldest_live_bucket(now)
                if svc.buckets[0][0] < self._cached_oldest:
                    s = svc.expire(self._cached_oldest)
                if s:
                    lvl += bisect_right(self._thresholds[lvl], s)
                    if lvl > L1:
                        lvl = L1
        promo = 0
        period = self._promote
        if period:
            waited = now - call.last_served
            if waited >= period:
                promo = int(waited // period)
                lvl = lvl - promo if promo < lvl else 0
        self._levels[rid] = lvl
        return (lvl, -promo, call.prompt_tokens, call.arrival_time)

    def on_scheduled(self, call: CallView, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        owner = self._owner(call)
        svc = self._service.get(owner)
        if svc is None:
            svc = self._service[owner] = _WindowedService()
        svc.add(int(now // self._bucket_w), tokens)

    def horizon(self, call: CallView, now: float) -> tuple[float, float]:
        """How much more service (tokens) and until when (s) the call's key cannot change.

        The key moves only when windowed service crosses the next quota, when a bucket leaves
        the window, or when an unserved call completes another promotion period. The adapter
        uses this to skip re-keying a running call on every tick: it accumulates the service
        and charges it (``served``) when the token horizon is used up or the time horizon
        passes. The time horizon is also capped at one bucket width, so deferred service lands
        at most one bucket late (and therefore leaves the window at most that much later).
        """
        svc = self._service.get(self._owner(call))
        s = svc.total if svc is not None else 0
        row = self._thresholds[self._base_of(call)]
        k = bisect_right(row, s)
        tokens = row[k] - s if k < len(row) else math.inf
        until = now + self._bucket_w
        if svc is not None and svc.buckets:
            until = min(until, (svc.buckets[0][0] + 1) * self._bucket_w + self._window_s)
        if self._promote:
            waited = now - call.last_served
            until = min(until, call.last_served
                        + (int(max(waited, 0.0) // self._promote) + 1) * self._promote)
        return tokens, until

    def on_finished(self, request_id: str, session_id: str | None, now: float) -> None:
        self._levels.pop(request_id, None)
        if not self._per_session or session_id is None:
            self._service.pop(request_id, None)
            return
        # a session's service outlives its call for the window; drop it once it has aged out
        # (sessions that never say last_round must not grow the table for ever)
        svc = self._service.get(session_id)
        if svc is not None and svc.expire(self._oldest_live_bucket(now)) == 0:
            del self._service[session_id]

    def on_session_end(self, session_id: str, now: float) -> None:
        if self._per_session:
            self._service.pop(session_id, None)

    # ------------------------------------------------------------------ internals
    def _owner(self, call: CallView) -> str:
        """Whose service a call is judged by: its session's (per-session scope), else its own."""
        sid = call.session_id
        return sid if (sid is not None and self._per_session) else call.request_id

    def _base_of(self, call: CallView) -> int:
        return self.base_level(call.prompt_tokens - call.cached_tokens
                               if self._discount_cached else call.prompt_tokens)

    def _oldest_live_bucket(self, now: float) -> int:
        # bucket k covers [k*w, (k+1)*w) and is live iff (k+1)*w > now - window_s,
        # i.e. k >= floor((now - window_s) / w)
        return math.floor((now - self._window_s) / self._bucket_w)
