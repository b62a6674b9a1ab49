"""``mars sidecar``: run the external control plane in front of a vLLM server.

    mars sidecar --upstream http://127.0.0.1:8001 --port 8000 [--admission on|off]
                 [--events-file F] [--engine-events ENDPOINT|none] ...
    mars sidecar --upstream URL1,URL2,... [--placement mars]   (several engines, one model)

``mars-vllm serve`` starts this by default on the public port, as ``python -m
mars.cli.sidecar`` (see ``--no-sidecar``).
"""

from __future__ import annotations

import argparse
import os
import sys

from mars.policy.control.admission import AdmissionConfig
from mars.policy.control.placement import PLACERS
from mars.policy.control.pressure import CPU_BUDGETS
from mars.sidecar.auth import EVENTS_KEYS_ENV, KEYS_ENV
from mars.sidecar.config import (
    SidecarConfig,
    admission_config,
    engine_events_for,
    read_admission_overrides,
)


def _on_off(v: str) -> bool:
    v = v.strip().lower()
    if v in ("on", "true", "1", "yes"):
        return True
    if v in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError("expected on or off")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SidecarConfig()
    p.add_argument("--upstream", required=True, metavar="URL[,URL...]",
                   help="base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8001; "
                        "several, comma-separated: engines of one model, one server each "
                        "(`mars-vllm serve --no-sidecar`), each session placed on one of them "
                        "(--placement)")
    p.add_argument("--host", default=d.host, help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on (default: %(default)s)")
    p.add_argument("--admission", type=_on_off, default=True, metavar="on|off",
                   help="on: new sessions wait for the AIMD window (MARS); off: pass-through "
                        "(sessions, events and metrics still work) (default: on)")
    p.add_argument("--events-file", default=None,
                   help="append the merged event stream to this JSONL file")
    p.add_argument("--engine-events", default=None, metavar="ENDPOINT[,ENDPOINT...]",
                   help="ZMQ endpoint of the engine's event publisher, one per upstream "
                        "('none' to disable; default: the one `mars-vllm serve --port "
                        "<upstream port>` binds, for each upstream)")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="the upstream is a `mars-vllm serve --data-parallel-size N` server: "
                        "place sessions on its N engines by vLLM's X-data-parallel-rank "
                        "header, each engine's events read from its own endpoint (set by "
                        "mars-vllm serve) (default: %(default)s)")
    p.add_argument("--placement", default="mars", choices=sorted(PLACERS),
                   help="with several upstreams, which engine a new session goes to: mars "
                        "(least prefill work and recompute, sessions stay), vllm_dp (vLLM's "
                        "DP balancer, per call), round_robin, session_hash, kv_overlap "
                        "(Dynamo's cost, per call) (default: %(default)s)")
    p.add_argument("--cpu-budget", default="node", choices=CPU_BUDGETS,
                   help="with several engines on one host: node (their control planes share "
                        "the host's tool cores, each reading the others' running tools) or "
                        "split (each counts an equal share of the cores) (default: "
                        "%(default)s)")
    g = p.add_argument_group("admission")
    g.add_argument("--max-queue", type=int, default=None,
                   help="sessions that may wait; beyond that 429 (default: 1024)")
    g.add_argument("--initial-window", type=float, default=None, help="AIMD start window (8)")
    g.add_argument("--min-window", type=int, default=None, help="AIMD floor (1)")
    g.add_argument("--max-window", type=int, default=None, help="AIMD ceiling (64)")
    g.add_argument("--tool-cores", type=float, default=None,
                   help="cores available to agent tools (default: os.cpu_count())")
    g.add_argument("--admission-config", default=None, metavar="JSON|@FILE",
                   help="AdmissionConfig overrides as JSON (keys max_queue, pending_ttl_s, "
                        "projected_fill, growth_forecast, host_tier, aimd, packing, pressure; "
                        "see docs/control_plane.md)")
    g.add_argument("--admission-timeout", type=float, default=d.admission_timeout_s,
                   help="a request waiting for admission gets 503 once nothing has progressed "
                        "(admission, session end, finished request, engine output, tool end) "
                        "for this many seconds: a stall bound, under load a queued session "
                        "waits (default: %(default)s)")
    g.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s,
                   help="end an admitted session after this many idle seconds (default: %(default)s)")
    g.add_argument("--step-interval", type=float, default=d.step_interval_s,
                   help="control-step timer period in seconds (default: %(default)s)")
    u = p.add_argument_group("upstream")
    u.add_argument("--upstream-client", choices=["fast", "httpx"], default=d.upstream_client,
                   help="HTTP client to the engine: fast (asyncio + httptools) or httpx "
                        "(default: %(default)s)")
    u.add_argument("--retry-after", type=int, default=d.retry_after_s,
                   help="Retry-After seconds on 429 / 503 (default: %(default)s)")
    u.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s,
                   help="upstream connect timeout in seconds (default: %(default)s)")
    u.add_argument("--read-timeout", type=float, default=None,
                   help="upstream read timeout in seconds (default: none)")
    u.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body accepted; larger gets 413 (default: %(default)s)")
    u.add_argument("--offload-parse-bytes", type=int, default=d.offload_parse_bytes,
                   help="request bodies of this many bytes and more are JSON-parsed in a "
                        "child process, off the event loop (default: %(default)s)")
    u.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="upstream connection pool size (default: %(default)s)")
    u.add_argument("--no-upstream-metrics", action="store_true",
                   help="do not append the engine's /metrics to ours")
    a = p.add_argument_group("access (see docs/sidecar.md, 'Trust model')")
    a.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but the health "
                        "probes (default: $VLLM_API_KEY, as vLLM; none = open)")
    a.add_argument("--events-api-key", nargs="+", default=None, metavar="KEY",
                   help="keys that may only post tool events to /v1/mars/events, for tool "
                        "runners (default: $MARS_EVENTS_API_KEY)")
    a.add_argument("--open-metrics", action="store_true",
                   help="serve /metrics without a key even when keys are set")
    x = p.add_argument_group("process")
    x.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process dies (used by mars-vllm serve)")
    x.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                   help="serve on this inherited listening socket instead of binding "
                        "--host/--port (used by mars-vllm serve, which binds the public port "
                        "before it loads the engine)")
    x.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="on SIGTERM, seconds in-flight requests may finish before they are "
                        "cut (new connections are refused at once) (default: %(default)s)")
    x.add_argument("--log-level", default=d.log_level,
                   choices=["critical", "error", "warning", "info", "debug"])
    x.add_argument("--access-log", action="store_true", help="log every request")


