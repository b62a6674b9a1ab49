"""StepStats: the engine's measured decode step time and marginal prefill rate."""

from __future__ import annotations

import pytest

from mars.policy.engine.step_stats import StepStats


def _world(chunk: int, decodes: int = 6, fixed: float = 0.015, rate: float = 20_000.0):
    """A step on a GPU whose every step costs ``fixed`` (weights) plus its prefill's work."""
    return chunk + decodes, decodes + (1 if chunk else 0), fixed + chunk / rate


def test_the_prefill_rate_is_marginal():
    """Small chunks riding on decode steps, as the coordinator's bounded prefills do: the
    rate over the whole step would charge the fixed per-step cost to the prefill (256 tokens
    in 27.8 ms: 9.2K tok/s); the marginal rate is the prefill's own, whatever the chunk."""
    st = StepStats(min_prefill_tokens=16)
    st.observe(*_world(0))                      # decode step: 15 ms
    for chunk in (8192, 256, 64, 1024) * 20:
        st.observe(*_world(chunk))
        st.observe(*_world(0))
    assert st.decode_step_s == pytest.approx(0.015)
    assert st.prefill_tokens_per_s == pytest.approx(20_000, rel=0.01)


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
