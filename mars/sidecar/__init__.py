"""The external control plane (paper §4.1-§4.2): an OpenAI-compatible proxy in front of vLLM.

It identifies agent sessions, admits them through ``BalanceAndAdmit`` (AIMD window + queue
packing, :mod:`mars.policy.control.admission`), merges the engine's and the tools' events into the
unified information stream, and exports metrics. ``create_app`` builds the FastAPI app,
``mars sidecar`` (``python -m mars.cli.sidecar``) runs it; see docs/sidecar.md.
"""
