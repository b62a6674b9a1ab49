"""The emulated host-device link: when a KV transfer between GPU and host memory finishes.

An offloaded block moves over the card's PCIe link by its copy engines, not its SMs, so a
transfer does not lengthen an engine step: it occupies the link. Each direction is a queue
of its own (PCIe is full duplex and the copy engines of each direction run independently),
served in submission order at the measured bandwidth, after a fixed cost per transfer. A
transfer submitted while the link is busy starts when the one before it ends. That is all the
emulation claims: no contention with HBM traffic (the link's 55-64 GB/s is under 2 % of HBM
bandwidth), no NUMA effects.

Sans IO: time comes in as an argument, completions are returned to whoever asks; vLLM's
offloading worker (:mod:`mars.engine.executor.offload`) and ``mars sim`` drive it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from mars.policy.engine.host_tier import HostLink

#: directions, as vLLM's offloading worker names its two kinds of job
STORE = "store"  # GPU -> host (device to host)
LOAD = "load"  # host -> GPU (host to device)


@dataclass(slots=True)
class LinkStats:
    """What crossed the link, each way (for results: bytes moved and time the link was busy)."""

    bytes: dict[str, int] = field(default_factory=lambda: {STORE: 0, LOAD: 0})
    transfers: dict[str, int] = field(default_factory=lambda: {STORE: 0, LOAD: 0})
    busy_s: dict[str, float] = field(default_factory=lambda: {STORE: 0.0, LOAD: 0.0})
    #: seconds transfers waited for the link to come free (queueing behind earlier ones)
    queued_s: dict[str, float] = field(default_factory=lambda: {STORE: 0.0, LOAD: 0.0})

    def as_dict(self) -> dict:
        return {"bytes": dict(self.bytes), "transfers": dict(self.transfers),
                "busy_s": dict(self.busy_s), "queued_s": dict(self.queued_s)}


class HostLinkTimeline:
    """The link's two queues. ``submit`` says when a transfer ends; ``finished(now)`` hands
    back, once, every transfer ended by ``now``; ``next_done()`` is when the next one ends
    (what a simulator advances its clock to when only transfers are left to wait for)."""

    def __init__(self, link: HostLink) -> None:
        self.link = link
        self._free_at = {STORE: -math.inf, LOAD: -math.inf}
        #: (done_at, seq, job) not yet handed back
        self._pending: list[tuple[float, int, object]] = []
        #: transfers not yet handed back, per direction
        self._open = {STORE: 0, LOAD: 0}
        self._direction: dict[object, str] = {}
        #: when the latest transfer submitted in each direction ends
        self.last_done = {STORE: -math.inf, LOAD: -math.inf}
        self._seq = 0
        self._done_at: dict[object, float] = {}
        self.stats = LinkStats()

    def submit(self, job: object, direction: str, nbytes: int, now: float) -> float:
        if direction not in (STORE, LOAD):
            raise ValueError(f"unknown direction {direction!r}")
        if nbytes < 0:
            raise ValueError(f"a transfer of {nbytes} bytes")
        if job in self._done_at:
            raise ValueError(f"transfer {job!r} submitted twice")
        link = self.link
        start = max(now, self._free_at[direction])
        took = link.write_s(nbytes) if direction == STORE else link.read_s(nbytes)
        done = start + took
        self._free_at[direction] = done
        st = self.stats
        st.bytes[direction] += nbytes
        st.transfers[direction] += 1
        st.busy_s[direction] += took
        st.queued_s[direction] += start - now
        self._seq += 1
        heapq.heappush(self._pending, (done, self._seq, job))
        self._done_at[job] = done
        self._direction[job] = direction
        self._open[direction] += 1
        self.last_done[direction] = done
        return done

    def done_at(self, job: object) -> float | None:
        """When a transfer not yet handed back ends (None: unknown, or already handed back)."""
        return self._done_at.get(job)

    def finished(self, now: float) -> list[tuple[object, float]]:
        """(transfer, when it ended) for every transfer ended by ``now``, in order of end."""
        out = []
        pend = self._pending
        while pend and pend[0][0] <= now:
            done, _, job = heapq.heappop(pend)
            del self._done_at[job]
            self._open[self._direction.pop(job)] -= 1
            out.append((job, done))
        return out

    def next_done(self) -> float | None:
        return self._pending[0][0] if self._pending else None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def in_flight_of(self, direction: str) -> int:
        """Transfers of one direction not yet handed back."""
        return self._open[direction]
