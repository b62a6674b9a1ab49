"""Shared fixtures for the OpenHands-integration tests.

Tests that need the OpenHands SDK call ``pytest.importorskip("openhands.sdk")`` (they run
in ``.venv-agents``: ``.venv-agents/bin/python -m pytest tests/agents``); the rest (event
sink, sanitisation, workspaces, task set) only need the base dependencies and run anywhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# must be in place before any test imports the SDK
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
os.environ.setdefault("LOG_LEVEL", "WARNING")


@pytest.fixture
def ws_base(tmp_path):
    """A base directory for task workspaces (outside /tmp's sandbox tmpfs is fine too)."""
    base = tmp_path / "ws"
    base.mkdir()
    return base


@pytest.fixture
def stub():
    from oh_stub import StubOpenAI

    with StubOpenAI() as s:
        yield s


@pytest.fixture
def free_port():
    """A loopback port with nothing listening on it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
