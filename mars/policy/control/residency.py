"""What an admitted session keeps resident in GPU memory when the engine has a host tier.

The packing room (:meth:`mars.policy.control.admission.BalanceAndAdmit.room`) charges every
admitted session its whole projected context, because without a host tier a context that is
not resident when its round returns is *recomputed*: a session paused in a tool holds its
share of the pool, pinned or as the prefix cache's free blocks, or pays a prefill of its
whole context. With vLLM's KV offloading (``--kv-offloading-size``) every prompt's blocks are
also in host memory, and a context evicted while its tool runs comes back as a *read* over
the host link (~0.1 s for 50 K tokens of Qwen3-Coder-30B at PCIe Gen5 rates, against seconds
of prefill). What must then fit in the pool at once is the contexts of the sessions whose
calls are in the engine, not of every admitted session: charging the paused ones held back
sessions the pool had room for (held-out ``swe-long`` with offloading: the room at zero with
5-10 K of 18.8 K blocks free and nothing waiting in the engine, first rounds queued 91 s,
docs/results.md).

So with a host tier a session is charged its projected context times the *engine share*:
the fraction of the admitted contexts' blocks that have a call in the engine, averaged
over time -- per session, the block-seconds of its context while a call of its is in the
engine (``gpu_submit`` to the ``gpu_end`` that leaves none; time a call waits in the
engine's queue counts, so a congested engine raises the share) over the block-seconds it
was admitted, not counting the time after it went quiet (it no longer counts in the room
either). Weighted by blocks because what the pool must hold is the contexts in the engine,
and large contexts spend longer there. Measured, never set (:class:`EngineShare`): a ratio
of sums over recent ended sessions and every live one that has submitted a call (counting
only ended sessions would claim nothing for the first sessions' whole lives, the hour a
long-session workload needs the room most). Until ``min_sessions`` sessions count, the
share is 1: the room as without a host tier. It moves slowly (a ratio over hundreds of
sessions' lives); what reacts within seconds to what gets past it is the window's KV soft
cap and its ``kv`` and ``preempt`` bands, as without a host tier. It is a mean where the
pool must hold a peak (how many sessions are in the engine at once fluctuates): the same
choice, and the same backstops, as the growth forecast's expected sum.

The host pool bounds it too: vLLM's host LRU holds every stored prompt, so what of the
admitted contexts does not fit there is a recompute again if it leaves the GPU, and is
charged whole (:class:`ResidentShare`). Pure; ``now`` is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Iterable

from mars.policy.control.packing import Footprint

if TYPE_CHECKING:
    from mars.policy.control.growth import Projection


class EngineShare:
    """The measured fraction of the admitted contexts with a call in the engine: summed
    busy over summed admitted amounts (block-seconds, as the admission measures them; any
    unit works if both use it).

    ``max_sessions``: the window of recently ended sessions (the control plane's other
    windows' size, e.g. :class:`~mars.policy.control.growth.ContextGrowth`).
    ``min_sessions``: sessions (ended, or live with a call submitted) needed before it
    claims less than 1 (as the growth forecast's: a ratio over 8 sessions)."""

    def __init__(self, max_sessions: int = 512, min_sessions: int = 8) -> None:
        if max_sessions < 1 or min_sessions < 1:
            raise ValueError("max_sessions and min_sessions must be >= 1")
        self.min_sessions = min_sessions
        #: (busy, admitted) of each ended session
        self._ended: deque[tuple[float, float]] = deque(maxlen=max_sessions)
        self._sum_busy = 0.0
        self._sum_life = 0.0

    def observe(self, busy_s: float, life_s: float) -> None:
        """A session ended after ``life_s`` (block-)seconds admitted, ``busy_s`` of them
        with a call in the engine."""
        if not (math.isfinite(busy_s) and math.isfinite(life_s)) or life_s <= 0 or busy_s < 0:
            return
        if len(self._ended) == self._ended.maxlen:
            old_b, old_l = self._ended[0]
            self._sum_busy -= old_b
            self._sum_life -= old_l
        sample = (min(busy_s, life_s), life_s)
        self._ended.append(sample)
        self._sum_busy += sample[0]
        self._sum_life += sample[1]

    def __len__(self) -> int:
        return len(self._ended)

    def share(self, live: Iterable[tuple[float, float]] = ()) -> float:
        """The share over the ended sessions and ``live`` ones (``(busy so far, life so far)``
        of each admitted session that has submitted a call); 1 until ``min_sessions``
        count."""
        busy, life, n = self._sum_busy, self._sum_life, len(self._ended)
        for b, t in live:
            if t > 0 and math.isfinite(b) and math.isfinite(t):
                busy += min(max(0.0, b), t)
                life += t
                n += 1
        if n < self.min_sessions or life <= 0 or busy <= 0:
            return 1.0  # (no engine time seen at all: no evidence, not a share of 0)
        return min(1.0, max(0.0, busy / life))


class ResidentShare(Footprint):
    """The admitted contexts (``inner``, the growth projection) as the pool must hold them
    when only the sessions with a call in the engine need theirs resident: ``share`` of each
    block, and at least what the host pool cannot hold (``whole - host_blocks``: a context
    the host has no room for stays in GPU memory or is recomputed, as without a host tier).
    Never more than the whole, so a host tier never admits less than none would. Charges are
    rounded up."""

    __slots__ = ("_inner", "_share", "_host")

    def __init__(self, inner: "Projection", share: float,
                 host_blocks: int | None = None) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self._inner = inner
        self._share = share
        self._host = host_blocks

    @property
    def share(self) -> float:
        """The engine share each admitted context is charged at."""
        return self._share

    @property
    def whole(self) -> "Projection":
        """The projected contexts charged whole (the wrapped projection itself: once it is
        taken, this wrapper is not to be packed against)."""
        return self._inner

    @property
    def whole_peak(self) -> int:
        """The projected contexts' peak, whole (what the host must hold)."""
        return self._inner.peak

    def _resident(self, whole: int) -> int:
        need = self._share * whole
        if self._host is not None:
            need = max(need, whole - self._host)
        return math.ceil(need - 1e-9)

    @property
    def peak(self) -> int:
        return self._resident(self._inner.peak)

    def rise(self, blocks: int) -> int:
        return self._resident(self._inner.peak + self._inner.rise(blocks)) - self.peak

    def add(self, blocks: int) -> int:
        before = self.peak
        self._inner.add(blocks)
        return self.peak - before
