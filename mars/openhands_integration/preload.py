"""Imported once by the runner's forkserver so every worker starts with the SDK loaded.

Importing the OpenHands SDK costs seconds and ~250 MB per process; a forked worker shares
the already-imported modules copy-on-write.
"""

from .env import prepare_sdk_env

prepare_sdk_env()

import os  # noqa: E402

os.environ.setdefault("LOG_LEVEL", "WARNING")

from . import agent, llm, tools  # noqa: E402,F401  (registers the instrumented tools)
