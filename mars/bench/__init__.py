"""The paper's policy comparison (§6.3) and ablation (§6.5) as one run: ``mars bench``
(the command: :mod:`mars.cli.bench`; the manual: docs/bench.md).

``mars bench ILR-1 --policies fcfs,autellix,infercept,continuum,continuum_dy,mars --rates
0.1,0.2,0.3`` starts a fresh ``mars-vllm serve --policy P`` for every policy (same model, same
flags), or with ``--sim`` simulates each point in virtual time, replays the same seeded traces
against each, and writes one comparison: mean / P90 / P95 latency and goodput per policy and
rate, MARS's ratio to the strongest baseline at each point, latency-vs-rate plots per regime
and an ablation table. The package, by job:

* :mod:`~mars.bench.plan`: the configuration, the traces, the points and their command lines;
* :mod:`~mars.bench.run`: servers, child processes, progress, Ctrl-C (with
  :mod:`~mars.bench.ideal`, the ideal latencies the points of a regime share, and
  :mod:`~mars.bench.observe`, what it reads of its children and host);
* :mod:`~mars.bench.record`: ``bench.json`` and ``report.md``;
* :mod:`~mars.bench.report`: the comparison, its tables and plots, pure functions of
  ``bench.json``; :mod:`~mars.bench.stats` its intervals; :mod:`~mars.bench.seeds` pools
  several seeds; :mod:`~mars.bench.presets` the paper's three set-ups.

Layout of the output directory (``--out``)::

    bench.json                      config, every point's summary, servers, comparison
    report.md                       the printed tables, with the command
    plots/latency_vs_rate_<R>.png   mean / P90 / P95 latency vs rate per policy (Fig. 7-10)
    plots/goodput_vs_rate_<R>.png   goodput vs rate per slack (Fig. 9)
    plots/ablation_<R>.png          mars vs its ablations (Fig. 13)
    traces/<R>/rate-<r>.jsonl       the exact traces replayed (identical for every policy)
    ideal/<R>.json                  ideal (isolated) latencies shared by every point of R
    servers/<policy>/[<R>-rate-<r>/]server.log   a server's log; events.jsonl its engine events
    runs/<R>/<policy>/rate-<r>/     one `mars replay` run: results.json, replay.log, plots/

Design choices (``docs/bench.md`` explains them):

* **Servers** are started with the same flags for every policy. By default (``--restart
  auto``) a policy whose sidecar admission is on gets a fresh server for every point (the
  AIMD window is state an idle sidecar keeps, so a later point would start where the last
  one ended), the others one server whose points (regimes x rates, in that order) run back to
  back, each with its own content salt so that no point warms the next one's prefix cache.
  ``--restart point`` / ``policy`` force one or the other for every policy. Every server gets
  a short warm-up (:func:`mars.bench.run.warm_up`) before its first point.
* **Ideal latencies** (goodput's dynamic SLO) are measured once per regime, by the first point
  that runs (``fcfs`` first when it is in the list: the paper's ideal is vLLM at concurrency
  one), through ``mars replay --ideal auto`` (so the ideal cache is used and filled), and then
  passed to every other point with ``--ideal FILE`` (:mod:`mars.bench.ideal`). This is valid
  because the generator picks the same tasks for every rate (only arrivals differ);
  :func:`mars.bench.plan.same_tasks` checks it.
* **Cores** are split as in ``mars demo`` / the paper (§6.2): the server gets all cores but the
  last, the CPU-bound tools the last one.
* **Ctrl-C** (or SIGTERM) sends one SIGINT to the running replays, which stop and still write
  their partial results; servers are stopped; the tables are written from what finished.
  A second Ctrl-C kills everything. ``--resume`` continues an interrupted bench.
"""

from __future__ import annotations

from .plan import BenchConfig, BenchError
from .report import ABLATIONS, BASELINES, compare, format_tables, write_plots
from .run import Bench, run_seeds

__all__ = ["ABLATIONS", "BASELINES", "Bench", "BenchConfig", "BenchError", "compare",
           "format_tables", "run_seeds", "write_plots"]
