#!/usr/bin/env bash
# Fetch Debian's prometheus package and unpack its binaries into .cache/prometheus/ (no root,
# no service: the dashboard test starts it itself on a loopback port). Idempotent. Not fatal:
# where the Debian archive cannot be reached, tests/test_dashboard.py skips and says why.
set -uo pipefail
cd "$(dirname "$0")/.."
dest=.cache/prometheus
[ -x "$dest/usr/bin/prometheus" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download prometheus >"$tmp/log" 2>&1); then
    echo "setup_prometheus: apt-get download prometheus failed (the dashboard test will skip):" >&2
    tail -n 3 "$tmp/log" >&2
    exit 0
fi
mkdir -p "$dest" && dpkg -x "$tmp"/prometheus_*.deb "$dest" && "$dest/usr/bin/prometheus" --version \
    >/dev/null 2>&1 || { echo "setup_prometheus: unpacking failed" >&2; rm -rf "$dest"; exit 0; }
