"""Helpers shared by the OpenHands-integration tests (imported by name: conftest puts this
directory on sys.path)."""

from __future__ import annotations

import pytest

from mars.openhands_integration.workspace import bwrap_works

requires_bwrap = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not usable here")
