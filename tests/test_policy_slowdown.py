"""Tool slowdown (``mars.policy.control.slowdown``): contention shows, a tool's own variance does not."""

from __future__ import annotations

import math
import random

from mars.policy.control.slowdown import ToolSlowdown


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def test_heavy_tailed_tools_without_contention_show_no_slowdown():
    """Recorded agent tools vary a hundredfold within a type (log-sd 1.3-2.3 in the ILR
    traces); with nothing slowing them, the estimate stays at 1."""
    rng = random.Random(0)
    sd = ToolSlowdown()
    seen = []
    for _ in range(3000):
        tool = rng.choice(["terminal.run", "terminal.command", "terminal.search"])
        sd.observe(tool, _lognormal(rng, {"terminal.run": 1.0, "terminal.command": 0.3,
                                          "terminal.search": 0.1}[tool], 2.0))
        if sd.value is not None:
            seen.append(sd.value)
    assert seen and max(seen) < 2.0
    # an average of plain ratios over the same calls, as the signal was computed before,
    # crossed 2 (the band's enter threshold) on long calls alone
    rng = random.Random(0)
    base: dict[str, float] = {}
    ema, worst = None, 0.0
    for _ in range(3000):
        tool = rng.choice(["terminal.run", "terminal.command", "terminal.search"])
        d = _lognormal(rng, {"terminal.run": 1.0, "terminal.command": 0.3,
                             "terminal.search": 0.1}[tool], 2.0)
        if tool in base:
            r = d / base[tool]
            ema = r if ema is None else ema + 0.2 * (r - ema)
            worst = max(worst, ema)
        base[tool] = d if tool not in base else base[tool] + 0.02 * (d - base[tool])
    assert worst > 2.0


def test_a_narrow_tool_slowed_twofold_shows_it_within_a_few_calls():
    rng = random.Random(1)
    sd = ToolSlowdown()
    for _ in range(200):
        sd.observe("pytest", _lognormal(rng, 20.0, 0.1))
    assert sd.value == 1.0
    for n in range(1, 40):
        sd.observe("pytest", _lognormal(rng, 40.0, 0.1))
        if sd.value is not None and sd.value >= 1.6:
            break
    # (the baseline slowly absorbs a lasting slowdown, as it should: it reads ~1.7-1.8x)
    assert n <= 15 and 1.6 <= sd.value <= 2.2


def test_unknown_until_sampled_and_short_tools_ignored():
    sd = ToolSlowdown(min_samples=10, min_duration_s=0.05)
    assert sd.value is None and sd.standard_error is None
    for _ in range(50):
        sd.observe("ls", 0.002)  # below min_duration_s: jitter, not contention
        sd.observe("x", float("nan"))
        sd.observe("x", -1.0)
    assert sd.value is None and sd.samples == 0
    for _ in range(10):
        sd.observe("make", 3.0)
    assert sd.value is None  # the baseline needs min_samples first
    sd.observe("make", 3.0)
    assert sd.value == 1.0 and sd.samples == 1


def test_a_rare_heavy_tool_among_narrow_ones_is_not_a_slowdown():
    """The standard error carries each sample's own type variance: one call of a type that
    varies a hundredfold, after a run of narrow calls, is weighed by its type's spread, not by
    the narrow ones' (a pooled variance x sum of squared weights gave 0.35 where the error is
    0.47, and a 3.3-sigma call of the heavy type -- one in ~2,000 -- crossed 4 "errors")."""
    rng = random.Random(2)
    sd = ToolSlowdown()
    for _ in range(200):
        sd.observe("heavy", _lognormal(rng, 1.0, 2.3))
    for _ in range(60):
        sd.observe("narrow", _lognormal(rng, 5.0, 0.3))
    heavy = sd._types["heavy"]
    sd.observe("heavy", math.exp(heavy.mean + 3.3 * math.sqrt(heavy.var)))
    assert sd.value == 1.0
