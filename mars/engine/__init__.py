"""The only package that touches vLLM internals, by job as vLLM's own tree is:

- :mod:`mars.engine.sched`: the scheduler classes ``--scheduler-cls`` loads (``scheduler``:
  thin hooks over vLLM's ``Scheduler`` / ``AsyncScheduler``; ``coordinator``: §4.3's
  Priority-Aware Coordinator; ``coscheduler``: §4.3's Opportunistic Co-Scheduler; ``calls``,
  ``pins``: their bookkeeping);
- :mod:`mars.engine.executor`: the emulated GPU as a vLLM executor and the platform plugin
  that lets it run vLLM's async scheduling;
- :mod:`mars.engine.harness`: vLLM's engine driven without a server (``offline``: the
  scheduler classes without a model, for tests and benchmarks; ``sim_engine``: the simulator's
  engine in virtual time; ``calibration`` and ``serving_bench``: measuring engines);
- :mod:`mars.engine.serve`: ``mars-vllm serve`` (``cli``) and its process handling.

Everything above it (policies, sidecar, workloads, simulator) imports no vLLM
(``tests/test_layering.py``).
"""
