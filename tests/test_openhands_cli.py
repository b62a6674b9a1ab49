"""``mars openhands ...`` from the serving environment: hands its arguments to the agent
runner in the Python 3.12 agent environment, or says how to make one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARS = [sys.executable, "-m", "mars.cli"]


def test_without_an_agent_environment_it_says_how_to_make_one(tmp_path):
    env = {**os.environ, "MARS_AGENTS_VENV": str(tmp_path / "none")}
    r = subprocess.run([*MARS, "openhands", "run", "--help"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode != 0
    assert "no agent environment" in r.stderr and "make setup-agents" in r.stderr
    assert "Traceback" not in r.stderr


def test_it_runs_the_agent_runner_with_every_argument():
    """`make test` creates .venv-agents before this suite runs; a checkout without it is
    covered by the test above."""
    venv = Path(os.environ.get("MARS_AGENTS_VENV") or ROOT / ".venv-agents")
    if not (venv / "bin" / "python").exists():
        pytest.skip("no agent environment (make setup-agents)")
    r = subprocess.run([*MARS, "openhands", "run", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--concurrency" in r.stdout and "--url" in r.stdout  # the runner's own options
    r = subprocess.run([*MARS, "openhands", "run"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--url" in r.stderr  # its own argument errors, its exit code
