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
core). The part of the way in that is the wait for the engine's step in progress, which the
simulator models itself, is a few milliseconds of it. Zero is the default: a GPU
server's host work per round is small next to its engine time, and nothing is assumed.
Framework-free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from mars.sim.fidelity import engine_spans, by_client_id
from mars.workloads.results import RunResult


@dataclass(frozen=True)
class HostModel:
    #: seconds from the client sending a round (after the sidecar admitted it) to the engine
    #: taking it
    request_s: float = 0.0
    #: seconds from the engine finishing a round to the client having all of it
    response_s: float = 0.0
    #: tools run this fraction longer than planned
    tool_overrun: float = 0.0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"host model: {k} must be a finite number >= 0, got {v!r}")

    @property
    def active(self) -> bool:
        return bool(self.request_s or self.response_s or self.tool_overrun)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def measure_host(results: RunResult, events: Iterable[dict[str, Any]]) -> HostModel:
    """The host of a real served run, per round: median time from submission to the engine
    taking the call (``gpu_submit``; a round the sidecar held for admission counts its wait
    too, which the median leaves out while most rounds are not held), median time from ``gpu_end`` to the client's end, and the tools' measured over planned
    time, summed."""
    spans = by_client_id(engine_spans(events))
    t0 = float(results.run["start_unix"])  # round times are relative to it, events absolute
    into, back = [], []
    planned = ran = 0.0
    for task in results.tasks:
        for r in task.rounds:
            sp = spans.get(r.request_id) if r.request_id else None
            if sp is not None:
                into.append(sp[0] - t0 - r.submit_s)
                back.append(r.end_s - (sp[1] - t0))
            if r.tool_duration_s and r.tool_start_s is not None and r.tool_end_s is not None:
                planned += r.tool_duration_s
                ran += r.tool_end_s - r.tool_start_s
    if not into:
        raise ValueError("no round of the run was found in its engine events")
    return HostModel(request_s=max(0.0, statistics.fmean(into)),
                     response_s=max(0.0, statistics.fmean(back)),
                     tool_overrun=max(0.0, ran / planned - 1) if planned > 0 else 0.0)
