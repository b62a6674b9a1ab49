"""mars: agent-aware LLM serving on vLLM (MARS, paper 002 in ../shared/papers).

Layout (one import name; each subpackage is one component of the design):

- ``mars.protocol``: the event schema and session metadata every side speaks.
- ``mars.policy``: the framework-free policies, one folder per plane (``engine``: MLFQ,
  retention, baselines; ``control``: AIMD window, packing, admission). Imports neither vLLM,
  FastAPI nor OpenHands.
- ``mars.engine``: the only package that touches vLLM internals (scheduler classes, the
  emulated GPU's executor, engines without a server, ``mars-vllm serve``).
- ``mars.sidecar``: the external control plane served (OpenAI-compatible proxy with admission).
- ``mars.sim``, ``mars.emulate``, ``mars.bench``: the simulator, the emulated GPU, the policy
  comparison. ``mars.cli``: every ``mars`` command.
- ``mars.workloads``: agent trace generator, ``mars replay`` and reports.
- ``mars.openhands_integration``: instrumented OpenHands tools and agent runner (Python 3.12 env).
- ``mars.model``: the embedded tiny model generator (``mars model tiny DIR``).
"""

__version__ = "0.1.0"
