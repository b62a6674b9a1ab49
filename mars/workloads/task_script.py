"""What a replayed task sends, round by round: sans-IO, shared by ``mars replay`` and ``mars sim``.

A :class:`TaskScript` holds one task's conversation state: round ``k``'s exact token-id prompt
(:mod:`mars.workloads.prompts`), the session metadata the engine and the sidecar schedule by,
and the rule that stops a task whose next prompt + output would not fit the server's
``max_model_len`` (``skipped`` before round 0, ``truncated`` after the last round that fits, as
the generator cuts tasks). The replay drives it over HTTP, the simulator over its virtual
clock; neither re-implements it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars.protocol.session import SessionMeta

from .prompts import TokenSpace, first_prompt, next_prompt
from .trace import Round, Task


@dataclass(frozen=True, slots=True)
class RoundCall:
    """One round's completion call: exact prompt ids, exactly ``output_tokens`` generated."""

    index: int
    prompt: list[int]
    output_tokens: int
    meta: SessionMeta
    round: Round

    @property
    def last(self) -> bool:
        return self.meta.last_round


class TaskScript:
    def __init__(self, task: Task, space: TokenSpace, job: str,
                 max_model_len: int | None) -> None:
        self.task, self.space, self.job, self.mml = task, space, job, max_model_len
        self.k = 0
        self.prompt = first_prompt(space, task.task_id, task.prefix_tokens, task.task_tokens)
        self.prev_tool: str | None = None

    def skip_reason(self) -> str | None:
        """Why round 0 cannot be sent (its prompt + output exceed ``max_model_len``), if so."""
        need = len(self.prompt) + self.task.rounds[0].output_tokens
        if self.mml is not None and need > self.mml:
            return f"round 0 needs {need} tokens, over the server's max_model_len {self.mml}"
        return None

    def call(self) -> RoundCall:
        """The current round's call."""
        k, task = self.k, self.task
        rnd = task.rounds[k]
        meta = SessionMeta(job_id=self.job, round=k, last_round=k == task.num_rounds - 1,
                           next_tool=rnd.tool, prev_tool=self.prev_tool)
        return RoundCall(k, self.prompt, rnd.output_tokens, meta, rnd)

    def after(self, generated: list[int]) -> str | None:
        """The current (not last) round ended having generated ``generated``: move to the next
        round (its tool is the ended round's ``round.tool``, run before it is sent) and return
        None, or return why the next round does not fit (the task ends ``truncated``)."""
        k, task = self.k, self.task
        rnd = task.rounds[k]
        nxt = next_prompt(self.space, task.task_id, k, self.prompt, generated,
                          rnd.observation_tokens + rnd.template_tokens)
        need = len(nxt) + task.rounds[k + 1].output_tokens
        if self.mml is not None and need > self.mml:
            return f"round {k + 1} would need {need} tokens, over the server's max_model_len {self.mml}"
        self.k, self.prompt, self.prev_tool = k + 1, nxt, rnd.tool
        return None
