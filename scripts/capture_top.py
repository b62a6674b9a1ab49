"""Make the README's screenshot of ``mars top``: a real ``mars-vllm serve --policy mars`` on
the embedded tiny model (CPU), a short scaled ILR-3 replay against it, and one frame of
``mars top --svg`` taken once several sessions are live (running, in a tool, pinned).

    .venv/bin/python scripts/capture_top.py [--out docs/img/mars-top.svg]

Nothing is drawn by hand: the frame is what the sidecar and its stream said at that moment,
so two runs differ in their numbers (a CPU engine, wall-clock tools).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from mars.cli.types import positive_int
from mars.launch import ServerProcess

#: the test suite's small server: 16 MiB of KV (32,768 tokens of the tiny model), so a few
#: sessions fill it and the scheduler has to choose what to keep
SERVER = ["--policy", "mars", "--max-model-len", "16384", "--kv-cache-memory-bytes",
          str(16 << 20), "--max-num-seqs", "32", "--seed", "0"]
REPLAY = ["ILR-3", "--num-tasks", "16", "--scale", "50", "--time-scale", "20", "--rate", "2",
          "--seed", "0", "--tool-burn", "wall", "--ideal", "skip", "--no-plots", "--no-progress"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/img/mars-top.svg", help="the SVG to write")
    ap.add_argument("--sessions", type=positive_int, default=6,
                    help="take the frame once this many sessions are admitted (default: "
                         "%(default)s)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(args=SERVER) as srv:
        replay = subprocess.Popen([sys.executable, "-m", "mars.cli", "replay", *REPLAY,
                                   "--url", srv.url, "--out", f"{tmp}/run"],
                                  stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and replay.poll() is None:
                try:
                    sessions = httpx.get(srv.url + "/v1/mars/sessions", timeout=10).json()
                except httpx.HTTPError as e:
                    print(f"capture_top: the server stopped answering ({e})", file=sys.stderr)
                    return 1
                live = [s for s in sessions["sessions"] if s["state"] == "admitted"]
                if len(live) >= args.sessions:
                    break
                time.sleep(0.5)
            else:
                print("capture_top: the replay ended (or stalled) before "
                      f"{args.sessions} sessions were live", file=sys.stderr)
                return 1
            return subprocess.call([sys.executable, "-m", "mars.cli", "top", "--url", srv.url,
                                    "--interval", "1.5", "--svg", args.out])
        finally:
            replay.send_signal(signal.SIGINT)  # as Ctrl-C: it stops its tools and exits
            try:
                replay.wait(timeout=60)
            except subprocess.TimeoutExpired:
                replay.kill()
                replay.wait()


if __name__ == "__main__":
    sys.exit(main())
