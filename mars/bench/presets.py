"""The paper's three evaluation set-ups as ``mars bench --preset`` grids (simulated).

Each preset is an emulated GPU x model (``mars bench --sim``), its regimes, and per regime the
arrival rates: fixed multiples of that regime's **onset of saturation** under fcfs on that
set-up, the rate at which stock vLLM scheduling's mean task latency reaches 1.5x the isolated
latency. The paper's grids go from light load to past saturation, with MARS's largest gains
"near the onset of saturation"; multiples of the measured onset put every regime's points at
the same place on its own curve (ILR-4's onset is an eighth of ILR-1's on the emulated H100),
instead of one rate list that is idle for one regime and overloaded for another. The onsets
are measured, not chosen: a simulated fcfs rate scan (:data:`SATURATION_SCAN`) read by
``experiments/saturation.py``; docs/bench.md has the scans. Re-measure them when the
step-time model or its profiles change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: how the saturation rates were measured (per preset: its --sim and regimes)
SATURATION_SCAN = ("mars bench REGIMES --sim GPU:MODEL --policies fcfs --rates "
                   "0.025,0.05,0.1,0.2,0.4,0.8,1.6 --num-tasks 40 --jobs 2; "
                   "python experiments/saturation.py OUT")
#: the paper's five operating points per regime: light, at the onset, and past it (fcfs is
#: at ~2x its isolated latency between 1.5x and 2x the onset on the scans)
FIVE = (0.5, 1.0, 1.5, 2.0, 3.0)
#: the H200 grid's seven ("a much wider request rate range")
SEVEN = (0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0)


def _round2(x: float) -> float:
    """Two significant digits: rates people can read and type."""
    return float(f"{x:.2g}")


@dataclass(frozen=True)
class Preset:
    name: str
    #: the emulated set-up (``mars bench --sim``)
    sim: str
    #: fcfs onset of saturation per regime, tasks/s (measured: module docstring)
    onset: Mapping[str, float]
    multiples: tuple[float, ...]
    summary: str
    #: the paper's figure it stands for
    figure: str = ""
    regimes: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regimes", tuple(self.onset))

    def rates(self, regime: str) -> list[float]:
        s = self.onset[regime]
        return [_round2(s * m) for m in self.multiples]


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("h100-qwen", "h100-nvl:qwen3-coder-30b-a3b",
           {"ILR-1": 0.24, "ILR-2": 0.13, "ILR-3": 0.11, "ILR-4": 0.026}, FIVE,
           "H100 NVL + Qwen3-Coder-30B-A3B, ILR-1..4, 5 rates each", "Figures 7, 9, 13"),
    Preset("h100-gptoss", "h100-nvl:gpt-oss-120b",
           {"S-ILR-1": 0.3, "S-ILR-2": 0.27, "S-ILR-3": 0.12}, FIVE,
           "H100 NVL + GPT-OSS-120B, S-ILR-1..3, 5 rates each", "Figure 8"),
    Preset("h200-qwen", "h200-nvl:qwen3-coder-30b-a3b",
           {"ILR-1": 0.24, "ILR-2": 0.13, "ILR-3": 0.12, "ILR-4": 0.042}, SEVEN,
           "H200 NVL + Qwen3-Coder-30B-A3B, ILR-1..4, 7 rates each", "Figure 10"),
)}

#: tasks per point of a preset grid unless --num-tasks says otherwise (the issue's floor)
PRESET_TASKS = 100


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


def describe() -> str:
    """The presets as a table (``mars bench --list-presets``)."""
    lines = ["| preset | set-up (simulated) | regime: fcfs onset -> rates (tasks/s) |",
             "|---|---|---|"]
    for p in PRESETS.values():
        regs = "; ".join(f"{r}: {p.onset[r]:g} -> {', '.join(f'{x:g}' for x in p.rates(r))}"
                         for r in p.regimes)
        lines.append(f"| `{p.name}` | {p.summary} (`--sim {p.sim}`; {p.figure}) | {regs} |")
    return "\n".join(lines)
