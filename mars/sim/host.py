"""The served host around the engine, as the simulator can model it: three measured numbers.

A real served run pays, on every round, the path from the client to the engine (HTTP, the
sidecar, vLLM's API server: parsing, tokenizing) and back (detokenizing, streaming through
the sidecar), and its tools overrun their planned time when the host's CPUs are busy. On a
2-core machine that is 10-17 % of an agent task's latency (docs/sim.md), and it does more than
add: it spreads the rounds out, so calls overlap less in the engine than in a simulation
without it (in virtual time the calls of three sessions queued more behind each other and
summed 20 % more engine time than the real run; docs/sim.md, "CPU fidelity").

:class:`HostModel` holds the three as constants, the simulator applies them
(``mars sim run --host-from REAL_RUN``), and :func:`measure_host` reads them off a real run
(its ``results.json`` and the engine's ``events.jsonl``): means over rounds, since a task's
latency sums them (on a 2-core host they have a long tail: a median of 10 ms to the engine
and 7 ms back, means of 70 and 66 ms, the longest 0.9 s, when the API server waited for a
core). Two things the constants cannot be: a spread (the real host's tail spreads calls
apart more than a constant does), and free of the wait for the engine's step in progress,
which the way in includes and the simulator adds again (not measured separately; at most
one step). Zero is the default: a GPU server's host work per round is small next to its
engine time, and nothing is assumed. The isolated (ideal) runs get the same constants,
measured under load. Framework-free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from mars.sim.fidelity import round_spans
from mars.workloads.results import RunResult


@dataclass(frozen=True)
class HostModel:
    """What the served host adds to each round, as constants (seconds, and a fraction)."""

    #: seconds from the client sending a round (after the sidecar admitted it) to the engine
    #: taking it
    request_s: float = 0.0
    #: seconds from the engine finishing a round to the client having all of it
    response_s: float = 0.0
    #: tools run this fraction longer than planned
    tool_overrun: float = 0.0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v)
                                           and v >= 0):
                raise ValueError(f"host model: {k} must be a finite number >= 0, got {v!r}")

    @property
    def active(self) -> bool:
        return bool(self.request_s or self.response_s or self.tool_overrun)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def measure_host(results: RunResult, events: Iterable[dict[str, Any]]) -> HostModel:
    """The host of a real served run, per round: the mean time from the client sending a round
    to the engine taking it (``gpu_submit``), over rounds after a task's first (a session's
    first round may wait for the sidecar's admission, which the simulator models itself;
    later rounds of an admitted session are forwarded at once), the mean time from
    ``gpu_end`` to the client's end, and the tools' measured over planned time, summed."""
    spans = round_spans(results, events)
    t0 = float(results.run["start_unix"])  # round times are relative to it, events absolute
    into, first_into, back = [], [], []
    planned = ran = 0.0
    for task in results.tasks:
        for i, r in enumerate(task.rounds):
            sp = spans.get((task.task_id, i))
            if sp is not None:
                (into if i else first_into).append(sp[0] - t0 - r.submit_s)
                back.append(r.end_s - (sp[1] - t0))
            if r.tool_duration_s and r.tool_start_s is not None and r.tool_end_s is not None:
                planned += r.tool_duration_s
                ran += r.tool_end_s - r.tool_start_s
    if not back:
        raise ValueError("no round of the run was found in its engine events")
    into = into or first_into  # tasks of one round each: nothing else to go by
    return HostModel(request_s=max(0.0, statistics.fmean(into)),
                     response_s=max(0.0, statistics.fmean(back)),
                     tool_overrun=max(0.0, ran / planned - 1) if planned > 0 else 0.0)
