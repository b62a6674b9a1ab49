"""The ideal (isolated) latencies a bench's points share: goodput's dynamic SLO.

They are measured once per regime, by the first point that runs (``fcfs`` first when it is in
the list: the paper's ideal is vLLM at concurrency one), through ``mars replay --ideal auto``
(so the ideal cache is used and filled), and then given to every other point of the regime as
``--ideal FILE``. Sharing is valid only where the generator picked the same tasks for every
rate (only arrivals differ: :func:`mars.bench.plan.same_tasks`); elsewhere each point measures
its own. Points run on worker threads, so a point that needs a regime's ideal while another
measures it waits here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: a regime's state: None (not measured yet, or the last try failed), "measuring", or the file
_MEASURING = "measuring"


class SharedIdeals:
    def __init__(self, directory: Path, *, ideal: str, simulated: bool,
                 lock: threading.RLock) -> None:
        #: where the measured files go (``OUT/ideal/<regime>.json``)
        self.directory = directory
        #: the bench's ``--ideal`` (``auto``: measure and share; otherwise passed to every point)
        self.ideal = ideal
        self.simulated = simulated
        self._cond = threading.Condition(lock)
        self._shared: dict[str, bool] = {}
        self._state: dict[str, Path | str | None] = {}

    def set_shared(self, regime: str, shared: bool) -> None:
        self._shared[regime] = shared

    def resume(self, regime: str) -> None:
        """Take a regime's file from an earlier run of this bench, if it is there and valid."""
        from mars.workloads.ideal import load_ideal_file

        f = self.directory / f"{regime}.json"
        if f.exists() and self._shared.get(regime):
            try:
                load_ideal_file(f)
            except ValueError:
                return
            self._state[regime] = f

    def for_point(self, regime: str, stop: threading.Event) -> tuple[str, bool]:
        """The ``--ideal`` argument for a point, and whether this point measures the shared
        ideal latencies of its regime (then it must call :meth:`measured`)."""
        if self.ideal != "auto":
            return self.ideal, False
        if not self._shared.get(regime):
            return "auto", False
        with self._cond:
            while True:
                st = self._state.get(regime)
                if isinstance(st, Path):
                    return str(st), False
                if st is None:
                    self._state[regime] = _MEASURING
                    return "auto", True
                if stop.is_set():
                    return "auto", False
                self._cond.wait(1.0)

    def measured(self, regime: str, res: Any, policy: str) -> None:
        """The measuring point ended (``res``: its results, or None): keep its ideal latencies
        if every task has one, else let the next point of the regime try again."""
        from mars.workloads.ideal import save_cached

        path: Path | None = None
        try:
            if res is not None and res.mode == "load":
                ideal = {t.task_id: t.ideal_s for t in res.tasks}
                if ideal and all(v is not None and v > 0 for v in ideal.values()):
                    src = (res.config.get("ideal") or {}).get("source")
                    path = save_cached(
                        regime, {"regime": regime,
                                 "measured_on": "fcfs, simulated" if self.simulated else policy,
                                 "via": src,
                                 "trace_sha256": res.trace.get("sha256")},
                        ideal, self.directory,
                        source="mars bench --sim: each task alone in the simulator (fcfs)"
                        if self.simulated else
                        f"mars bench: isolated replay on the {policy} server")
        finally:
            with self._cond:
                self._state[regime] = path
                self._cond.notify_all()

    def wake(self) -> None:
        """Let waiting points see a stop."""
        with self._cond:
            self._cond.notify_all()

    def files(self) -> Mapping[str, str | None]:
        return {r: (str(v) if isinstance(v, Path) else None) for r, v in self._state.items()}
