"""The sidecar in front of ``mars-vllm serve``'s engine: the public port bound before the engine
loads, ``mars sidecar`` started on it, and a watcher that takes the server down when the
sidecar dies (the engine alone on its loopback port would serve nobody).

Kept apart from :mod:`mars.engine.serve.cli` (vLLM's parser, mars's defaults and checks) since
it is the one part of the command that supervises a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading


def bind_public(host: str, port: int) -> socket.socket:
    """Listen on the public address now, before the engine loads, for the sidecar to inherit.

    Bound by the sidecar itself, a taken port failed only after the engine had loaded, and
    the engine went on serving on its loopback port with nothing in front of it: a server
    that never answers (issue: the bench's parallel servers, whose ports are picked free a
    few seconds before they are bound, hung 600 s in CI).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(addr)
        sock.listen(4096)
    except OSError as exc:
        raise SystemExit(f"mars-vllm: cannot listen on {host}:{port}: {exc.strerror or exc}"
                         ) from None
    sock.set_inheritable(True)
    return sock


#: set by the watcher when the sidecar failed while the engine was serving
_sidecar_failed: int | None = None
#: set once this process stops its sidecar itself (at exit): its end is then expected
_stopping_sidecar = threading.Event()


def sidecar_failed() -> int | None:
    """The failed sidecar's exit status, or None while it has not failed."""
    return _sidecar_failed


def stopping_sidecar() -> None:
    """Say that this process is stopping its sidecar itself: its end is then expected."""
    _stopping_sidecar.set()


#: signals a sidecar dies of when it was asked to stop (uvicorn re-raises the one it caught)
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def _watch_sidecar(proc, grace_s: float) -> None:
    """Take the server down when its sidecar exits: the engine alone on its loopback port
    serves nobody, and a supervisor sees a live process that never answers (a liveness
    defect, not a degraded mode).

    A sidecar that failed (an error status, a crash, SIGKILL) stops the engine at once and
    makes the command exit 1. One stopped by a stop signal was usually stopped with us (the
    process group's SIGTERM, Ctrl-C): we are draining already, and a second signal could
    land in vLLM's teardown, so it waits for our own drain bound (``grace_s``) and signals
    us only if we are still running by then (the sidecar alone was stopped)."""
    global _sidecar_failed
    code = proc.wait()
    if _stopping_sidecar.is_set():
        return
    if code < 0 and -code in _STOP_SIGNALS:
        if _stopping_sidecar.wait(grace_s):
            return
        print(f"mars-vllm: the sidecar was stopped (signal {-code}); stopping the engine too",
              file=sys.stderr, flush=True)
    else:
        _sidecar_failed = code
        print(f"mars-vllm: the sidecar exited with status {code} (see its lines above); "
              "shutting the engine down", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def sidecar_options(args: argparse.Namespace) -> dict:
    """``--sidecar-args``: the extra ``mars sidecar`` options, a JSON object (refused with
    the reason otherwise)."""
    try:
        extra = json.loads(args.sidecar_args) if args.sidecar_args else {}
    except ValueError as exc:
        raise SystemExit(f"mars-vllm: --sidecar-args is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise SystemExit("mars-vllm: --sidecar-args must be a JSON object of sidecar options")
    return extra


def start_sidecar(args: argparse.Namespace, dp_size: int):
    """Start ``mars sidecar`` on the public --host/--port and move the engine behind it.

    Mutates ``args`` (host, port) so vLLM serves on 127.0.0.1:--engine-port. The engine
    events endpoint was already derived from the public port, so ``mars events tail --port``
    keeps working. The child dies with us: the sidecar asks the kernel for SIGTERM on our
    death (``--parent-pid``) and we terminate it at exit.
    """
    import atexit
    import subprocess

    from mars.launch import free_port
    from mars.policy.registry import get_policy

    public_host = args.host or "0.0.0.0"
    public_port = args.port
    listener = bind_public(public_host, public_port)
    engine_port = args.engine_port or free_port()
    admission = "on" if get_policy(args.policy).sidecar_admission else "off"
    cmd = [sys.executable, "-m", "mars.cli.sidecar", "--upstream", f"http://127.0.0.1:{engine_port}",
           "--host", public_host, "--port", str(public_port), "--admission", admission,
           "--listen-fd", str(listener.fileno()),
           "--engine-events", args.mars_events_endpoint, "--parent-pid", str(os.getpid()),
           # a SIGTERM to the process group reaches both: the sidecar keeps relaying the
           # streams the engine drains, a little longer than the engine takes
           "--drain-timeout", str(int(getattr(args, "shutdown_timeout", 0) or 0) + 5)]
    if getattr(args, "block_size", None):
        cmd += ["--admission-config", json.dumps({"packing": {"block_size": args.block_size}})]
    for key, value in sidecar_options(args).items():  # later flags win, so these override the defaults above
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value not in (False, None):
            cmd += [flag, value if isinstance(value, str) else json.dumps(value)]
    if getattr(args, "mars_open_metrics", False):
        cmd.append("--open-metrics")
    if getattr(args, "tool_cores", None):
        cmd += ["--tool-cores", str(args.tool_cores)]
    if dp_size > 1:  # vLLM's engines behind one API server: the sidecar places sessions on them
        cmd += ["--data-parallel-size", str(dp_size)]
    # keys travel in the environment, not argv (``ps`` shows argv to every local user)
    env = dict(os.environ)
    if getattr(args, "api_key", None):
        from mars.sidecar.auth import KEYS_ENV

        env[KEYS_ENV] = "\n".join(args.api_key)
    if getattr(args, "mars_events_api_key", None):
        from mars.sidecar.auth import EVENTS_KEYS_ENV

        env[EVENTS_KEYS_ENV] = args.mars_events_api_key
    proc = subprocess.Popen(cmd, env=env, pass_fds=(listener.fileno(),))
    listener.close()  # the sidecar holds it now

    def _stop() -> None:
        _stopping_sidecar.set()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    atexit.register(_stop)
    grace = float(getattr(args, "shutdown_timeout", 0) or 0) + 10.0
    threading.Thread(target=_watch_sidecar, args=(proc, grace), name="mars-sidecar-watch",
                     daemon=True).start()
    args.host, args.port = "127.0.0.1", engine_port
    print(f"mars: sidecar on {public_host}:{public_port} (admission {admission}, pid {proc.pid})"
          f" -> engine on 127.0.0.1:{engine_port}", file=sys.stderr, flush=True)
    return proc
