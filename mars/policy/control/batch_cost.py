"""Whether one more admitted session is worth the slowdown it brings to the batch.

Why: with a host tier under the engine the packing room charges each admitted context only
its engine share (:mod:`mars.policy.control.residency`), so more sessions fit in the pool at
once than the whole-context room allows. What then bounds how many run together is the GPU's
compute, and none of the window's signals sees it where it matters: vLLM's queue stays empty
while every call's decode step grows with the batch (``mars sim``, ILR-3 at twice the
onset, three seeds: the share charge let 5.3 calls run at once where the whole charge let
4.7, every round's decode took 20-25 % longer, the GPU was no busier, and mean latency rose
5-8 %; on three other seeds, where first rounds waited at the door 52-141 s rather than
7-19 s, the same share charge was 4-6 % faster, docs/results.md).

The trade, in a fluid model of the admitted set (``N`` sessions, each in the system for
``T``, ``q`` queued behind them, FIFO): a queued session waits ``W = q T / N`` at the door,
and its latency is ``W + T``. One more session admitted raises ``T`` by ``T' = e T / N``,
where ``e`` is the elasticity of a session's time in the system in the number admitted, and
lowers ``W`` by what that adds to the throughput ``N / T``. The sum falls when
``q (T/N - T') > N T'``, that is when

    q / N  >  e / (1 - e).

``e`` is measured, never set: a session spends the share ``sigma`` of its admitted life with
a call in the engine (:class:`~mars.policy.control.residency.EngineShare`; its tools do not
slow with the batch, the CPU plane's own signals cover them), and there each decode step
grows with the batch by the share ``alpha`` the engine fits from its own steps
(``kv_snapshot``'s ``batch_share``, :class:`~mars.policy.engine.step_stats.DecodeCost`): one
more session of average context raises the step by ``alpha / N`` of itself. So
``e = sigma x alpha`` (with the batch taken as ``sigma x N`` sessions, and ``sigma`` the
engine share as the packing room measures it, weighted by blocks, not a plain time
share). On the emulated H100 NVL x Qwen3-Coder-30B at 5 calls of 20 K tokens ``alpha``
is about 0.66 and ``sigma`` 0.5-0.8: more sessions are worth it while the queue holds from
half as many as are admitted to as many, or more. With ``e = 0`` (tools dominate, or the
batch costs nothing) any queue is worth admitting into; as ``e`` reaches 1 (throughput no
longer grows with the batch) none is.

Opt-in (``AdmissionConfig.batch_cost``): measured, it removes three places' losses to two
at ILR-3 (0.93-0.95x at three seeds, now 1.00x) and costs the long-session held-out workloads
most of their gain (``swe-long`` 1.13x -> 1.05x over two places), where a short queue is a
long door wait; and a larger batch slows decodes as much through the admitted sessions'
prefill chunks as through its size, which ``alpha`` does not see (docs/results.md, *The
batch cost*).

Used only where the share charge admits past the whole-context room (a host tier): without
one the whole-context charge bounds the batch, and the same question for the window itself
is not asked here (docs/control_plane.md, *Known limitations*). A fluid model: the door
wait it predicts is a mean over a stationary queue; in a burst the queue is long and the
rule admits, past it the queue is short and it does not. Pure; no clock.
"""

from __future__ import annotations

import math


def batch_elasticity(engine_share: float, batch_share: float) -> float:
    """``e``: how a session's time in the system grows, relative, with the number admitted."""
    return min(1.0, max(0.0, engine_share) * max(0.0, batch_share))


def worth_admitting_more(queued: int, admitted: int, engine_share: float,
                         batch_share: float | None) -> bool:
    """Whether admitting past the whole-context room lowers a queued session's expected
    door wait plus time in the system (module docstring; the admitted sessions' own
    slowdown is not summed in). Unknown ``batch_share`` (the engine has not
    fitted its decode cost, or does not report it): no evidence against, True. Nothing
    admitted: True (nothing to slow)."""
    if batch_share is None or admitted <= 0:
        return True
    if queued <= 0:
        return False
    e = batch_elasticity(engine_share, batch_share)
    if e >= 1.0:
        return False
    return queued / admitted > e / (1.0 - e) if math.isfinite(e) else False
