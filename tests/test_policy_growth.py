"""ContextGrowth (mars.policy.control.growth): the expected peak of the admitted contexts' sum."""

from __future__ import annotations

import math
import random

import pytest

from mars.policy.control.growth import ContextGrowth


def brute_peak(samples: list[tuple[int, int]], sessions: list[tuple[int, int]]) -> int:
    """max over k of sum_i E[(b_i + k g) 1{R >= r_i + k} | R >= r_i], straight from the
    definition; ``samples``: (rounds, total growth) of ended sessions."""
    per = [(r, (g / (r - 1) if r > 1 else 0.0)) for r, g in samples]
    top = max(r for r, _ in per)
    now = sum(b for b, _ in sessions)
    best = float(now)
    for k in range(1, top + 1):
        total = 0.0
        for b, r in sessions:
            alive = [g for R, g in per if R >= r]
            if not alive:
                total += b
                continue
            total += sum(b + k * g for R, g in per if R >= r + k) / len(alive)
        best = max(best, total)
    return max(now, math.ceil(best))


def test_no_forecast_before_enough_sessions_ended():
    g = ContextGrowth(min_samples=3)
    g.observe(10, 900)
    g.observe(10, 900)
    assert g.peak([(100, 1), (50, 4)]) == 150 and g.session_peak(100) == 100
    g.observe(10, 900)
    # every session: 10 rounds, +100 blocks a round; a new one peaks at its 10th round
    assert g.session_peak(100) == 100 + 9 * 100
    # the sum peaks when the older one sends its last (10th) round, the younger its 7th
    assert g.peak([(100, 1), (50, 4)]) == (100 + 6 * 100) + (50 + 6 * 100)


def test_peak_matches_its_definition():
    rng = random.Random(7)
    samples = [(max(1, int(rng.lognormvariate(2.5, 0.6))), int(rng.lognormvariate(6, 1.0)))
               for _ in range(200)]
    g = ContextGrowth(min_samples=1, dense_points=10_000)  # every round: the exact peak
    for r, growth in samples:
        g.observe(r, growth)
    for trial in range(20):
        sessions = [(rng.randint(0, 3000), rng.randint(1, 60)) for _ in range(rng.randint(1, 8))]
        assert g.peak(sessions) == brute_peak(samples, sessions), sessions
    # read on a coarse grid the peak can only be missed by a little, never overstated
    coarse = ContextGrowth(min_samples=1, dense_points=5)
    for r, growth in samples:
        coarse.observe(r, growth)
    sessions = [(500, 1), (2000, 3), (100, 10)]
    assert sum(b for b, _ in sessions) <= coarse.peak(sessions) <= g.peak(sessions)


def test_sessions_that_end_before_they_grow_are_charged_nothing():
    """Short sessions that grow little: the chance each has ended outweighs its growth, so
    the expected sum never rises above the latest prompts (the generator's ILR regimes)."""
    g = ContextGrowth(min_samples=1)
    for r in [1, 1, 2, 3, 4, 6, 8, 10]:
        g.observe(r, 20 * (r - 1))  # +20 blocks a round on ~2,000-block contexts
    sessions = [(2000, 1), (1800, 2), (2500, 3)]
    assert g.peak(sessions) == 6300
    assert g.session_peak(2000) == 2000
    flat = ContextGrowth(min_samples=1)
    for _ in range(5):
        flat.observe(40, 0)
    assert flat.peak([(100, 1), (100, 20)]) == 200


