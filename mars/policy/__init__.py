"""Framework-free policy layer.

Everything here is pure Python (plus pydantic for the event schema and numpy where handy) so
that it can be imported by the vLLM EngineCore process, the FastAPI sidecar and the Python
3.12 OpenHands environment alike, and unit-tested without any of them. Importing vLLM,
FastAPI or OpenHands from this package is a bug (``tests/test_layering.py`` checks).
"""
