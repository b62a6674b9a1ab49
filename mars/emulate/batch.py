"""What an emulated GPU must know about the requests it runs: the worker-side request table.

A real model runner keeps, for every request the scheduler sent it, the tokens it holds and how
many are computed; from each step's scheduler output it learns the new tokens to compute and
whether the step finishes the request's prompt (only then is a token sampled; a partial prefill
chunk samples nothing). :class:`RequestTable` keeps exactly that, framework-free: the emulated
executor translates vLLM's ``SchedulerOutput`` into :class:`Scheduled` entries, and gets back
the step's batch for the step-time model and the sampled tokens.

The emulated model has no language. Its tokens are drawn from a seeded generator over the
embedded tokenizer's ordinary ids (never a special or stop token), so text flows through the
API server's detokenizer as from a real model. A call that forces its length (``ignore_eos``,
as ``mars replay`` sends every call) gets exactly ``max_tokens``; one that does not ends with
its stop token after :attr:`EmulatedOutput.natural_tokens` tokens, the emulated model's
answer length (our choice, documented in docs/emulation.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from mars.emulate.step_time import BatchEntry


#: tokens after which a call that does not force its length ends (our choice: a short
#: agent turn; docs/emulation.md)
NATURAL_TOKENS = 256


@dataclass(frozen=True, slots=True)
class EmulatedOutput:
    """How the emulated model answers."""

    #: ordinary token ids to draw from, [lo, hi)
    token_lo: int = 16
    token_hi: int = 4000
    #: tokens after which a call without ``ignore_eos`` emits its stop token
    natural_tokens: int = NATURAL_TOKENS
    seed: int = 0


@dataclass(slots=True)
class _Req:
    #: tokens the request holds (prompt + sampled so far)
    num_tokens: int
    stop_id: int | None
    sampled: int = 0
    rng: random.Random = field(default_factory=random.Random)


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One request in one step: ``new`` tokens over ``computed`` already in the KV cache.
    ``num_tokens`` is set when the scheduler restates the request's length (a new request,
    or one resumed after preemption); otherwise the table's own count holds."""

    req_id: str
    computed: int
    new: int
    num_tokens: int | None = None


class RequestTable:
    def __init__(self, output: EmulatedOutput = EmulatedOutput()) -> None:
        self.out = output
        self._reqs: dict[str, _Req] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def add(self, req_id: str, prompt_tokens: int, stop_id: int | None = None) -> None:
        """A request the scheduler sends for the first time (``stop_id``: the token that
        ends it when the emulated model stops by itself; None when its length is forced)."""
        self._reqs[req_id] = _Req(prompt_tokens, stop_id,
                                  rng=random.Random(f"{self.out.seed}:{req_id}"))

    def finish(self, req_ids) -> None:
        for rid in req_ids:
            self._reqs.pop(rid, None)

    def step(self, scheduled: list[Scheduled]) -> tuple[list[BatchEntry], dict[str, list[int]]]:
        """The step's batch and, for every scheduled request, its sampled tokens (empty for
        a prefill chunk that leaves part of the prompt uncomputed)."""
        batch: list[BatchEntry] = []
        sampled: dict[str, list[int]] = {}
        for s in scheduled:
            r = self._reqs.get(s.req_id)
            if r is None:
                raise KeyError(f"request {s.req_id!r} was scheduled but never sent")
            if s.num_tokens is not None:
                r.num_tokens = s.num_tokens
            batch.append(BatchEntry(new=s.new, context=s.computed))
            if s.computed + s.new < r.num_tokens:
                sampled[s.req_id] = []
                continue
            sampled[s.req_id] = [self._next_token(r)]
            r.num_tokens += 1
            r.sampled += 1
        return batch, sampled

    def _next_token(self, r: _Req) -> int:
        if r.stop_id is not None and r.sampled + 1 >= self.out.natural_tokens:
            return r.stop_id
        return r.rng.randrange(self.out.token_lo, self.out.token_hi)