def test_long_growing_sessions_are_charged_their_growth():
    """Long sessions whose context grows several-fold (held-out swe-long): a new one is
    charged far more than its first prompt, and young admitted ones more than their sum."""
    g = ContextGrowth(min_samples=1)
    for r in range(40, 61):
        g.observe(r, 50 * (r - 1))  # 40-60 rounds, +50 blocks a round from ~500
    assert g.session_peak(500) > 3 * 500
    young = [(500, 1), (600, 2), (550, 3)]
    assert g.peak(young) > 3 * sum(b for b, _ in young)
    # one that has outlived every ended session: counted as it is, no growth or end assumed
    assert g.peak([(3000, 61)]) == 3000
    assert g.peak([(3000, 61), (500, 1)]) == 3000 + g.session_peak(500)
    assert g.peak([(3000, 70), (500, 1)]) == 3000 + g.session_peak(500)


def test_one_very_long_session_does_not_blur_the_others():
    """The look-ahead is read round by round over the first rounds and geometrically beyond:
    one session that ran for thousands of rounds neither hides the peak of sessions that
    grow over tens of rounds nor makes a query cost thousands of points."""
    exact = ContextGrowth(min_samples=1, dense_points=100_000)
    g = ContextGrowth(min_samples=1)
    for r in range(40, 61):
        for x in (exact, g):
            x.observe(r, 100 * (r - 1))
    admitted = [(500 + 100 * i, 1 + i) for i in range(5)]
    want = exact.peak(admitted)
    assert g.peak(admitted) == want > sum(b for b, _ in admitted)
    for x in (exact, g):
        x.observe(5000, 0)  # an outlier: 5,000 rounds, no growth
    assert g.peak(admitted) == exact.peak(admitted)
    assert len(g._build().grid) < 64 + 60  # 64 rounds, then ~10 % steps to 5,000
    assert g._build().grid[-1] == 5000  # the grid reaches the longest session


def test_the_window_forgets_the_oldest_and_bad_values_are_ignored():
    g = ContextGrowth(max_samples=4, min_samples=1)
    for _ in range(4):
        g.observe(11, 1000)
    assert g.session_peak(0) == 1000
    for _ in range(4):
        g.observe(11, 10)
    assert g.session_peak(0) == 10  # the fast growers of earlier are forgotten
    for bad in [(0, 5), (-1, 5), (3, float("nan")), (3, float("inf")), (2.5, 5)]:
        g.observe(*bad)
    assert len(g) == 4
    g.observe(3, -50)  # a context that shrank (summarised) grew by nothing
    assert len(g) == 5 - 1  # the window holds 4: one of the 10-block growers made room
    assert g.session_peak(0) == math.ceil((3 * 10 + 0) / 4)  # its peak: at the 11th round


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        ContextGrowth(max_samples=0)
    with pytest.raises(ValueError):
        ContextGrowth(min_samples=0)
    with pytest.raises(ValueError):
        ContextGrowth(dense_points=0)


def test_a_projection_charges_what_a_session_raises_the_peak_by():
    """The packer adds its picks one by one to the admitted sessions' projection; each is
    charged the rise of the expected peak, which is less than its own peak when its growth
    comes after older sessions are expected to have ended."""
    g = ContextGrowth(min_samples=1)
    for _ in range(4):
        g.observe(3, 200)  # 3 rounds, +100 blocks a round
    proj = g.project([(250, 2)])  # one round to go: 350 next round, then gone
    assert proj.peak == 350
    assert g.session_peak(500) == 700
    assert proj.rise(500) == (350 + 600) - 350  # its second round with the other's last
    assert proj.peak == 350  # rise() changes nothing
    assert proj.add(500) == 600 and proj.peak == 950
    assert proj.rise(0) == 100  # an empty one adds its second round's growth to that peak
    # without a forecast the projection is the plain sum
    off = ContextGrowth(max_samples=1, min_samples=2)
    p = off.project([(250, 2), (100, 1)])
    assert p.peak == 350 and p.rise(500) == 500 and p.add(40) == 40 and p.peak == 390
    # a projection made before the forecast was ready cannot price sessions after it
    early = ContextGrowth(min_samples=2)
    early.observe(3, 200)
    stale = early.project([(250, 2)])
    early.observe(3, 200)
    with pytest.raises(ValueError):
        stale.rise(10)
