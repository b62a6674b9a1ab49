"""Run the sidecar's app under uvicorn, as one process: the served shell's outermost layer.

The command (:mod:`mars.cli.sidecar`: ``mars sidecar``, or ``python -m mars.cli.sidecar``, which
``mars-vllm serve`` starts) reads a :class:`SidecarConfig` and calls :func:`serve`.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

from mars.sidecar.config import SidecarConfig


def serve(config: SidecarConfig) -> int:
    import uvicorn

    from mars.sidecar.app import create_app

    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.parent_pid:
        # SIGKILL: the engine died with our parent, there is nothing left to drain
        from mars.launch import die_with_parent

        die_with_parent(signal.SIGKILL, config.parent_pid)
    app = create_app(config)
    if not config.api_keys and config.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"mars sidecar: WARNING: listening on {config.host} without --api-key: anyone who "
              "can reach the port can generate, read every session's events and end sessions",
              file=sys.stderr, flush=True)
    print(f"mars sidecar: http://{config.host}:{config.port} -> {config.upstream} "
          f"admission={'on' if config.admission else 'off'} "
          f"engine-events={config.engine_events or 'none'} "
          f"events-file={config.events_file or 'none'} "
          f"auth={'on' if config.api_keys else 'off'}", file=sys.stderr, flush=True)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                        access_log=config.access_log, loop="auto", http="auto", backlog=4096,
                        timeout_graceful_shutdown=max(1, round(config.drain_timeout_s)),
                        timeout_keep_alive=30, proxy_headers=False)
    server = uvicorn.Server(uv)
    if config.listen_fd is not None:
        server.run(sockets=[socket.socket(fileno=config.listen_fd)])
    else:
        server.run()
    # uvicorn returns (does not raise) when it cannot bind: a server that never served failed
    return 0 if server.started else 1
