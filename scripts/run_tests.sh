#!/usr/bin/env bash
# Run the whole suite: the serving environment's tests, then the agent environment's, whose
# end-to-end test needs a real `mars-vllm serve` (sidecar in front) that this script starts.
# pytest's exit code 5 ("no tests collected") counts as a failure: a suite that ran nothing
# must not look green.
set -uo pipefail
# MARS_TEST_JUNIT=FILE: also write the serving suite's test durations there (where its time
# goes; the agent suite is not included), a path relative to where the script was started
junit=()
[ -n "${MARS_TEST_JUNIT:-}" ] && junit=(--junitxml "$(realpath -m "$MARS_TEST_JUNIT")")
cd "$(dirname "$0")/.."
rc=0
.venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 --durations=30 ${junit[@]+"${junit[@]}"} \
    --ignore=tests/agents tests || rc=$?
if [ -x .venv-agents/bin/python ]; then
  port=$(.venv/bin/python -c "from mars.launch import free_port; print(free_port())")
  log=$(mktemp -d)/agents-server.log
  # the tiny model's tokenizer makes the OpenHands prompt ~18K tokens: a 32K context, and a
  # KV cache for two such sessions
  .venv/bin/mars-vllm serve --policy mars --max-model-len 32768 \
      --kv-cache-memory-bytes 67108864 --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
  server=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && break
    kill -0 $server 2>/dev/null || break
    sleep 1
  done
  MARS_TEST_URL="http://127.0.0.1:$port" .venv-agents/bin/python -m pytest -q \
      -p no:cacheprovider tests/agents || { r=$?; [ $rc -eq 0 ] && rc=$r; }
  kill -TERM -- $server 2>/dev/null; pkill -TERM -P $server 2>/dev/null; wait $server 2>/dev/null
else
  echo "run_tests: .venv-agents missing (scripts/setup_agents.sh failed?)" >&2
  rc=1
fi
exit $rc
