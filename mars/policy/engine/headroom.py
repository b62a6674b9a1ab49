"""Admission headroom: do not admit a call that the running calls will push out again.

vLLM admits a waiting (or preempted) call as soon as its whole prompt fits in the free blocks.
Under decode-growth pressure that is often the wrong moment: every running call needs a new
block every ``block_size`` tokens, so a call admitted into the last free blocks is the next
preemption victim a few steps later, and its prefill is wasted (preempted calls ping-pong
between waiting and running). The rule keeps room for every running call to grow
``tokens_per_running`` more tokens before a call is admitted:

``admit  iff  running == 0  or  free - need >= ceil(running * tokens_per_running / block_size)``

where ``need`` is the blocks the call still has to compute. With nothing running the call is
always admitted (liveness); the admission loop stops at the first call refused, so calls
behind it cannot overtake it, and the ordering policy's promotion keeps its bound.

Measured on the real vLLM scheduler with synthetic outputs (``tests/test_scheduler_sim.py``,
agent-like multi-round jobs, 24 pool sizes / budgets / seeds): with 8 tokens of headroom mars
preempted 145 times where stock admission preempted 285, for 0.3 % fewer finished calls.
Stock vLLM (``--policy fcfs``) and the baselines keep vLLM's rule (0 = off).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdmissionHeadroom:
    #: growth room reserved per running call, in tokens (0 = vLLM's own rule)
    tokens_per_running: int = 8

    def __post_init__(self) -> None:
        if self.tokens_per_running < 0:
            raise ValueError("tokens_per_running must be >= 0")

    def reserve_blocks(self, running: int, block_size: int) -> int:
        return -(-running * self.tokens_per_running // block_size)

    def allows(self, free_blocks: int, need_blocks: int, running: int,
               block_size: int) -> bool:
        if running <= 0 or self.tokens_per_running <= 0:
            return True
        return free_blocks - need_blocks >= self.reserve_blocks(running, block_size)
