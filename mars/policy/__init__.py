"""Framework-free policy layer: the paper's two planes, each a folder, and the registry that
names a system as one row of both.

- :mod:`mars.policy.engine`: the internal, agent-centric scheduler's decisions (§4.3): the
  ordering and retention contracts (``base``), MARS's MLFQ and cost/benefit retention, the
  baselines', the admission headroom and the engine's own speed (``step_stats``);
- :mod:`mars.policy.control`: the external control plane's (§4.2): UpdateWindow
  (``window``), PackQueue (``packing``), BalanceAndAdmit (``admission``, ``growth``), the
  dual-pressure signals (``pressure``, ``slowdown``) and the sans-IO session bookkeeping the
  served sidecar and the simulator both drive (``admission_core``);
- :mod:`mars.policy.registry`: ``--policy NAME`` -> one row of each.

The two planes never import each other; both speak :mod:`mars.protocol` (events, session
metadata). Everything here is pure Python (plus pydantic and numpy where handy) so that it can
be imported by the vLLM EngineCore process, the FastAPI sidecar and the Python 3.12 OpenHands
environment alike, and unit-tested without any of them. Importing vLLM, FastAPI or OpenHands
from this package is a bug (``tests/test_layering.py`` checks).
"""
