"""Global Load Balancer: PackQueue of Algorithm 1 (paper §4.2).

The controller (:mod:`mars.policy.control.window`) decides *how many* sessions may enter; this module
decides *which*. Each queued session carries a KV-block estimate derived from its prompt
length (a proxy for both prefill cost and memory footprint, in the allocator's own unit), and
the packer orders or selects by it according to the operating regime:

``normal``
    Smaller sessions first (shortest-job-first on the block estimate): the cheapest way to cut
    mean completion time while nothing is scarce.
``cpu``
    The host is congested by tools: favour sessions that add little tool activity: a known
    low ``tool_share`` first, then long (large) sessions, which spend more of each round on the
    GPU and so inject fewer tool calls per unit of time.
``kv``
    KV pressure, or a queue dominated by sessions that are large relative to the budget:
    smaller sessions first, as in ``normal``.

Every mode packs a feasible set under the block budget, skipping whatever does not fit (an
oversized session never blocks smaller admissible ones); the mode only picks the order.

Anti-starvation, in every mode: a session queued for ``max_queue_wait_s`` or longer is *aged*;
aged sessions go before all others, oldest first, regardless of mode. An aged session that
does not fit takes a *reservation*: nothing else is admitted (no backfill) until it fits, so
the blocks freed by ending sessions accumulate for it. Progress rule: when no session is
admitted at all (``in_use == 0``) the first candidate is admitted even if it does not fit,
because waiting cannot free more memory. Together these bound every wait (see
docs/control_plane.md, "Anti-starvation bound").

Pure functions of their inputs; ``now`` is passed in.
"""

from __future__ import annotations

import abc
import enum
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from mars.policy.control.pressure import DualPressureState, PressureSignals


