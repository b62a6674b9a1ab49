"""llm-d's finding as a test of ours (issue #35): pinning whole contexts can lower the
prefix-cache hit rate below plain LRU's, and MARS's retention does not.

llm-d's agentic benchmark protected main-agent turns' whole contexts for their predicted
gap and measured the hit rate fall from 93 % (LRU) to 79 %: the protected contexts filled
the pool, and the subagents' contexts, about to be re-read, were what was left to evict.
The scenario of ``experiments/llmd_retention.py`` has that shape (main sessions with 20-30 s
gaps, subagents re-read every 3 s, a pool that holds one or the other); every policy runs it
through vLLM's real scheduler and KV manager on the emulated GPU, in virtual time
(deterministic). The test fails if the scenario stops reproducing the finding (llm-d's rule
not below LRU), if pins that yield oldest-first fall below LRU, or if MARS -- with its
admission, or its in-engine rules alone -- does, at this pool (at the largest pool of the
results table its in-engine rules alone are level with LRU: -0.02 points)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

_PATH = Path(__file__).resolve().parents[1] / "experiments" / "llmd_retention.py"
_spec = importlib.util.spec_from_file_location("llmd_retention", _PATH)
llmd = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = llmd
_spec.loader.exec_module(llmd)

#: the pool (blocks of 16 tokens): the subagents' working set or the mains' contexts fit,
#: not both
POOL = 5000


def test_whole_context_pins_lower_the_hit_rate_under_lrus_and_mars_does_not():
    trace = llmd.scenario()
    rows = {name: llmd.run(name, POOL, trace)
            for name in ("fcfs", "kv_hint", "kv_hint_all", "mars", "mars_no_ctrl")}
    for r in rows.values():  # every task done, every pin back
        assert r["done"] == r["tasks"] == len(trace.tasks), r
        assert r["pinned_at_end"] == 0, r
    hit = {name: r["hit"] for name, r in rows.items()}
    lru = hit["fcfs"]
    # llm-d's finding reproduces: the protected main contexts crowd out the subagents'
    # (measured 41.6 % against LRU's 77.6 %)
    assert hit["kv_hint"] < lru - 0.10, hit
    # the same rule marking every round: pins yield oldest first, in LRU's order (82.5 %)
    assert hit["kv_hint_all"] >= lru, hit
    # MARS: its in-engine rules alone (85.5 %), and with its admission (93.6 %)
    assert hit["mars_no_ctrl"] >= lru, hit
    assert hit["mars"] >= lru, hit
    # ... each of them pinning (a rule that stopped pinning would match LRU, not beat it)
    assert rows["fcfs"]["pins"] == 0
    for name in ("kv_hint", "kv_hint_all", "mars", "mars_no_ctrl"):
        assert rows[name]["pins"] > 0, rows[name]
