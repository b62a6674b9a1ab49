"""Three places for a paused session's KV (issue #35): pinned in GPU memory, parked in host
memory and read back before the tool returns, or dropped and recomputed.

MARS's two-place rule (:mod:`mars.policy.engine.retention`) weighs a warm resume against the
price of the GPU memory a pin holds. Host memory adds a third answer that is often better
than both: write the blocks out while the tool runs (the link, not the SMs, does the work),
free the GPU memory, and read them back early enough that the round finds them resident.
The published gains for agents come from that *timing* -- Tokencake (arXiv 2510.18586)
offloads during tool calls and uploads before the predicted return, KVFlow (arXiv 2507.07400)
prefetches by steps-to-execution -- and InferCept (ICML 2024) already chose among discard,
preserve and swap by the waste each causes. This module is the choice, sans IO: what it is
told (the pool's pressure, the link's measured bandwidth and backlog, the host pool's room,
the tool's observed durations, the measured prefill rate) and what it answers (a place, how
long to pin, when to start the read-back). Moving blocks is vLLM's (its offloading
connector); deciding is ours.

Every option is priced in the same unit, expected seconds, against the same duration
distribution ``D`` of the tool (conditioned on the ``e`` seconds it has already run):

* **dropped**: the next round recomputes the context, ``R = C / prefill rate``.
* **pinned** for ``tau`` (the two-place rule's own ``tau``): ``P(D > tau) R`` (the pin
  lapses before the return) plus the memory's price ``p B E[min(D, tau)]`` (``p``: the
  pool's congestion price per block-second, :func:`~mars.policy.engine.retention.block_price`).
* **host**, read-back started ``s`` seconds into the tool: the write takes ``w = backlog +
  latency + bytes / d2h``, and the blocks stay on the GPU until it lands (``p B w``); a round
  that returns first finds them there. Then the read takes ``r = latency + bytes / h2d``: a
  round returning at ``D >= s`` waits ``max(0, s + r - D)``, one returning before the read
  started waits ``r``, and the read-back blocks are held from ``s`` until the return
  (``p B E[(D - s)+]``). ``s`` is chosen over the tool's own duration quantiles (less ``r``)
  and "at the return", so it follows the distribution, not a constant. Host memory that
  cannot hold the blocks rules the place out, and so does a write that no return outlasts
  (the blocks would never leave the GPU: that is a pin, and the two-place rule prices pins).

The cheapest wins; ties go to the two-place answer, so with no host tier (or no link) the
rule *is* the two-place rule -- three places can only add an option, never change what the
other two would have done.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from mars.policy.engine.base import KvPressure, PinCandidate
from mars.policy.engine.retention import CostBenefitRetention

#: quantiles of the exponential prior used as its samples (memoryless: the same at any
#: elapsed time, shifted)
_PRIOR_POINTS = 64
#: at most this many quantiles of the observed durations are priced: the read-back search is
#: O(points^2), about a millisecond per decision in Python at 64
_MAX_POINTS = 64


@dataclass(frozen=True, slots=True)
class HostLink:
    """The host-device link as measured on the card (bytes per second each way, and the fixed
    cost of one transfer). Scale-dependent numbers come from a measurement or a cited
    datasheet, never a default: there is none here."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of bytes per second, "
                                 f"got {v!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")

    def write_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.d2h_bytes_per_s

    def read_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.h2d_bytes_per_s


@dataclass(slots=True)
class HostPool:
    """The host tier as the adapter sees it when it asks: ``used_bytes`` excludes the
    candidate's own blocks (it is asked about blocks still on the GPU, as :class:`KvPressure`
    describes the pool with them held)."""

    capacity_bytes: int
    used_bytes: int = 0
    #: seconds of transfers already queued on the link ahead of a new write
    link_backlog_s: float = 0.0

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0 or self.used_bytes < 0 or self.link_backlog_s < 0:
            raise ValueError("host pool sizes and backlog must be >= 0")

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes


class Place(str, enum.Enum):
    """Where a paused session's KV is (a ``str`` enum: its value is what logs and events say)."""

    PINNED = "pinned"
    HOST = "host"
    DROPPED = "dropped"


@dataclass(frozen=True, slots=True)
class Placement:
    """The answer for one candidate, with every option's price (for logs and the dashboard)."""

    place: Place
    #: PINNED: seconds to hold the pin (the two-place rule's tau), measured from now
    pin_s: float = 0.0
    #: HOST: seconds from now to start the read-back (``math.inf``: when the round arrives)
    read_in_s: float = math.inf
    #: expected cost of each option considered, seconds, keyed by the place's value (as logs
    #: and events carry it)
    costs: dict[str, float] = field(default_factory=dict)


