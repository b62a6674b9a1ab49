"""The served engine's step log (``mars.emulate.step_log``) and what it is for: measuring how
fast the machine ran a real run, and a profile slowed to that speed."""

from __future__ import annotations

import math

import pytest

from mars.emulate.fit import Measured
from mars.emulate.profile import DeviceProfile, EngineSettings
from mars.emulate.specs import GPUS, hf_config
from mars.emulate.step_log import StepLogWriter, read_step_log, speed_factor, step_errors
from mars.emulate.step_time import StepCoefficients, StepTimeModel


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_steps_are_logged_schedule_to_schedule_and_flushed_when_idle(tmp_path):
    path = tmp_path / "steps.jsonl"
    clock = _Clock()
    log = StepLogWriter(path, flush_every=100, clock=clock)
    clock.t = 10.0
    log.end()  # schedule() begins (monotonic clock 10.0)
    clock.t = 10.001
    log.begin(1000.0, [[2048, 0]])  # ... and scheduled this batch
    clock.t = 10.5
    log.end()  # the next schedule() begins: the first step took 0.5 s
    log.begin(1000.5, [[1, 2048], [512, 0]])
    log.finished_one()
    clock.t = 10.6
    log.end(idle=True)  # the engine went idle after its bookkeeping: written out now
    clock.t = 11.0
    log.end()  # nothing open: nothing logged
    steps = read_step_log(path)
    assert [s.batch for s in steps] == [((2048, 0),), ((1, 2048), (512, 0))]
    assert [s.seconds for s in steps] == [pytest.approx(0.5), pytest.approx(0.1)]
    assert [s.finished for s in steps] == [0, 1]
    assert [s.kind for s in steps] == ["prefill", "mixed"]
    log.begin(1002.0, [[1, 10]])
    log.close()  # an open step at shutdown has no end: not logged
    assert len(read_step_log(path)) == 2


def test_buffer_is_written_when_full(tmp_path):
    path = tmp_path / "steps.jsonl"
    clock = _Clock()
    log = StepLogWriter(path, flush_every=3, clock=clock)
    for i in range(5):
        clock.t = float(i)
        log.end()
        log.begin(float(i), [[1, 100]])
    assert len(read_step_log(path)) == 3  # three closed steps, written without going idle
    log.close()


def _profile() -> DeviceProfile:
    return DeviceProfile(name="x", gpu=GPUS["h100"], model_config=hf_config(
        "qwen3-coder-30b-a3b"), coefficients=StepCoefficients(
            cache_bytes=2**20, cache_bandwidth_ratio=3.0, attention_parallelism=64.0),
        engine=EngineSettings(16, 8192, 256, 32768, 2**30))


def test_a_slowed_profile_takes_exactly_factor_times_each_step():
    prof = _profile()
    base = StepTimeModel(prof.model, prof.gpu, prof.coefficients)
    slow = prof.slowed(1.37)
    m = StepTimeModel(slow.model, slow.gpu, slow.coefficients)
    for batch in ([(1, 100)], [(1, 30_000)] * 64, [(8192, 0)], [(2048, 10_000), (1, 5)] * 3):
        assert m.step_time(batch) == pytest.approx(1.37 * base.step_time(batch), rel=1e-9)
    assert slow.slowed(2.0).fit["slowed_by"] == pytest.approx(2.74)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="speed factor"):
            prof.slowed(bad)


def test_speed_factor_is_measured_over_predicted_time():
    prof = _profile()
    m = StepTimeModel(prof.model, prof.gpu, prof.coefficients)
    batches = [((1, 1000),), ((1, 5000),) * 8, ((4096, 0),)]
    steps = [Measured(b, 1.5 * m.step_time(b)) for b in batches]
    assert speed_factor(m, steps) == pytest.approx(1.5)
    assert all(abs(e) < 1e-9 for e in step_errors(m, steps, 1.5))
    assert math.isnan(speed_factor(m, []))
