"""The timing harness's clock (mars.emulate.op_clock) when a CUDA-graph capture fails: an
operation that cannot run at all must not turn graphs off for everything timed after it.

No GPU here: a stand-in for the few ``torch.cuda`` calls the clock makes records what it was
asked to do (capture or launch), so the decision logic runs for real."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from mars.emulate.op_clock import DeviceClock


class _Event:
    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_Event") -> float:
        return 1.0  # ms


class _Cuda:
    """What DeviceClock calls on ``torch.cuda``; ``capturing`` is true inside a capture."""

    def __init__(self) -> None:
        self.capturing = False
        self.stream_resets = 0
        self.Event = _Event

    def Stream(self):
        return SimpleNamespace(wait_stream=lambda other: None)

    def current_stream(self):
        return SimpleNamespace(wait_stream=lambda other: None)

    def default_stream(self, device):
        return "default"

    def set_stream(self, stream) -> None:
        self.stream_resets += 1

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def stream(self, s):
        yield

    def CUDAGraph(self):
        return SimpleNamespace(replay=lambda: None)

    @contextlib.contextmanager
    def graph(self, g):
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False


def _clock():
    cuda = _Cuda()
    torch = SimpleNamespace(cuda=cuda)
    return DeviceClock(torch, SimpleNamespace(type="cuda")), cuda


def test_an_operation_that_cannot_run_leaves_capture_on_for_the_next_one():
    clock, cuda = _clock()

    def no_kernel(_i):
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(RuntimeError, match="No available kernel"):
        clock.per_call(no_kernel, warmup=1, repeats=4)
    assert clock.graphs and clock.fallback is None, \
        "a backend without a kernel turned CUDA graphs off"
    assert cuda.stream_resets == 1  # the failed capture's stream was put back

    clock.per_call(lambda _i: None, warmup=1, repeats=4)
    assert clock.graphed


def test_an_operation_only_capture_breaks_is_launched_eagerly_from_then_on():
    clock, cuda = _clock()
    eager_calls = []

    def uncapturable(i):
        if cuda.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        eager_calls.append(i)

    assert clock.fallback is None
    t = clock.per_call(uncapturable, warmup=1, repeats=4)
    assert not clock.graphed and not clock.graphs
    assert "stream is capturing" in clock.fallback  # said in the timings file
    assert t == pytest.approx(1e-3 / 4)  # the eager events' 1 ms over 4 calls
    assert eager_calls  # timed eagerly, not given up on
    clock.per_call(lambda _i: None, warmup=1, repeats=4)
    assert not clock.graphed
