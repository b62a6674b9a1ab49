"""Which of vLLM's data-parallel engines a ``mars-vllm serve`` process runs, and which its
API server (and so its sidecar) fronts, read from vLLM's own launch flags the way vLLM 0.32
reads them (``EngineArgs.create_engine_config``, ``vllm/engine/arg_utils.py``).

vLLM has four shapes, and the sidecar must address, and read the events of, exactly the
engines behind the API server it stands in front of:

* **one node**: every engine here, behind this API server (rank header ``0..N-1``);
* **internal load balancing across nodes**: this API server fronts all ``N`` engines, some
  of them on other nodes started with ``--headless``, which have no API server of their own;
* **hybrid load balancing** (``--data-parallel-hybrid-lb``, or a non-headless node given
  ``--data-parallel-start-rank``): every node runs an API server for its own ``L`` engines,
  which it addresses by a *local* rank header (``0`` is global rank ``start``);
* **external load balancing** (``--data-parallel-rank R`` or ``--data-parallel-external-lb``,
  or hybrid with ``L = 1``): one engine behind each API server.

An engine publishes its events on ``rank_endpoint(endpoint, rank - rank_base)``: the rank
its own API server's header gives it, so a sidecar in front of that server derives the same
endpoints whatever the shape. Framework-free (an ``argparse`` namespace in, numbers out).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DataParallelLayout:
    #: ``--data-parallel-size``: every engine of the deployment
    size: int
    #: the engines this process runs (0 on an API-only node)
    local: int
    #: the global rank of the first of them
    start: int
    headless: bool
    #: this process's API server fronts its own engines only (hybrid or external LB)
    own_api: bool

    @property
    def api_ranks(self) -> range:
        """The global ranks behind this process's API server (none when headless)."""
        if self.headless:
            return range(0)
        if self.own_api:
            return range(self.start, self.start + self.local)
        return range(self.size)

    @property
    def rank_base(self) -> int:
        """Subtracted from an engine's global rank for its events endpoint and file: the
        rank its API server's header gives it."""
        return self.start if self.own_api else 0

    @property
    def remote(self) -> bool:
        """Some engine behind this API server runs on another node, or this node's engines
        are fronted by an API server elsewhere (headless)."""
        return self.headless or len(self.api_ranks) > self.local


def data_parallel_layout(args: argparse.Namespace) -> DataParallelLayout:
    size = max(1, int(getattr(args, "data_parallel_size", 1) or 1))
    headless = bool(getattr(args, "headless", False))
    nnodes = max(1, int(getattr(args, "nnodes", 1) or 1))
    node_rank = int(getattr(args, "node_rank", 0) or 0)
    within = 1
    for name in ("tensor_parallel_size", "pipeline_parallel_size",
                 "prefill_context_parallel_size"):
        within *= max(1, int(getattr(args, name, 1) or 1))
    per_node = size * within // nnodes if nnodes > 1 else size * within
    inferred_rank = node_rank * per_node // within if nnodes > 1 else 0
    rank = getattr(args, "data_parallel_rank", None)
    external = size > 1 and (bool(getattr(args, "data_parallel_external_lb", False))
                             or rank is not None)
    if external:
        start = inferred_rank if rank is None else int(rank)
        return DataParallelLayout(size, 1, start, headless, own_api=True)
    local = getattr(args, "data_parallel_size_local", None)
    if local is None:
        local = max(per_node // within, 1) if nnodes > 1 else size
    local = int(local)
    start_arg = getattr(args, "data_parallel_start_rank", None)
    start = int(start_arg) if start_arg is not None else inferred_rank
    hybrid = (not headless and local < size
              and (start_arg is not None or bool(getattr(args, "data_parallel_hybrid_lb", False))))
    # (vLLM runs hybrid with one local engine as external load balancing: the same here)
    return DataParallelLayout(size, local, start, headless, own_api=hybrid)
