"""The onset of saturation of fcfs per regime, from a simulated fcfs rate scan: the arrival
rate at which the mean task latency reaches 1.5x the mean isolated latency (queueing adds half
of it). The ``mars bench --preset`` rates are multiples of it (mars/bench/presets.py); this
prints what the presets record, and the 2x rate beside it.

    .venv/bin/mars bench S-ILR-1 S-ILR-2 S-ILR-3 --sim h100-nvl:gpt-oss-120b --policies fcfs \\
        --rates 0.025,0.05,0.1,0.2,0.4,0.8,1.6 --num-tasks 24 --jobs 2 --out runs/sat-h100-oss
    .venv/bin/python experiments/saturation.py runs/sat-h100-oss

The crossing is interpolated linearly in log(rate) between the last rate below 2x and the
first at or above it; a regime that never reaches 2x within the scan prints ``> max rate``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

#: mean latency / mean isolated latency that marks the onset of saturation. Not 2x: a finite
#: scan (40 tasks) bounds the backlog, and a light regime's curve can level off below 2x
#: (S-ILR-1 on the emulated H100 stays under 1.95x up to 1.6 tasks/s)
THRESHOLD = 1.5


def saturation(points: list[tuple[float, float]], threshold: float = THRESHOLD) -> float | None:
    """``points``: (rate, mean latency / mean isolated latency), any order."""
    pts = sorted(points)
    for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
        if s0 < threshold <= s1:
            f = (threshold - s0) / (s1 - s0)
            return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
    if pts and pts[0][1] >= threshold:
        return pts[0][0]
    return None


def main() -> None:
    doc = json.loads((Path(sys.argv[1]) / "bench.json").read_text())
    by: dict[str, list[tuple[float, float]]] = {}
    for p in doc["points"]:
        s = p.get("summary") or {}
        if p["policy"] != "fcfs" or not s.get("complete") or not s.get("ideal_mean_s"):
            continue
        by.setdefault(p["regime"], []).append(
            (float(p["rate"]), s["latency_s"]["mean"] / s["ideal_mean_s"]))
    print(f"{doc['config'].get('sim')}: fcfs mean latency / isolated per rate; the rates where "
          f"it reaches {THRESHOLD:g}x (the presets' onset) and 2x")
    for reg, pts in by.items():
        line = ", ".join(f"{r:g}: {x:.2f}" for r, x in sorted(pts))
        top = max(r for r, _ in pts)
        at = [saturation(pts, t) for t in (THRESHOLD, 2.0)]
        print(f"  {reg}: {line}  ->  " + " / ".join(
            f"{x:.3g}" if x else f"> {top:g}" for x in at) + " tasks/s")


if __name__ == "__main__":
    main()
