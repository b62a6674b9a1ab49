"""Re-render a ``mars bench`` directory: print its tables and redraw its plots.

    .venv/bin/python experiments/plot_bench.py runs/bench-ILR-1-.../ [--plots DIR]

Reads only ``bench.json`` (no server, no replay), so it works on a finished, interrupted or
copied bench, and after a change to the report code (``mars/bench/report.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mars.bench.report import format_tables, write_plots


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", help="a bench directory or its bench.json")
    ap.add_argument("--plots", help="directory for the plots (default: BENCH/plots)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    p = Path(args.bench)
    if p.is_dir():
        p = p / "bench.json"
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        print(f"plot_bench: {p}: {e}", file=sys.stderr)
        return 1
    if doc.get("schema") != "mars-bench":
        print(f"plot_bench: {p}: not a mars bench file", file=sys.stderr)
        return 1
    print(format_tables(doc))
    if not args.no_plots:
        for path in write_plots(doc, args.plots or p.parent / "plots").values():
            print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
