#!/usr/bin/env bash
# Create (or refresh) the Python 3.12 environment the OpenHands agents run in.
#
#   bash scripts/setup_agents.sh            # idempotent; quiet unless something fails
#   MARS_AGENTS_VENV=/path bash scripts/setup_agents.sh
#   MARS_AGENTS_PYTHON=/path/to/python3.12 bash scripts/setup_agents.sh
#
# Why a separate environment: every openhands-sdk 1.x needs Python >= 3.12, and SDK >= 1.50
# cannot be installed next to vLLM 0.32. The agents talk to mars over HTTP only, so this env
# gets the mars package with its base dependencies (pydantic, numpy, httpx, tqdm) and the
# OpenHands SDK + tools pinned together (openhands-tools does not pin the SDK; 1.58.1+ need a
# certifi release that is not published). Keep the pins in sync with pyproject's `agents` extra.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MARS_AGENTS_VENV:-$ROOT/.venv-agents}"
SDK_VERSION="1.58.0"
PKGS=("openhands-sdk==$SDK_VERSION" "openhands-tools==$SDK_VERSION" "pytest>=8" "pytest-timeout>=2.3")
LOG="$(mktemp -t mars-setup-agents.XXXXXX.log)"
trap 'rm -f "$LOG"' EXIT

fail() {
    echo "setup_agents: $1" >&2
    if [ -s "$LOG" ]; then echo "---- last lines of the log ----" >&2; tail -n 40 "$LOG" >&2; fi
    exit 1
}

find_python() {
    if [ -n "${MARS_AGENTS_PYTHON:-}" ]; then echo "$MARS_AGENTS_PYTHON"; return; fi
    local cand
    for cand in /root/.pyenv/versions/3.12*/bin/python "$HOME"/.pyenv/versions/3.12*/bin/python; do
        [ -x "$cand" ] && { echo "$cand"; return; }
    done
    if command -v pyenv >/dev/null 2>&1; then
        cand="$(pyenv root)/versions/$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12' | tail -n1)/bin/python"
        [ -x "$cand" ] && { echo "$cand"; return; }
    fi
    for cand in python3.12 python3.13; do
        command -v "$cand" >/dev/null 2>&1 && { command -v "$cand"; return; }
    done
    return 1
}

# 1. bubblewrap (terminal confinement); optional: without it the runner says it is unconfined.
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >>"$LOG" 2>&1; then
            echo "setup_agents: WARNING: could not install bubblewrap; terminals will run UNCONFINED" >&2
        fi
    else
        echo "setup_agents: WARNING: bubblewrap (bwrap) missing and cannot be installed here; terminals will run UNCONFINED" >&2
    fi
fi

# 2. the virtual environment
PY="$(find_python)" || fail "no Python 3.12 found (set MARS_AGENTS_PYTHON)"
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    fail "$VENV exists but is not Python >= 3.12; remove it and run again"
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV" >>"$LOG" 2>&1 || fail "python -m venv $VENV failed"
fi
VPY="$VENV/bin/python"

# 3. packages: skip pip entirely when everything is already in place (fast re-runs)
if "$VPY" - "$ROOT" "$SDK_VERSION" >>"$LOG" 2>&1 <<'PYEOF'
import sys, importlib.metadata as md, pathlib
root, want = sys.argv[1], sys.argv[2]
assert md.version("openhands-sdk") == want and md.version("openhands-tools") == want
import mars, pytest, pytest_timeout  # noqa: F401
assert pathlib.Path(mars.__file__).resolve().is_relative_to(pathlib.Path(root).resolve()), mars.__file__
import importlib.util  # entry points of an install made before a module moved: reinstall
for ep in md.distribution("mars-serve").entry_points:
    assert importlib.util.find_spec(ep.module) is not None, ep
PYEOF
then
    exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VPY" -m pip install -q -e "$ROOT" "${PKGS[@]}" >>"$LOG" 2>&1 || fail "pip install failed"
rm -rf "$ROOT/mars_serve.egg-info"  # build metadata: would shadow the installed entry points
LITELLM_LOCAL_MODEL_COST_MAP=True OPENHANDS_SUPPRESS_BANNER=1 \
    "$VPY" -c 'import openhands.sdk, openhands.tools.terminal, openhands.tools.file_editor, openhands.tools.task_tracker, mars.openhands_integration' \
    >>"$LOG" 2>&1 || fail "the SDK does not import in $VENV"
