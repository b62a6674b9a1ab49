#!/usr/bin/env bash
# Run the whole suite, in three parts:
#   1. the serving environment's tests, whole modules spread over one pytest worker per core
#      (pytest-xdist --dist loadfile: a module's engine servers are shared by its tests;
#      tests/conftest.py sends modules that share a server to one worker together);
#   2. the agent environment's tests, whose end-to-end test needs a real `mars-vllm serve`
#      (sidecar in front) that this script starts. Not beside part 1: on two cores busy with
#      it, a terminal tool's command after an interrupted one once missed its 10 s timeout;
#   3. the `quiet` tests, alone: they time this machine's engine against a model of it, and a
#      neighbour on the other core would slow what they measure.
# pytest's exit code 5 ("no tests collected") counts as a failure: a suite that ran nothing
# must not look green.
#
# MARS_TEST_WORKERS=N: pytest workers for part 1 (default: the cores, at most 4; 0 runs it in
# one process). MARS_TEST_JUNIT=FILE: also write the serving suite's test durations there
# (where its time goes; the agent suite is not included), FILE.quiet.xml for part 3; a path
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
if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
  echo "run_tests: MARS_TEST_WORKERS must be a number of workers, not '$workers'" >&2
  exit 2
fi
xdist=()
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadfile)
start=$(date +%s)
stamp() { echo "run_tests: $1 at $(( $(date +%s) - start )) s" >&2; }

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# (the long commands below run in the background and are waited for: bash runs a trap only
# between commands, and `wait` is one it can interrupt; each in a subshell, where Ctrl-C is
# not ignored as it is for a plain `command &` of a script, so the tests see it as usual)
trap 'trap - INT TERM; kill 0' INT TERM
agents() {
  if [ ! -x .venv-agents/bin/python ]; then
    echo "run_tests: .venv-agents missing (scripts/setup_agents.sh failed?)" >&2
    return 1
  fi
  local port log=$scratch/agents-server.log server rc=0 attempt up
  # a port picked free can be taken by another test's server before this one binds it: the
  # server then exits at once saying so, and starts again on a fresh one (as ServerProcess)
  for attempt in 1 2 3 4; do
    port=$(.venv/bin/python -c "from mars.launch import free_port; print(free_port())")
    # the tiny model's tokenizer makes the OpenHands prompt ~18K tokens: a 32K context, and
    # a KV cache for two such sessions
    .venv/bin/mars-vllm serve --policy mars --max-model-len 32768 \
        --kv-cache-memory-bytes 67108864 --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
    server=$! up=0
    for _ in $(seq 1 300); do
      curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && { up=1; break; }
      kill -0 $server 2>/dev/null || break
      sleep 1
    done
    [ $up -eq 1 ] && break
    wait $server 2>/dev/null
    grep -qi "address already in use" "$log" || break
    echo "run_tests: the agent server's port was taken; again on another (attempt $attempt)" >&2
  done
  if [ $up -ne 1 ]; then
    echo "run_tests: the agent tests' server did not start; its log:" >&2
    tail -n 40 "$log" >&2
  fi
  MARS_TEST_URL="http://127.0.0.1:$port" .venv-agents/bin/python -m pytest -q \
      -p no:cacheprovider tests/agents || rc=$?
  kill -TERM -- $server 2>/dev/null; pkill -TERM -P $server 2>/dev/null; wait $server 2>/dev/null
  return $rc
}
rc=0
( exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 --durations=30 \
    ${xdist[@]+"${xdist[@]}"} ${junit[@]+"${junit[@]}"} -m "not quiet" --ignore=tests/agents tests ) &
wait $! || rc=$?
stamp "serving tests done"
echo "---- agent tests (.venv-agents) ----"
( agents ) &
wait $! || { r=$?; [ $rc -eq 0 ] && rc=$r; }
stamp "agent tests done"

( exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 --durations=10 \
    ${junit_quiet[@]+"${junit_quiet[@]}"} -m quiet --ignore=tests/agents tests ) &
wait $! || { r=$?; [ $rc -eq 0 ] && rc=$r; }
stamp "quiet tests done"
exit $rc
