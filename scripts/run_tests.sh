#!/usr/bin/env bash
# Run the whole suite: the serving environment's tests, then the agent environment's.
# pytest's exit code 5 ("no tests collected") is a failure here: a suite that ran nothing
# must not look green.
set -uo pipefail
cd "$(dirname "$0")/.."
rc=0
.venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 --ignore=tests/agents tests || rc=$?
if [ -x .venv-agents/bin/python ]; then
  .venv-agents/bin/python -m pytest -q -p no:cacheprovider tests/agents || rc=$((rc ? rc : $?))
fi
exit $rc
