"""Admission headroom (framework-free)."""

from __future__ import annotations

import pytest

from mars.policy.engine.headroom import AdmissionHeadroom
from mars.policy.registry import POLICY_NAMES, get_policy


def test_reserve_is_growth_room_for_every_running_call():
    h = AdmissionHeadroom(tokens_per_running=8)
    assert h.reserve_blocks(running=0, block_size=32) == 0
    assert h.reserve_blocks(running=1, block_size=32) == 1   # ceil(8/32)
    assert h.reserve_blocks(running=30, block_size=32) == 8  # ceil(240/32)


def test_allows_only_with_room_left_and_always_when_idle():
    h = AdmissionHeadroom(tokens_per_running=8)
    # 30 running on 32-token blocks: keep 8 free
    assert h.allows(free_blocks=20, need_blocks=12, running=30, block_size=32)
    assert not h.allows(free_blocks=20, need_blocks=13, running=30, block_size=32)
    # nothing running: a call that fits is admitted (liveness)
    assert h.allows(free_blocks=5, need_blocks=5, running=0, block_size=32)
    # 0 = vLLM's rule
    assert AdmissionHeadroom(0).allows(free_blocks=5, need_blocks=5, running=99, block_size=32)


def test_rejects_negative():
    with pytest.raises(ValueError):
        AdmissionHeadroom(-1)


def test_registry_gives_headroom_to_the_co_scheduler_only():
    on = {n for n in POLICY_NAMES if get_policy(n).admit_headroom_tokens > 0}
    assert on == {"mars", "mars_no_coord", "mars_no_ctrl"}
    # the co-scheduler switches go together
    for n in POLICY_NAMES:
        spec = get_policy(n)
        assert (spec.admit_headroom_tokens > 0) == spec.chunk_shrink