def admission_config_from_args(args: argparse.Namespace) -> AdmissionConfig:
    return admission_config(
        read_admission_overrides(args.admission_config) if args.admission_config else None,
        tool_cores=args.tool_cores, initial_window=args.initial_window,
        min_window=args.min_window, max_window=args.max_window, max_queue=args.max_queue)


def _env_keys(*names: str) -> tuple[str, ...]:
    for name in names:
        value = os.environ.get(name)
        if value:
            return tuple(k.strip() for k in value.splitlines() if k.strip())
    return ()


def _on_this_host(url: str) -> bool:
    """Whether ``url`` names this host by a name that needs no lookup (loopback, or this
    host's own name): only there can the default ipc endpoint be the engine's."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    host = (urlsplit(url).hostname or "").lower()
    if host in ("localhost", "0.0.0.0", "::", socket.gethostname().lower()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _upstreams(args: argparse.Namespace) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """The upstream URLs, the first engine's event endpoint, and every engine's when named
    one by one (SidecarConfig checks the counts and derives the data-parallel ranks')."""
    urls = tuple(u.strip() for u in args.upstream.split(","))
    if not all(urls):
        raise ValueError(f"--upstream {args.upstream!r} has an empty entry")
    events = args.engine_events
    if events is None:  # the endpoint each `mars-vllm serve --port P` binds
        each = () if args.data_parallel_size > 1 else tuple(map(engine_events_for, urls))
        return urls, engine_events_for(urls[0]), each
    if events.strip().lower() in ("none", "off", ""):
        return urls, "", ()
    eps = tuple("" if e.strip().lower() in ("none", "off") else e.strip()
                for e in events.split(","))
    return urls, eps[0], eps if len(eps) > 1 or len(urls) > 1 else ()


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    urls, first, events = _upstreams(args)
    config = SidecarConfig(
        upstream=urls[0], upstreams=urls, engines_events=events,
        placement=args.placement, cpu_budget=args.cpu_budget,
        data_parallel_size=args.data_parallel_size,
        host=args.host, port=args.port, admission=args.admission,
        admission_config=admission_config_from_args(args), engine_events=first,
        events_file=args.events_file, admission_timeout_s=args.admission_timeout,
        idle_timeout_s=args.idle_timeout, step_interval_s=args.step_interval,
        upstream_client=args.upstream_client,
        retry_after_s=args.retry_after, connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout, max_connections=args.max_connections,
        max_body_bytes=args.max_body_bytes, offload_parse_bytes=args.offload_parse_bytes,
        merge_upstream_metrics=not args.no_upstream_metrics, parent_pid=args.parent_pid, listen_fd=args.listen_fd,
        api_keys=tuple(args.api_key or _env_keys(KEYS_ENV, "VLLM_API_KEY")),
        events_api_keys=tuple(args.events_api_key or _env_keys(EVENTS_KEYS_ENV)),
        open_metrics=args.open_metrics,
        log_level=args.log_level, access_log=args.access_log,
        drain_timeout_s=args.drain_timeout)
    remote = [u for u in config.upstreams if not _on_this_host(u)]
    if remote and args.engine_events is None:
        print(f"mars sidecar: warning: {', '.join(remote)} is not on this host, and its "
              "engine events are read from an ipc socket here (the default): name each "
              "engine's endpoint with --engine-events tcp://HOST:PORT (its server's "
              "--mars-events-endpoint), or none; without events its control plane admits "
              "blind", file=sys.stderr, flush=True)
    return config


def _cmd(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, TypeError, OSError) as exc:
        print(f"mars sidecar: invalid configuration: {exc}", file=sys.stderr)
        return 2
    from mars.sidecar.server import serve

    return serve(config)


def register(sub) -> None:
    p = sub.add_parser("sidecar", help="the external control plane (admission proxy)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_cmd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mars sidecar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return _cmd(p.parse_args(argv))


if __name__ == "__main__":  # ``python -m mars.cli.sidecar``: what ``mars-vllm serve`` starts
    sys.exit(main())
