"""``mars top --url URL``: a live terminal view of what a mars sidecar is doing.

It polls the control plane's state and sessions every ``--interval`` seconds and follows the
unified event stream for what only the stream says (tools, pins, preemptions); the model
(:mod:`mars.top.model`) joins them and the view (:mod:`mars.top.view`) draws them with rich.
Keys: ``s`` sort, ``f`` filter by state, ``q`` (or Ctrl-C) quit. ``--svg FILE`` writes one
frame as an image instead (the README's screenshot is made so: scripts/capture_top.py). A
server that does not answer, or stops answering, ends it with one line saying so (status 1),
never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import select
import signal
import sys
import threading
import time
from typing import Any

from mars.cli.types import positive_float, positive_int
from mars.protocol.sse import iter_sse_lines


class SidecarGone(Exception):
    """The sidecar did not answer (down, not a sidecar, or refused the key)."""


class Source:
    """The sidecar's HTTP side: polled state, and the event stream on a thread of its own."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float = 5.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        except (httpx.InvalidURL, ValueError) as e:
            raise SidecarGone(f"--url {url!r}: {e}") from None
        self.events: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=100_000)
        #: the stream's state for the header: connecting, live, or why it is not
        self.stream_status = "connecting"
        self._stop = threading.Event()

    def _get(self, path: str) -> Any:
        import httpx

        try:
            r = self.client.get(path)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise SidecarGone(f"no answer from {self.url} ({type(e).__name__}: {e})") from None
        if r.status_code == 404:
            raise SidecarGone(f"{self.url} is not a mars sidecar (no {path}); give the "
                              "public port of `mars-vllm serve` or of `mars sidecar`")
        if r.status_code == 401:
            raise SidecarGone(f"{self.url} wants an API key (--api-key, or $VLLM_API_KEY)")
        if r.status_code != 200:
            raise SidecarGone(f"{self.url}{path} answered {r.status_code}")
        try:
            return r.json()
        except ValueError:
            raise SidecarGone(f"{self.url}{path} did not answer like a mars sidecar "
                              "(not JSON)") from None

    def poll(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        state, sessions = self._get("/v1/mars/state"), self._get("/v1/mars/sessions")
        if not isinstance(sessions, dict) or not isinstance(sessions.get("sessions"), list):
            raise SidecarGone(f"{self.url}/v1/mars/sessions did not answer like a mars sidecar")
        return state, sessions["sessions"]

    def follow(self, kinds: tuple[str, ...]) -> None:
        threading.Thread(target=self._follow, args=(kinds,), daemon=True,
                         name="mars-top-stream").start()

    def _follow(self, kinds: tuple[str, ...]) -> None:
        """Follow the stream; when it fails or ends, say so in the header and connect again
        (1 s, then up to 30 s apart): tools and pins go stale while it is down, visibly."""
        import json

        import httpx

        backoff = 1.0
        while not self._stop.is_set():
            try:
                with self.client.stream("GET", "/v1/mars/events/stream",
                                        params={"kind": ",".join(kinds)},
                                        timeout=httpx.Timeout(5.0, read=None)) as r:
                    if r.status_code != 200:
                        self.stream_status = f"refused ({r.status_code})"
                    else:
                        self.stream_status, backoff = "live", 1.0
                        for line in iter_sse_lines(r.iter_bytes()):
                            if self._stop.is_set():
                                return
                            if line.startswith("data: "):
                                with contextlib.suppress(ValueError, queue.Full):
                                    self.events.put_nowait(json.loads(line[6:]))
                        self.stream_status = "ended; reconnecting"
            except (httpx.HTTPError, httpx.InvalidURL) as e:
                self.stream_status = f"lost ({type(e).__name__}); reconnecting"
            self._stop.wait(backoff)
            backoff = min(30.0, backoff * 2)

    def close(self) -> None:
        self._stop.set()
        self.client.close()


class Keys:
    """Single key presses from a terminal (cbreak mode, restored on exit); none elsewhere."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
        self._saved: Any = None

    def __enter__(self) -> Keys:
        if self.fd is not None:
            import termios
            import tty

            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def read(self, timeout_s: float) -> str | None:
        if self.fd is None:
            time.sleep(timeout_s)
            return None
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return None
        key = os.read(self.fd, 1)
        if not key:  # end of input: no more keys
            self.fd = None
        return key.decode(errors="ignore") or None


def _interrupt(signum: int, frame: Any) -> None:  # noqa: ARG001
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError as e:
        print(f"mars top: {e}; install the sidecar extra (pip install -e '.[sidecar]')",
              file=sys.stderr)
        return 1
    from mars.top.model import KINDS, TopModel
    from mars.top.view import frame

    # a kill or a dropped SSH session unwinds like Ctrl-C: the terminal gets its echo and
    # cursor back
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    if args.width is not None and not args.svg:
        print("mars top: --width is for --svg (a terminal has its own width)", file=sys.stderr)
        return 2
    args.width = args.width or 110
    model = TopModel()
    console = Console()
    src = None
    try:
        src = Source(args.url, args.api_key)
        _poll(model, src)
        if args.once:
            console.print(frame(model, src.url, time.time()))
            return 0
        src.follow(KINDS)
        if args.svg:
            return _save_svg(model, src, args)
        if not console.is_terminal:
            # a pipe, or ssh without -t: a frame per interval, in plain text
            while True:
                time.sleep(args.interval)
                _drain(model, src)
                _poll(model, src)
                console.print(frame(model, src.url, time.time()))
        with Keys() as keys, Live(frame(model, src.url, time.time()), console=console,
                                  auto_refresh=False, screen=False) as live:
            next_poll = time.monotonic() + args.interval
            while True:
                key = keys.read(min(0.2, args.interval))
                if key in ("q", "Q"):
                    break
                if key in ("s", "S"):
                    model.next_sort()
                elif key in ("f", "F"):
                    model.next_filter()
                _drain(model, src)
                if time.monotonic() >= next_poll:
                    _poll(model, src)
                    next_poll = time.monotonic() + args.interval
                live.update(frame(model, src.url, time.time()), refresh=True)
    except SidecarGone as e:
        print(f"mars top: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.svg:  # interrupted before the frame was taken: nothing written
            print("mars top: interrupted; no SVG written", file=sys.stderr)
            return 130
    finally:
        if src is not None:
            src.close()
    return 0


def _save_svg(model: Any, src: Source, args: argparse.Namespace) -> int:
    """One frame after watching the stream for one interval, written as an SVG: what a
    screenshot in the docs is made of (rich draws it; no terminal needed). The interval
    starts once the stream is live (at most 10 s of waiting), so the frame holds one whole
    interval of its events."""
    from rich.console import Console

    from mars.top.view import frame

    deadline = time.monotonic() + 10.0
    while src.stream_status != "live" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(args.interval)
    _drain(model, src)
    _poll(model, src)
    with open(os.devnull, "w") as sink:
        rec = Console(record=True, width=args.width, file=sink, force_terminal=True,
                      color_system="truecolor")
        rec.print(frame(model, src.url, time.time()))
    try:
        rec.save_svg(args.svg, title="mars top")
    except OSError as e:
        print(f"mars top: cannot write {args.svg}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"mars top: wrote {args.svg}", file=sys.stderr)
    return 0


def _poll(model: Any, src: Source) -> None:
    try:
        model.poll(*src.poll())
    except ValueError as e:
        raise SidecarGone(f"{src.url} did not answer like a mars sidecar ({e})") from None


def _drain(model: Any, src: Source) -> None:
    model.stream_status = src.stream_status
    while not src.events.empty():
        model.event(src.events.get_nowait())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="a live terminal view of a mars sidecar (window, KV, "
                                   "sessions, pins, tools)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the sidecar: the public URL of `mars-vllm serve` or `mars sidecar` "
                        "(default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), metavar="KEY",
                   help="the sidecar's API key, if it has one (default: $VLLM_API_KEY)")
    p.add_argument("--interval", type=positive_float, default=1.0, metavar="S",
                   help="seconds between polls of the control plane (default: %(default)s)")
    once = p.add_mutually_exclusive_group()
    once.add_argument("--once", action="store_true",
                      help="print one frame of the polled state and exit (scripts, logs; "
                           "the stream's tools and pins show in the live view)")
    once.add_argument("--svg", metavar="FILE",
                      help="watch the stream for one --interval, write that frame to FILE as an "
                           "SVG image (colours kept) and exit: screenshots for docs and reports")
    p.add_argument("--width", type=positive_int, default=None, metavar="COLS",
                   help="columns of the --svg frame (default: 110)")
    p.set_defaults(func=run)