def estimate_blocks(prompt_tokens: int, block_size: int) -> int:
    """KV blocks a prompt of ``prompt_tokens`` occupies: ``ceil(tokens / block_size)``.

    Only the known prompt is counted; the session's later growth (further rounds) is the
    caller's forecast (``footprint`` of :meth:`PackQueue.pack`, measured by
    :mod:`mars.policy.control.growth`), and ``PackConfig.kv_reserve_frac`` leaves room for what no
    forecast sees (decode within a round).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    return max(0, math.ceil(max(0, int(prompt_tokens)) / block_size))


class Footprint(abc.ABC):
    """What admitting a session adds to the KV blocks the admitted sessions are projected to
    need at once. The packer charges a session this rather than its first prompt, without
    knowing how the projection is made (:class:`mars.policy.control.growth.Projection`: the
    expected peak of the contexts' sum as they grow)."""

    @abc.abstractmethod
    def rise(self, blocks: int) -> int:
        """Blocks the projection rises by if a session whose first prompt is ``blocks``
        joins those added so far."""

    @abc.abstractmethod
    def add(self, blocks: int) -> int:
        """Add that session (it is admitted); return the rise."""


class PackMode(str, enum.Enum):
    NORMAL = "normal"
    CPU = "cpu"
    KV = "kv"


@dataclass(slots=True)
class PackConfig:
    """Every parameter of PackQueue. Defaults and rationale: docs/control_plane.md."""

    #: Tokens per KV block, used when the engine has not reported its own (vLLM default 16).
    block_size: int = 16
    #: A session queued this long (seconds) is aged: it goes first in every mode.
    max_queue_wait_s: float = 60.0
    #: KV utilisation at or above which the packer switches to KV mode.
    kv_mode_utilisation: float = 0.80
    #: The queue is long-dominated (-> KV mode) when its median block estimate exceeds this
    #: fraction of the packing budget (0.25: fewer than four median sessions fit).
    long_dominated_frac: float = 0.25
    #: CPU load (active tools / tool cores) at or above which CPU mode is used.
    cpu_mode_load: float = 0.85
    #: Tool share assumed for sessions without a ``tool_share`` hint (CPU-mode ordering).
    default_tool_share: float = 0.5
    #: Fraction of all KV blocks kept out of the packing budget, as room for the growth of
    #: sessions already admitted.
    kv_reserve_frac: float = 0.05

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_queue_wait_s < 0:
            raise ValueError("max_queue_wait_s must be >= 0")
        if not 0.0 <= self.kv_reserve_frac < 1.0:
            raise ValueError("kv_reserve_frac must be in [0, 1)")
        if self.long_dominated_frac <= 0:
            raise ValueError("long_dominated_frac must be > 0")


@dataclass(slots=True)
class QueuedSession:
    """A session waiting for admission (its first request is parked at the sidecar)."""

    session_id: str
    enqueued_at: float
    prompt_tokens: int = 0
    #: KV blocks of the first prompt (see :func:`estimate_blocks`)
    est_blocks: int = 0
    #: expected fraction of the session's time spent in tools, if a hint is known (0..1)
    tool_share: float | None = None
    #: FIFO tie-breaker, assigned by the queue owner (arrival order)
    seq: int = 0
    #: free-form hints carried for logging
    meta: dict[str, Any] = field(default_factory=dict)

    def waited(self, now: float) -> float:
        return max(0.0, now - self.enqueued_at)


@dataclass(slots=True)
class PackResult:
    """Sessions to admit now, in admission order, and why."""

    sessions: list[QueuedSession]
    mode: PackMode
    reason: str
    #: aged session holding a KV reservation (nothing else admitted until it fits)
    reserved_for: str | None = None
    #: blocks the admitted sessions are estimated to need
    planned_blocks: int = 0

    @property
    def session_ids(self) -> list[str]:
        return [s.session_id for s in self.sessions]


def _signals(state: DualPressureState | PressureSignals, now: float) -> PressureSignals:
    return state if isinstance(state, PressureSignals) else state.signals(now)


def choose_mode(signals: PressureSignals, queue: Sequence[QueuedSession],
                config: PackConfig | None = None,
                free_blocks: int | None = None) -> tuple[PackMode, str]:
    """Pick the packing regime. Precedence: KV over CPU over normal.

    * KV: utilisation >= ``kv_mode_utilisation``, or the queue is long-dominated (median
      ``est_blocks`` > ``long_dominated_frac`` x free blocks). KV wins over CPU because an
      infeasible admission thrashes memory (preemption, recomputation) while a CPU-unaware
      order only slows tools.
    * CPU: ``cpu_load >= cpu_mode_load``.
    * otherwise normal.

    Unknown KV (no snapshot) never selects KV mode by utilisation. ``free_blocks`` overrides
    the snapshot's (the admission layer passes its packing room: the free blocks less those
    promised to just-admitted sessions, at most what the admitted sessions' projected
    contexts leave; ``BalanceAndAdmit.room``).
    """
    cfg = config or PackConfig()
    free = free_blocks if free_blocks is not None else signals.free_blocks
    util = signals.kv_utilisation
    if util is not None and util >= cfg.kv_mode_utilisation:
        return PackMode.KV, f"kv utilisation {util:.2f} >= {cfg.kv_mode_utilisation:.2f}"
    if free is not None and queue:
        med = statistics.median(s.est_blocks for s in queue)
        if med > cfg.long_dominated_frac * max(0, free):
            return PackMode.KV, (f"long-dominated queue: median {med:g} blocks > "
                                 f"{cfg.long_dominated_frac:.2f} x budget {free}")
    if signals.cpu_load >= cfg.cpu_mode_load:
        return PackMode.CPU, f"cpu load {signals.cpu_load:.2f} >= {cfg.cpu_mode_load:.2f}"
    return PackMode.NORMAL, "no pressure"


class PackQueue:
    """Orders and selects queued sessions for admission (policy only; owns no queue)."""

    def __init__(self, config: PackConfig | None = None) -> None:
        self.config = config or PackConfig()

    def order_key(self, mode: PackMode):
        cfg = self.config
        if mode is PackMode.CPU:
            def key(s: QueuedSession):
                share = s.tool_share if s.tool_share is not None else cfg.default_tool_share
                return (share, -s.est_blocks, s.enqueued_at, s.seq)
        else:  # NORMAL and KV: smaller first
            def key(s: QueuedSession):
                return (s.est_blocks, s.enqueued_at, s.seq)
        return key

    def pack(self, queue: Iterable[QueuedSession], state: DualPressureState | PressureSignals,
             budget_slots: int, free_blocks: int | None, now: float, *,
             in_use: int = 0, mode: PackMode | None = None,
             footprint: Footprint | None = None,
             charge_cap: int | None = None) -> PackResult:
        """Choose up to ``budget_slots`` sessions to admit now, in order.

        ``free_blocks`` is the KV budget for this step (None = unknown: KV mode is not used
        unless forced with ``mode``, and then packs as if unlimited). ``in_use`` (sessions
        already admitted) only matters for the progress rule. ``footprint``: the admitted
        sessions' projected need; a session is then charged what it raises that by (at least
        its estimate: ``free_blocks`` also bounds what is resident now), and each pick is
        added to it. None: a session is charged its estimate. ``charge_cap``: the room a pool
        with nothing projected would leave (the caller's), less the reserve: no session is
        charged more than that, so a forecast larger than the whole pool waits for the pool
        to empty, never for ever (a session admitted but quiet, not projected, still counts
        in ``in_use`` and so holds off the progress rule).
        """
        cfg = self.config

        def need(s: QueuedSession) -> int:
            if footprint is None or s.est_blocks > budget:  # (cannot fit: no need to price)
                return s.est_blocks
            return max(s.est_blocks, min(footprint.rise(s.est_blocks), cap))

        def take(s: QueuedSession, n: int) -> int:
            picks.append(s)
            charged.append(n)
            if footprint is not None:
                footprint.add(s.est_blocks)
            return n

        queue = list(queue)
        sig = _signals(state, now)
        if mode is None:
            mode, why = choose_mode(sig, queue, cfg, free_blocks)
        else:
            why = "forced"
        if budget_slots <= 0 or not queue:
            return PackResult([], mode, why + ("; no free slot" if queue else "; empty queue"))

        aged = sorted((s for s in queue if s.waited(now) >= cfg.max_queue_wait_s),
                      key=lambda s: (s.enqueued_at, s.seq))
        aged_ids = {id(s) for s in aged}
        rest = sorted((s for s in queue if id(s) not in aged_ids), key=self.order_key(mode))

        # Every mode packs a feasible set under the free-block budget; the mode only picks
        # the order. (Normal and CPU modes once took the first ``budget_slots`` sessions
        # whatever their size: three aged 138K-185K-token sessions entered a 301K-token
        # cache at once in ``mars sim`` and preempted each other's prefills for 400 s.)
        if free_blocks is None:
            free_blocks = sig.free_blocks
        reserve = cfg.kv_reserve_frac * (sig.total_blocks or 0)
        budget = math.inf if free_blocks is None else max(0.0, free_blocks - reserve)
        cap = math.inf if charge_cap is None else max(0.0, charge_cap - reserve)
        picks: list[QueuedSession] = []
        charged: list[int] = []
        reserved: QueuedSession | None = None
        for s in aged:  # oldest first, strict order: an aged session is never overtaken
            if len(picks) >= budget_slots:
                break
            n = need(s)
            if n <= budget:
                budget -= take(s, n)
            else:
                reserved = s
                break
        if reserved is None:
            # In the mode's order (smallest first in normal and KV modes, so an oversized
            # session sorts last); a session that does not fit is skipped, never blocking
            # admissible ones behind it.
            for s in rest:
                if len(picks) >= budget_slots:
                    break
                n = need(s)
                if n <= budget:
                    budget -= take(s, n)
        # Progress rule: with nothing admitted anywhere, waiting frees no memory.
        if not picks and in_use == 0:
            first = reserved or (aged[0] if aged else rest[0])
            take(first, first.est_blocks)
            why += f"; progress rule admits {first.session_id} (nothing running)"
            reserved = None
        elif reserved is not None:
            why += (f"; aged {reserved.session_id} needs {need(reserved)} blocks > "
                    f"budget {budget:g}: reserving")
        return PackResult(picks, mode, why, reserved_for=reserved.session_id if reserved else None,
                          planned_blocks=sum(charged))
