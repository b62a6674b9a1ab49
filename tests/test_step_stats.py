"""StepStats: the engine's measured decode step time and marginal prefill rate."""

from __future__ import annotations

import pytest

from mars.policy.step_stats import StepStats


def _world(chunk: int, decodes: int = 6, fixed: float = 0.015, rate: float = 20_000.0):
    """A step on a GPU whose every step costs ``fixed`` (weights) plus its prefill's work."""
    return chunk + decodes, decodes + (1 if chunk else 0), fixed + chunk / rate


def test_the_bounded_chunk_does_not_spiral_down():
    """The coordinator bounds a low-priority prefill to ``interference_tokens(1)`` per step
    and the next samples are those bounded steps. With the rate taken over the whole step
    (the fixed cost charged to the prefill) the bound shrank every round; the marginal rate
    keeps it at one decode step's worth of prefill: fixed x rate = 300 tokens."""
    st = StepStats(min_prefill_tokens=16)
    st.observe(*_world(0))                      # decode step: 15 ms
    st.observe(*_world(8192, decodes=0))        # a big first chunk
    cap = st.interference_tokens(1.0)
    for _ in range(200):
        st.observe(*_world(cap))
        st.observe(*_world(0))
        cap = st.interference_tokens(1.0)
    assert st.decode_step_s == pytest.approx(0.015)
    assert st.prefill_tokens_per_s == pytest.approx(20_000, rel=0.01)
    assert cap == pytest.approx(300, rel=0.02)


def test_samples_and_noise():
    st = StepStats(min_prefill_tokens=16)
    # before a decode step is known the whole step is the prefill's
    assert st.observe(1000, 1, 0.05) == (999, 0.05)
    assert st.observe(0, 0, 1.0) is None and st.observe(5, 5, 0.0) is None
    assert st.observe(4, 4, 0.02) is None          # decode sample
    assert st.decode_step_s == pytest.approx(0.02)
    # a prefill step no slower than a decode step says nothing about the rate
    before = st.prefill_tokens_per_s
    assert st.observe(100, 2, 0.019) is None and st.prefill_tokens_per_s == before
    tok, added = st.observe(2004, 4, 0.12)
    assert tok == 2000 and added == pytest.approx(0.10)
