"""Pinned KV retention mechanism: hold a finished round's blocks while its agent runs a tool.

Mechanism only; *whether* and *how long* to pin is the retention policy's call
(``mars.policy.retention``). A pin keeps the block references that vLLM's
``KVCacheManager.pop_blocks_for_free`` detached from the finished request, so the blocks stay
out of the free queue (and so out of eviction) with their prefix-cache hashes intact. The
next round of the same session then hits them through vLLM's ordinary prefix-cache lookup.
Releasing a pin hands the blocks to ``BlockPool.free_blocks`` exactly as vLLM would have at
the end of the round, tail first, so nothing leaks and eviction order is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mars.policy.base import PinCandidate


@dataclass(slots=True)
class Pin:
    cand: PinCandidate
    blocks: list[Any]
    tau_s: float
    pinned_at: float
    #: set when the session's next round arrived; released once that round is admitted
    resumed_by: str | None = None
    #: number of blocks held (kept after release, for events)
    num_blocks: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_blocks = len(self.blocks)


class PinTable:
    def __init__(self, block_pool) -> None:
        self._pool = block_pool
        self._pins: dict[str, Pin] = {}
        self.pinned_blocks = 0

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._pins

    def get(self, session_id: str) -> Pin | None:
        return self._pins.get(session_id)

    def sessions(self) -> list[str]:
        return list(self._pins)

    def add(self, pin: Pin) -> Pin | None:
        """Pin; a previous pin of the same session is released and returned (for its event)."""
        old = self._pins.pop(pin.cand.session_id, None)
        if old is not None:
            self.pinned_blocks -= old.num_blocks
            self.free(old)
        self._pins[pin.cand.session_id] = pin
        self.pinned_blocks += pin.num_blocks
        return old

    def release(self, session_id: str) -> Pin | None:
        pin = self._pins.pop(session_id, None)
        if pin is not None:
            self.pinned_blocks -= pin.num_blocks
            self.free(pin)
        return pin

    def free(self, pin: Pin) -> None:
        # pop_blocks_for_free returns allocation order; free tail first, as vLLM does
        self._pool.free_blocks(pin.blocks[::-1])
        pin.blocks = []

    def oldest_first(self) -> list[Pin]:
        return sorted(self._pins.values(), key=lambda p: p.pinned_at)
