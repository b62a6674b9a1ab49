"""Pinned KV retention mechanism: hold a finished round's blocks while its agent runs a tool.

Mechanism only; *whether* and *how long* to pin is the retention policy's call
(``mars.policy.engine.retention``), *when to let go* is the co-scheduler's
(:mod:`mars.engine.sched.coscheduler`). A pin keeps the block references that vLLM's
``KVCacheManager.pop_blocks_for_free`` detached from the finished request, so the blocks stay
out of the free queue (and so out of eviction) with their prefix-cache hashes intact. The
next round of the same session then hits them through vLLM's ordinary prefix-cache lookup.
Releasing a pin hands the blocks to ``BlockPool.free_blocks`` exactly as vLLM would have at
the end of the round, tail first, so nothing leaks and eviction order is unchanged.

Accounting: two sessions' pins may hold the same shared-prefix blocks (one reference each).
:attr:`PinTable.pinned_blocks` counts *distinct* blocks held by at least one pin, so
``pinned <= total`` always holds; a pin's price is charged only for the blocks that no other
request or pin held when it was taken (``PinCandidate.blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mars.policy.engine.base import PinCandidate


@dataclass(slots=True)
class PinnedRound:
    """The blocks of one session's finished round, held across its tool call."""

    cand: PinCandidate
    blocks: list[Any]
    tau_s: float
    pinned_at: float
    #: set when the session's next round arrived; released once that round is admitted
    resumed_by: str | None = None
    #: number of block references held (kept after release, for events)
    num_blocks: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_blocks = len(self.blocks)


class PinTable:
    def __init__(self, block_pool) -> None:
        self._pool = block_pool
        self._pins: dict[str, PinnedRound] = {}
        #: block id -> number of pins referencing it
        self._refs: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._pins

    @property
    def pinned_blocks(self) -> int:
        """Distinct blocks held by at least one pin."""
        return len(self._refs)

    def get(self, session_id: str) -> PinnedRound | None:
        return self._pins.get(session_id)

    def sessions(self) -> list[str]:
        return list(self._pins)

    def pins(self) -> list[PinnedRound]:
        return list(self._pins.values())

    def add(self, pin: PinnedRound) -> PinnedRound | None:
        """Pin; a previous pin of the same session is released and returned (for its event)."""
        old = self.release(pin.cand.session_id)
        self._pins[pin.cand.session_id] = pin
        refs = self._refs
        for b in pin.blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        return old

    def release(self, session_id: str) -> PinnedRound | None:
        pin = self._pins.pop(session_id, None)
        if pin is not None:
            refs = self._refs
            for b in pin.blocks:
                k = refs[b.block_id] - 1
                if k:
                    refs[b.block_id] = k
                else:
                    del refs[b.block_id]
            # pop_blocks_for_free returns allocation order; free tail first, as vLLM does
            self._pool.free_blocks(pin.blocks[::-1])
            pin.blocks = []
        return pin

    def block_ids(self) -> set[int]:
        return set(self._refs)