class ThreePlaceRetention:
    """The choice among the three places for one candidate. Holds no state of its own beyond
    the two-place rule it extends (the duration model, the prefill rate, the pins)."""

    def __init__(self, two_place: CostBenefitRetention, link: HostLink | None,
                 block_bytes: int) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes!r}")
        self.two_place = two_place
        self.link = link
        self.block_bytes = block_bytes

    # ------------------------------------------------------------------ distribution
    def durations_left(self, tool: str | None, elapsed: float) -> list[float]:
        """Samples of the time left until the tool returns, given it has run ``elapsed`` s:
        the observed durations past ``elapsed`` (less it), or the prior's quantiles."""
        dm = self.two_place.durations
        src = dm.source(tool)
        if src == "prior":
            mean = dm.prior_mean_s
            return [-mean * math.log(1 - (i + 0.5) / _PRIOR_POINTS)
                    for i in range(_PRIOR_POINTS)]
        s = dm.sorted_samples(tool if src == "tool" else None)
        # at admission every sample counts (a 0 s tool returns at once); later, the peers
        # still running
        left = [d - elapsed for d in s if d > elapsed or elapsed == 0.0]
        # a tool that has outlived every peer: no knowledge of when it returns; the two-place
        # rule answers 0 here (do not bet memory on it), and so must the host's read-back
        if len(left) > _MAX_POINTS:  # evenly spaced quantiles: the choice is O(points^2)
            n = len(left)
            left = [left[min(n - 1, int((i + 0.5) * n / _MAX_POINTS))]
                    for i in range(_MAX_POINTS)]
        return left

    # ------------------------------------------------------------------ prices
    def host_cost(self, nbytes: float, blocks: int, price: float, left: list[float],
                  backlog_s: float = 0.0) -> tuple[float, float]:
        """(expected cost, read-back start from now) of parking ``nbytes`` on the host."""
        if self.link is None:
            raise ValueError("no host link: the host place is not available")
        w = backlog_s + self.link.write_s(nbytes)
        r = self.link.read_s(nbytes)
        n = len(left)
        hold_w = price * blocks * sum(min(d, w) for d in left) / n

        def cost(s: float) -> float:
            wait = hold = 0.0
            for d in left:
                if d < w:
                    continue  # the blocks were still on the GPU
                if d < s:
                    wait += r  # the read had not started: all of it is on the path
                else:
                    wait += max(0.0, s + r - d)
                    hold += d - s
            return hold_w + (wait + price * blocks * hold) / n

        best_s, best = math.inf, cost(math.inf)
        for d in sorted(set(left)):
            s = max(w, d - r)
            c = cost(s)
            if c < best - 1e-12:
                best_s, best = s, c
        return best, best_s

    def pin_cost(self, tau: float, recompute_s: float, blocks: int, price: float,
                 left: list[float]) -> float:
        """The expected cost of a pin of ``tau`` s: recompute when the tool outlasts it, and the
        memory's price while it is held (until the return or ``tau``)."""
        if not left:
            return recompute_s
        n = len(left)
        lapse = sum(1 for d in left if d > tau) / n
        return lapse * recompute_s + price * blocks * sum(min(d, tau) for d in left) / n

    # ------------------------------------------------------------------ the choice
    def admit(self, cand: PinCandidate, kv: KvPressure, host: HostPool | None,
              now: float) -> Placement:
        """Where ``cand``'s blocks go when its round ends (``kv``: the pool with them held,
        the two-place rule's contract). Records the two-place pin as its ``admit`` does, and
        forgets it when the host wins."""
        tau = self.two_place.admit(cand, kv, now)
        return self._choose(cand, kv, host, now, tau)

    def reconsider(self, cand: PinCandidate, kv: KvPressure, host: HostPool | None,
                   now: float) -> Placement:
        """While the tool runs, for blocks still on the GPU (pinned, or never placed): the same
        choice from what is left of the tool, the pin's remaining horizon as the two-place
        ``keep`` judges it (no recorded pin: none to keep). A session already parked on the
        host is not asked again: its read-back time was set when it was parked."""
        two = self.two_place
        tau = two.tau_of(cand.session_id)
        if tau is None:
            tau = 0.0
        else:
            tau = max(0.0, tau - max(0.0, now - cand.started)) \
                if two.keep(cand, kv, now) else 0.0
        return self._choose(cand, kv, host, now, tau)

    def _choose(self, cand: PinCandidate, kv: KvPressure, host: HostPool | None, now: float,
                tau: float) -> Placement:
        two = self.two_place
        elapsed = max(0.0, now - cand.started)
        recompute = two.prefill.recompute_s(cand.context_tokens)
        costs = {Place.DROPPED.value: recompute}
        if cand.blocks <= 0:
            return Placement(Place.DROPPED, costs=costs)
        left = self.durations_left(cand.tool, elapsed)
        price = two.price(kv)
        if tau > 0:
            costs[Place.PINNED.value] = self.pin_cost(tau, recompute, cand.blocks, price, left)
        choice = Placement(Place.PINNED, pin_s=tau, costs=costs) if tau > 0 \
            else Placement(Place.DROPPED, costs=costs)
        nbytes = cand.blocks * self.block_bytes
        if self.link is None or host is None or not left or not host.fits(nbytes):
            return choice
        w = host.link_backlog_s + self.link.write_s(nbytes)
        if max(left) < w:
            return choice  # every return beats the write: the blocks would never leave
        hc, read_in = self.host_cost(nbytes, cand.blocks, price, left, host.link_backlog_s)
        costs[Place.HOST.value] = hc
        if hc < min(costs.get(Place.PINNED.value, math.inf), recompute) - 1e-9:
            if tau > 0:
                two.forget(cand.session_id)
            return Placement(Place.HOST, read_in_s=read_in, costs=costs)
        return choice
