"""``mars dashboard --out FILE.json``: the Grafana dashboard of a mars deployment (the sidecar's
``mars_sidecar_*`` metrics and vLLM's own ``vllm:*``), to import into Grafana with a Prometheus
data source that scrapes the public port of ``mars-vllm serve`` (its ``/metrics`` carries
both). Panels and queries: :mod:`mars.dashboard.panels`; docs/sidecar.md, *Metrics*."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    try:
        from mars.dashboard.grafana import build
    except ImportError as e:
        print(f"mars dashboard: {e}; install the sidecar extra (pip install -e '.[sidecar]')",
              file=sys.stderr)
        return 1
    text = json.dumps(build(), indent=1) + "\n"
    if args.out in (None, "-"):
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        print(f"mars dashboard: cannot write {out}: {e}", file=sys.stderr)
        return 1
    print(f"mars dashboard: {out} (import it in Grafana: Dashboards > New > Import)",
          file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="write the Grafana dashboard (JSON) of a mars "
                                         "deployment", description=__doc__)
    p.add_argument("--out", metavar="FILE.json", help="where to write it (default: stdout)")
    p.set_defaults(func=run)
