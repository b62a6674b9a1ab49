#!/usr/bin/env bash
# Run the whole suite, in three parts:
#   1. the serving environment's tests, whole modules spread over one pytest worker per core
#      (pytest-xdist --dist loadfile: a module's engine servers are shared by its tests), and
#      beside them the agent environment's tests, whose end-to-end test needs a real
#      `mars-vllm serve` (sidecar in front) that this script starts;
#   2. the `quiet` tests, alone: they time this machine's engine against a model of it, and a
#      neighbour on the other core would slow what they measure.
# pytest's exit code 5 ("no tests collected") counts as a failure: a suite that ran nothing
# must not look green.
#
# MARS_TEST_WORKERS=N: pytest workers for part 1 (default: the cores, at most 4; 0 runs it in
# one process). MARS_TEST_JUNIT=FILE: also write the serving suite's test durations there
# (where its time goes; the agent suite is not included), FILE.quiet.xml for part 2; a path
# relative to where the script was started.
set -uo pipefail
junit=() junit_quiet=()
if [ -n "${MARS_TEST_JUNIT:-}" ]; then
  junit=(--junitxml "$(realpath -m "$MARS_TEST_JUNIT")")
  junit_quiet=(--junitxml "$(realpath -m "$MARS_TEST_JUNIT").quiet.xml")
fi
cd "$(dirname "$0")/.."
cores=$(nproc)
workers=${MARS_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
xdist=()
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadfile)
start=$(date +%s)
stamp() { echo "run_tests: $1 at $(( $(date +%s) - start )) s" >&2; }

# the agent suite, in the background; its output is shown when it is done
agents_rc_file=$(mktemp) agents_log=$(mktemp)
echo 1 >"$agents_rc_file"
trap 'trap - INT TERM; kill 0' INT TERM
agents() {
  if [ ! -x .venv-agents/bin/python ]; then
    echo "run_tests: .venv-agents missing (scripts/setup_agents.sh failed?)" >&2
    return 1
  fi
  local port log server rc=0
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
      -p no:cacheprovider tests/agents || rc=$?
  kill -TERM -- $server 2>/dev/null; pkill -TERM -P $server 2>/dev/null; wait $server 2>/dev/null
  return $rc
}
( agents >"$agents_log" 2>&1; echo $? >"$agents_rc_file"; stamp "agent tests done" ) &
agents_pid=$!

rc=0
.venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 --durations=30 ${xdist[@]+"${xdist[@]}"} \
    ${junit[@]+"${junit[@]}"} -m "not quiet" --ignore=tests/agents tests || rc=$?
stamp "serving tests done"
wait $agents_pid
echo "---- agent tests (.venv-agents) ----"
cat "$agents_log"
arc=$(cat "$agents_rc_file"); rm -f "$agents_rc_file" "$agents_log"
[ "$arc" -ne 0 ] && [ $rc -eq 0 ] && rc=$arc

.venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 --durations=10 \
    ${junit_quiet[@]+"${junit_quiet[@]}"} -m quiet --ignore=tests/agents tests || { r=$?; [ $rc -eq 0 ] && rc=$r; }
stamp "quiet tests done"
exit $rc
