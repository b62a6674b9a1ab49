"""The served engine's own record of its steps: what each step computed and how long it took.

``mars-vllm serve --mars-step-log FILE`` makes the scheduler write one JSON line per engine
step: the batch it scheduled (new tokens and cached context of each request), the time from
that step's ``schedule()`` to the next one's (or, when the engine then went idle, to the end
of the step's ``update_from_output``), and how many requests it freed (finished or aborted).
That is the time the simulator gives a step -- the engine's whole loop, not the model call
alone. Synchronous scheduling only: with vLLM's batch queue (async scheduling) the next step
is scheduled before this one's output is in, and the scheduler does not log.

Why it exists: a CPU profile is calibrated minutes before the run it is checked against, and
on a shared virtual machine the CPU's speed moves in minutes. This machine's lone decode over
16 K tokens of the embedded model measured 1.25 ms per step at 00:55 and 1.77 ms at 01:20 the
same night, with nothing of ours running (the other guests' use of the shared last-level
cache and memory; steal time stayed 0). A run's own step log tells how fast the machine was
*during* that run (:func:`speed_factor`), which a fidelity check needs to tell the
simulator's error from the machine's drift. (What that factor measures is the run's steps
against the profile's prediction for them: the drift since calibration, and whatever the
served engine's loop costs beyond the calibrated ``step()``.)

Framework-free: the scheduler hands :class:`StepLogWriter` plain (new, context) pairs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO

from mars.emulate.fit import Measured
from mars.emulate.step_time import StepTimeModel


class StepLogWriter:
    """Steps as the scheduler sees them: :meth:`begin` when a step is scheduled, :meth:`end`
    when the next one is (or the engine goes idle). A step costs building its batch list and
    one JSON line in a buffer, which is written when the engine goes idle or the buffer fills.
    Durations come from ``clock`` (monotonic); ``t`` in the log is the caller's wall time."""

    def __init__(self, path: str | Path, flush_every: int = 1024,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._f: IO[str] = open(path, "a", encoding="utf-8")
        self._flush_every = flush_every
        self._clock = clock
        self._buf: list[str] = []
        self._open: tuple[float, float, list[list[int]]] | None = None
        self._finished = 0
        self._start: float | None = None  # when the step being scheduled began (end())

    def begin(self, now: float, batch: list[list[int]]) -> None:
        """The step being scheduled (since the last :meth:`end`) computes ``batch``; ``now``:
        the wall time its ``schedule()`` began."""
        t0 = self._start if self._start is not None else self._clock()
        if self._open is not None:
            self._close(t0)
        self._open, self._finished, self._start = (now, t0, batch), 0, None

    def finished_one(self) -> None:
        self._finished += 1

    def end(self, idle: bool = False) -> None:
        """The open step ends now: the next one is being scheduled (its time starts here), or
        the engine is idle."""
        t = self._clock()
        if self._open is not None:
            self._close(t)
        self._start = None if idle else t
        if idle or len(self._buf) >= self._flush_every:
            self.flush()

    def _close(self, t1: float) -> None:
        t, t0, batch = self._open
        self._open = None
        self._buf.append(json.dumps({"t": round(t, 6), "s": round(t1 - t0, 7), "b": batch,
                                     "f": self._finished}, separators=(",", ":")))

    def flush(self) -> None:
        if self._buf:
            self._f.write("\n".join(self._buf) + "\n")
            self._buf.clear()
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self.flush()
            self._f.close()


def read_step_log(path: str | Path) -> list[Measured]:
    """The logged steps, as the calibration's measured samples."""
    out: list[Measured] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Measured(tuple((int(n), int(c)) for n, c in d["b"]), float(d["s"]),
                                int(d.get("f", 0))))
    return out


def speed_factor(model: StepTimeModel, steps: Iterable[Measured]) -> float:
    """Measured over predicted time, summed over ``steps``: how much slower (> 1) or faster
    the machine ran these steps than the model says. NaN without steps."""
    meas = pred = 0.0
    for s in steps:
        meas += s.seconds
        pred += model.step_time(s.batch)
    return meas / pred if pred > 0 else float("nan")


def step_errors(model: StepTimeModel, steps: Sequence[Measured],
                factor: float = 1.0) -> list[float]:
    """Each step's relative error, predicted x ``factor`` against measured."""
    return [model.step_time(s.batch) * factor / s.seconds - 1 for s in steps if s.seconds > 0]
