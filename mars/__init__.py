"""mars: agent-aware LLM serving on vLLM (MARS, paper 002 in ../shared/papers).

Layout (one import name; each subpackage is one component of the design):

- ``mars.policy``: framework-free policy layer (event schema, MLFQ, AIMD, packing, retention,
  baselines, metrics). Imports neither vLLM, FastAPI nor OpenHands.
- ``mars.vllm_patches``: the only package that touches vLLM internals (scheduler class,
  ``mars-vllm serve`` entry point, engine event publisher).
- ``mars.sidecar``: the external control plane (OpenAI-compatible proxy with admission).
- ``mars.workloads``: agent trace generator, ``mars replay`` and reports.
- ``mars.openhands_integration``: instrumented OpenHands tools and agent runner (Python 3.12 env).
- ``mars.model``: the embedded tiny model generator (``mars model tiny DIR``).
"""

__version__ = "0.1.0"
