"""What every side of mars speaks: the unified event stream's schema (``events``: engine,
tool and control events) and the session metadata clients attach to each LLM call
(``session``). Pure Python and pydantic: imported by the engine's scheduler, the sidecar, the
simulator, the workloads and the OpenHands environment alike.
"""
