"""How the operator-timing harness takes one time: device events around calls replayed as one
CUDA graph where it can, eager launches where capture fails, the wall clock off CUDA; the
median of a few passes. PyTorch is handed in by the harness (:mod:`mars.emulate.op_timing`),
so this module imports none itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def error_line(exc: BaseException) -> str:
    """An exception as one line for a timings file: its type and the first line of its text
    (PyTorch's errors run to many lines of C++ context)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text.strip() \
        else type(exc).__name__


class DeviceClock:
    """Seconds per call of ``fn``: on CUDA, device events around the calls replayed as one
    CUDA graph (vLLM runs decode steps as graphs, so the host's launch gaps are not the
    GPU's time; eager launches where capture fails), else the wall clock."""

    def __init__(self, torch, device, graphs: bool = True) -> None:
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self.graphs = graphs and self.cuda
        #: whether the last timing ran as a CUDA graph
        self.graphed = False
        #: why capture was given up for the rest of the run (None: it never was); recorded
        #: in the timings file, so a run that fell back to eager launches says so
        self.fallback: str | None = None

    #: timed passes per point; the median is kept (clocks ramp, neighbours interfere)
    PASSES = 3

    def per_call(self, fn: Callable[[int], Any], warmup: int, repeats: int) -> float:
        """``repeats`` consecutive calls ``fn(0) .. fn(repeats - 1)`` (each may use its own
        operand copy), timed :attr:`PASSES` times; the median per call."""
        self.graphed = False
        if self.graphs:
            try:
                return self._graphed(fn, warmup, repeats)
            except (RuntimeError, NotImplementedError) as exc:
                # a failed capture can leave its stream current: restore the default one
                t = self.torch.cuda
                t.synchronize()
                t.set_stream(t.default_stream(self.device))
                # an operation that cannot run at all (an attention backend without a
                # kernel for the point) fails eagerly too: that is the caller's error, and
                # capture stays on for everything after it. Only where the eager call runs
                # was capture the problem: launch eagerly from now on rather than retrying
                # capture at every point. (The run of 2026-11-28 lost graphs for all of
                # attention and the LM head to the first backend that had no kernel.)
                fn(0)
                self.graphs = False
                self.fallback = error_line(exc)
        for i in range(warmup):
            fn(i)
        return self._median(lambda: self._eager(fn, repeats)) / repeats

    def _median(self, one_pass: Callable[[], float]) -> float:
        return sorted(one_pass() for _ in range(self.PASSES))[self.PASSES // 2]

    def _eager(self, fn: Callable[[int], Any], repeats: int) -> float:
        if self.cuda:
            t = self.torch.cuda
            t.synchronize()
            start, end = t.Event(enable_timing=True), t.Event(enable_timing=True)
            start.record()
            for i in range(repeats):
                fn(i)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for i in range(repeats):
            fn(i)
        return time.perf_counter() - t0

    def _graphed(self, fn: Callable[[int], Any], warmup: int, repeats: int) -> float:
        t = self.torch.cuda
        side = t.Stream()
        side.wait_stream(t.current_stream())
        with t.stream(side):  # warm up off the default stream, as capture requires
            for i in range(max(1, warmup)):
                fn(i)
        t.current_stream().wait_stream(side)
        graph = t.CUDAGraph()
        with t.graph(graph):
            for i in range(repeats):
                fn(i)
        graph.replay()
        t.synchronize()

        def one_pass() -> float:
            start, end = t.Event(enable_timing=True), t.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        s = self._median(one_pass) / repeats
        self.graphed = True
        return s
