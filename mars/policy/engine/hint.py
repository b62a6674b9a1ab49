"""llm-d's KV-cache retention hint as a baseline (``--policy kv_hint``; issue #35).

llm-d's agentic-serving proof of concept (llm-d/llm-d-router,
``deploy/poc/agentic-serving``, REPORT.md, 2026-09) has its endpoint picker attach a
retention directive to each main-agent turn: protect the whole context (``start: 0, end:
null``) for the session's predicted inter-turn gap, the 0.9 quantile of the gaps it observed
(it converged to ~28.8 s on Claude Code traces with 30 s-capped think times); subagent
requests get no directive. vLLM's retention API (vllm-project/vllm#38514) then evicts
protected blocks only after every unprotected one. Measured there on 2 x H100 with
Qwen3-Coder-30B-A3B: the prefix-cache hit rate fell from 93.45 % (plain LRU) to 79.18 %,
TTFT P90 rose 321 %. Their reading: the protected set oversubscribed the pool, and the
blocks the evictor was left to evict (subagents' contexts, unprotected tails) were the
ones about to be re-read.

Here the same rule runs on this runtime's pins, whose semantics match that evictor's: a pin
keeps its blocks out of vLLM's free queue (out of LRU eviction), and pins yield -- oldest
first -- only when a call cannot get blocks from the free queue. What a client marks is
named by the tool its round ends with (``tools``; llm-d marked main-agent turns, whose
tools wait on subagents); ``None`` marks every round. Not priced: every marked round is
protected, whatever it holds and whatever the pool has. Chosen where llm-d is silent: the
gap quantile is taken over the marked rounds' observed tool gaps (their producer watched
the main queue only), and before any gap is seen the protection lasts the same quantile of
:class:`ToolDurationModel`'s exponential prior (mean 5 s: 11.5 s at 0.9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mars.policy.engine.base import KvPressure, PinCandidate
from mars.policy.engine.baselines import _OneShotRetention
from mars.policy.engine.retention import PrefillRate, ToolDurationModel


@dataclass(frozen=True, slots=True)
class KvHintConfig:
    #: the tools whose rounds the client marks (llm-d: main-agent turns); None: every round
    tools: tuple[str, ...] | None = None
    #: the quantile of the marked rounds' gaps a protection lasts (llm-d's producer: 0.9;
    #: 1: the longest gap seen, and until a gap is seen, until memory is needed)
    quantile: float = 0.9
    #: the last this many marked gaps make the distribution
    max_samples: int = 512

    def __post_init__(self) -> None:
        q = self.quantile
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < q <= 1.0:
            raise ValueError(f"quantile must be a number in (0, 1], got {q!r}")
        n = self.max_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_samples must be an integer >= 1, got {n!r}")
        if self.tools is not None:
            if isinstance(self.tools, str) or not all(isinstance(t, str) for t in self.tools):
                raise ValueError(f"tools must be a list of tool names, got {self.tools!r}")
            if not self.tools:
                raise ValueError("tools is empty: it would mark no round (plain LRU, as "
                                 "--policy fcfs); leave it out to mark every round")
            object.__setattr__(self, "tools", tuple(self.tools))


#: the one key the marked rounds' gaps are kept under (their distribution is one queue's,
#: as llm-d's producer watched the main agents' gaps together)
MARKED = "marked"


class KvHintRetention(_OneShotRetention):
    """Protect every marked round's whole context for the gap quantile (see the module)."""

    name = "kv_hint"

    def __init__(self, config: KvHintConfig | None = None) -> None:
        self.config = cfg = config or KvHintConfig()
        # the marked gaps under one key: its window holds the last max_samples of them;
        # before any, the model's exponential prior
        super().__init__(ToolDurationModel(cfg.max_samples, 1), PrefillRate(10_000.0))

    def marks(self, tool: str | None) -> bool:
        tools = self.config.tools
        return tools is None or tool in tools

    def protection_s(self) -> float:
        """The predicted gap: the quantile of the marked rounds' observed gaps (nearest
        rank); before any, the quantile of the exponential prior."""
        q, gaps = self.config.quantile, self.durations.sorted_samples(MARKED)
        if not gaps:
            return -math.log(1.0 - q) * self.durations.prior_mean_s if q < 1.0 else math.inf
        return gaps[min(len(gaps) - 1, max(0, math.ceil(q * len(gaps)) - 1))]

    def decide(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        return self.protection_s() if self.marks(cand.tool) else 0.0

    def observe_tool(self, tool: str | None, duration_s: float) -> None:
        if self.marks(tool):
            self.durations.observe(MARKED, duration_s)
