"""``mars openhands ...``: the OpenHands integration, run from the serving environment.

The agents run in their own Python 3.12 environment (``.venv-agents``, made by
``scripts/setup_agents.sh``; ``$MARS_AGENTS_VENV`` elsewhere): every openhands-sdk 1.x needs
Python >= 3.12 and cannot be installed next to vLLM 0.32. This command hands its arguments
to ``python -m mars.openhands_integration`` there (``run``, ``check``, ``tasks``), replacing
this process, so signals, output and the exit code are the agent runner's own.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

#: the repository root when installed editable (``pip install -e .``), as the set-up does
_ROOT = Path(__file__).resolve().parents[2]


def agents_python() -> Path:
    """The agent environment's interpreter; SystemExit with the set-up command if absent."""
    venv = Path(os.environ.get("MARS_AGENTS_VENV") or _ROOT / ".venv-agents")
    py = venv / "bin" / "python"
    if not py.exists():
        raise SystemExit(
            f"mars openhands: no agent environment at {venv} (OpenHands needs Python 3.12, "
            "apart from vLLM): create it with `make setup-agents` "
            "(scripts/setup_agents.sh), or point $MARS_AGENTS_VENV at one")
    return py


def forward(rest: list[str]) -> int:
    """Replace this process with the agent runner, given ``rest`` (``mars openhands REST``)."""
    py = agents_python()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(str(py), [str(py), "-m", "mars.openhands_integration", *rest])
    return 0  # pragma: no cover - execv does not return


def _run(args: argparse.Namespace) -> int:
    return forward(args.rest)


def register(sub) -> None:
    p = sub.add_parser(
        "openhands", add_help=False,
        help="OpenHands agents against a mars server (run, check, tasks; in .venv-agents)",
        description=__doc__.split("\n\n")[0])
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="run | check | tasks, and their options (`mars openhands run --help`)")
    p.set_defaults(func=_run)
