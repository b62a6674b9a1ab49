"""Argument types shared by the command-line tools (``mars workloads``, ``mars replay``,
``mars bench``): each parses one value or raises ``argparse.ArgumentTypeError`` with a message
that names what was expected, so argparse prints a clear usage error."""

from __future__ import annotations

import argparse


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number (got {s!r})") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite (got {s})")
    return v


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (got {s!r})") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {s})")
    return v


def slacks(s: str) -> tuple[float, ...]:
    """Goodput slack factors: ``2,3,5``."""
    try:
        vals = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"slacks must be numbers like 2,3,5 (got {s!r})") from None
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"slacks must be > 0 (got {s!r})")
    return vals


def cores(s: str) -> list[int]:
    """A CPU core list: ``0``, ``0,2``, ``1-3``."""
    from mars.workloads.toolpool import parse_cores

    try:
        return parse_cores(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seeds(s: str) -> list[int]:
    """Seeds: ``0,1,2`` or a range ``0-4``; distinct, in the order given."""
    out: list[int] = []
    try:
        for part in (x.strip() for x in s.split(",")):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            if sep and lo:
                if int(hi) < int(lo):
                    raise argparse.ArgumentTypeError(f"seed range {part!r} runs backwards")
                out += list(range(int(lo), int(hi) + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be integers like 0,1,2 or 0-4 "
                                         f"(got {s!r})") from None
    if not out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"seeds must be distinct and at least one (got {s!r})")
    return out


# ------------------------------------------------------------------ options shared by commands
# Declared once so that a flag several commands take means the same and reads the same in
# each command's --help.


def add_slacks(p: argparse.ArgumentParser, what: str = "goodput slack factors") -> None:
    from mars.workloads.goodput import DEFAULT_SLACKS

    p.add_argument("--slacks", type=slacks, default=DEFAULT_SLACKS, metavar="LIST",
                   help=f"{what} (default {','.join(f'{s:g}' for s in DEFAULT_SLACKS)})")


def add_ideal_cache(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ideal-cache", metavar="DIR",
                   help="ideal cache directory (default $MARS_CACHE_DIR/ideal or "
                        "~/.cache/mars/ideal)")


def add_tool_workers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tool-workers", type=positive_int, metavar="N",
                   help="concurrent CPU-bound tools (default: one per tool core)")


def add_request_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-timeout", type=positive_float, default=3600.0, metavar="S",
                   help="per-call timeout in seconds (default 3600)")


def add_engines(p: argparse.ArgumentParser) -> None:
    """``--engines`` / ``--placement``: several engines of the model behind one sidecar."""
    from mars.policy.control.placement import PLACERS
    from mars.policy.control.pressure import CPU_BUDGETS

    p.add_argument("--engines", type=positive_int, default=1, metavar="N",
                   help="engines of the model (vLLM data parallelism), each its own emulated "
                        "GPU and control plane, the host's tool cores shared (default 1)")
    p.add_argument("--placement", choices=sorted(PLACERS), default="mars",
                   help="how the sidecar places sessions on the engines (with --engines > 1; "
                        "default mars; docs/control_plane.md)")
    p.add_argument("--cpu-budget", choices=CPU_BUDGETS, default="node",
                   help="with --engines > 1: the engines' control planes share the host's "
                        "tool cores (node) or each counts an equal share (split) (default "
                        "node; docs/control_plane.md)")
