"""``mars sim``: the served stack's decisions in virtual time (issue #16).

One process, one virtual clock: vLLM's own ``EngineCore`` with our scheduler on the emulated
GPU (:mod:`mars.engine.harness.sim_engine`), the sidecar's admission core
(:class:`mars.policy.control.admission_core.AdmissionCore`, the object the served sidecar drives),
tools on ``N`` virtual CPU cores, and the replay's trace semantics. Each engine step advances
the clock by the step-time model's time for the batch vLLM scheduled; nothing here decides
what runs. Outputs are ``mars replay``'s ``results.json`` and ``events.jsonl``.

* :mod:`mars.sim.clock` -- the timeline: a virtual clock and timed callbacks;
* :mod:`mars.sim.tools` -- tools queueing for ``N`` cores;
* :mod:`mars.sim.control` -- the admission core's shell in virtual time (the sidecar's job);
* :mod:`mars.sim.runner` -- the agents: tasks, rounds, prompts, tools, results;
* :mod:`mars.sim.host` -- the served host's per-round delays, measured off a real run;
* :mod:`mars.sim.fidelity` -- what a run's latency is made of, for comparing with a real one.
"""
