"""Token-level prompt construction for the replay: what each round's prompt *is*, exactly.

A trace gives token counts only. The replay turns them into token ids so that the server sees
what it would see with a real agent (``docs/workloads.md`` §1):

* the **shared prefix** (system prompt + tool schemas) is the same ids for every task of a
  run, so it is a genuine cross-task prefix-cache hit;
* the **task context** and every round's **filler** (observation + template tokens) are ids
  specific to the task and round, so two tasks with equal token counts still differ (the
  generator samples tasks with replacement) and never hit each other's cache;
* round ``k``'s prompt is round ``k-1``'s prompt, then the ids round ``k-1`` *actually
  generated*, then that round's filler: exactly, so prefix caching and KV retention see the
  append-only history they would see with real agents.

Ids are drawn from ``[lo, hi)`` (default ``[100, 900)``: valid and non-special for the
embedded tiny model's ~1000-token vocabulary; widen it for real models with ``--token-range``).
Everything is derived from a seed with SHA-256 so that content is reproducible across
processes and machines (Python's ``hash`` is salted per process). ``salt`` separates the
content of runs that share a server: the isolated (ideal) run uses a different salt from the
measured run, so one never warms the other's task-specific prefix cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_TOKEN_RANGE: tuple[int, int] = (100, 900)


def parse_token_range(text: str) -> tuple[int, int]:
    """``"100:900"`` -> ``(100, 900)`` (half-open). Raises ``ValueError`` with a clear message."""
    try:
        lo_s, hi_s = text.split(":")
        lo, hi = int(lo_s), int(hi_s)
    except ValueError:
        raise ValueError(f"token range must look like LO:HI, e.g. 100:900 (got {text!r})") from None
    if lo < 0 or hi - lo < 2:
        raise ValueError(f"token range must satisfy 0 <= LO and HI - LO >= 2 (got {text!r})")
    return lo, hi


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """Where filler ids come from and what makes them reproducible."""

    seed: int = 0
    lo: int = DEFAULT_TOKEN_RANGE[0]
    hi: int = DEFAULT_TOKEN_RANGE[1]
    #: separates the task-specific content of runs that share a server (not the shared prefix)
    salt: str = "run"

    def __post_init__(self) -> None:
        if not (0 <= self.lo and self.hi - self.lo >= 2):
            raise ValueError(f"bad token range [{self.lo}, {self.hi})")

    def with_salt(self, salt: str) -> "TokenSpace":
        return TokenSpace(self.seed, self.lo, self.hi, salt)

    def ids(self, n: int, *key: object) -> list[int]:
        """``n`` ids determined by ``(seed, *key)`` alone."""
        if n <= 0:
            return []
        material = "\x1f".join(str(k) for k in (self.seed, *key)).encode()
        entropy = int.from_bytes(hashlib.sha256(material).digest()[:16], "little")
        rng = np.random.default_rng(np.random.SeedSequence(entropy))
        return rng.integers(self.lo, self.hi, size=n, dtype=np.int64).tolist()

    # The three kinds of content of a task's history.

    def shared_prefix(self, n: int) -> list[int]:
        """Identical for every task (and for the ideal and measured runs): a real shared prefix."""
        return self.ids(n, "shared-prefix")

    def task_context(self, task_id: str, n: int) -> list[int]:
        return self.ids(n, self.salt, "task", task_id)

    def filler(self, task_id: str, round_index: int, n: int) -> list[int]:
        """Observation + template ids appended after round ``round_index``'s output."""
        return self.ids(n, self.salt, "filler", task_id, round_index)


def first_prompt(space: TokenSpace, task_id: str, prefix_tokens: int, task_tokens: int) -> list[int]:
    """Round 0's prompt: shared prefix, then the task's own context."""
    return space.shared_prefix(prefix_tokens) + space.task_context(task_id, task_tokens)


def next_prompt(
    space: TokenSpace,
    task_id: str,
    round_index: int,
    prev_prompt: Sequence[int],
    generated: Sequence[int],
    filler_tokens: int,
) -> list[int]:
    """Round ``round_index + 1``'s prompt: round ``round_index``'s prompt + the ids it actually
    generated + ``filler_tokens`` (observation + template) task-and-round-specific ids."""
    return [*prev_prompt, *generated, *space.filler(task_id, round_index, filler_tokens)]
