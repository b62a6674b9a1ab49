"""How well operator tables predict timings: at their own points, on points left out, and
against another run of the same grid (the noise floor).

``python -m mars.emulate.table_check [../shared/gpu-timings]`` prints the tables that
docs/emulation.md shows; ``tests/test_measured_step.py`` holds the shipped tables to the
issue's bounds. Every prediction goes through the same per-layer functions the step-time
model uses (:class:`~mars.emulate.op_tables.OperatorTables`), never around them.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mars.emulate.op_tables import OPS, OperatorTables, Timing, read_timings
from mars.emulate.specs import get_gpu, get_model


def predict(tables: OperatorTables, t: Timing) -> float:
    """The tables' time for the point ``t`` measured (one layer, one operator)."""
    if t.op == "projections":
        return tables.projections(t.tokens)
    if t.op == "moe":
        return tables.experts(t.tokens)
    if t.op == "logits":
        return tables.logits(t.requests)
    return tables.attention([(t.new, t.context)] * t.requests)


@dataclass(frozen=True)
class OpError:
    op: str
    points: int
    mean: float
    worst: float
    #: the point with the worst error, as the harness named it
    worst_at: str


def errors(tables: OperatorTables, timings: Iterable[Timing]) -> dict[str, OpError]:
    """Mean and worst |predicted / measured - 1| per operator class."""
    by: dict[str, list[tuple[float, Timing]]] = {}
    for t in timings:
        by.setdefault(t.op, []).append((abs(predict(tables, t) / t.seconds - 1), t))
    out = {}
    for op in OPS:
        if op not in by:
            continue
        errs = by[op]
        e, w = max(errs, key=lambda x: x[0])
        out[op] = OpError(op, len(errs), statistics.fmean(x for x, _ in errs), e,
                          f"T={w.tokens} R={w.requests} new={w.new} ctx={w.context}")
    return out


def split_alternate(timings: Sequence[Timing]) -> tuple[list[Timing], list[Timing]]:
    """Every other point of each axis kept, the rest left out -- ``(kept, left_out)``.

    One-size operators: every other size, both ends kept. Attention: a checkerboard over each
    table's two axes (decodes: batch x context; chunks: chunk x context), its outer rows and
    columns kept, so every point left out lies inside what is kept (interpolation, not
    extrapolation)."""
    kept: list[Timing] = []
    out: list[Timing] = []
    for op in ("projections", "moe", "logits"):
        pts = sorted((t for t in timings if t.op == op),
                     key=lambda t: t.tokens if op != "logits" else t.requests)
        for i, t in enumerate(pts):
            (out if 0 < i < len(pts) - 1 and i % 2 else kept).append(t)
    att = [t for t in timings if t.op == "attention"]
    dec = [t for t in att if t.new == 1]
    chunks = [t for t in att if t.new > 1]
    for group, a_of, b_of in ((dec, lambda t: t.requests, lambda t: t.context),
                              (chunks, lambda t: t.new, lambda t: t.context)):
        a_vals = sorted({a_of(t) for t in group})
        b_vals = sorted({b_of(t) for t in group})
        for t in group:
            i, j = a_vals.index(a_of(t)), b_vals.index(b_of(t))
            edge = i in (0, len(a_vals) - 1) or j in (0, len(b_vals) - 1)
            # the decode table's B = 1 row is also the chunk table's n = 1 row: keep it
            (out if (i + j) % 2 and not edge else kept).append(t)
    return kept, out


def layer_sums(tables: OperatorTables, layers: Iterable[Timing]) -> list[dict]:
    """Each whole-layer timing against the sum of the operators the tables price for the
    same batch (projections, experts, attention; the norms, rotary, routing and permutation
    are in the layer only): what the per-token overhead stands in for."""
    out = []
    for t in layers:
        batch = [(t.new, t.context)] * t.requests
        tokens = t.new * t.requests
        ops = tables.projections(tokens) + tables.attention(batch) + (
            tables.experts(tokens) if tables.model.num_experts else 0.0)
        out.append({"requests": t.requests, "new": t.new, "context": t.context,
                    "layer_s": t.seconds, "operators_s": ops,
                    "unpriced_per_token_s": (t.seconds - ops) / tokens})
    return out


def load(path: str | Path) -> tuple[dict, list[Timing]]:
    doc = json.loads(Path(path).read_text())
    return doc, read_timings(doc)


#: timing folder -> the packaged GPU its tables are checked against
FOLDER_GPU = {"h100-sxm": "h100", "h200": "h200"}


def report(src: str | Path) -> str:
    """The three checks per GPU x model of the timing folder ``src`` (the layout of
    ``shared/gpu-timings``), as markdown."""
    from mars.emulate.measured import shipped_tables

    root = Path(src)
    rows = ["| GPU | model | operator | points | at own points: mean / worst | held out "
            "(every other point): mean / worst | repeat run: mean / worst | noise floor "
            "(run vs repeat): mean |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for folder, gpu in FOLDER_GPU.items():
        for model in ("qwen3-coder-30b-a3b", "gpt-oss-120b"):
            tables = shipped_tables(gpu, model)
            if tables is None:
                continue
            _, dense = load(root / folder / f"dense-{model}.json")
            own = errors(tables, dense)
            kept, left = split_alternate(dense)
            half = errors(OperatorTables(get_model(model), get_gpu(gpu), kept), left)
            rep_path = root / folder / f"dense-repeat-seed1-{model}.json"
            rep = errors(tables, load(rep_path)[1]) if rep_path.exists() else {}
            noise = {}
            if rep_path.exists():
                by_key = {(t.op, t.tokens, t.requests, t.new, t.context): t.seconds
                          for t in load(rep_path)[1]}
                for op in OPS:
                    d = [abs(by_key[k] / t.seconds - 1) for t in dense if t.op == op
                         and (k := (t.op, t.tokens, t.requests, t.new, t.context)) in by_key]
                    if d:
                        noise[op] = statistics.fmean(d)
            for op, e in own.items():
                h = half.get(op)
                r = rep.get(op)
                rows.append(
                    f"| {gpu} | {model} | {op} | {e.points} | {e.mean:.1%} / {e.worst:.1%} | "
                    + (f"{h.mean:.1%} / {h.worst:.1%} ({h.points} pts)" if h else "–") + " | "
                    + (f"{r.mean:.1%} / {r.worst:.1%}" if r else "–") + " | "
                    + (f"{noise[op]:.1%}" if op in noise else "–") + " |")
    return "\n".join(rows)


def run_report(src: str | Path) -> str:
    """A later timing run (the layout of ``tests/data/gpu-timings/2026-11-28``: one folder per
    card, ``dense*-<model>.json`` files) against the shipped tables: the error per operator
    class, then each whole-layer timing against the sum of the operators the tables price."""
    from mars.emulate.measured import shipped_tables

    root = Path(src)
    errs = ["| GPU | run | model | operator | points | mean / worst | worst at |",
            "|---|---|---|---|---:|---:|---|"]
    lay = ["| GPU | run | model | layer (requests x new, context) | layer | operators "
           "(tables) | layer / operators | left per token and layer |",
           "|---|---|---|---|---:|---:|---:|---:|"]
    for folder, gpu in FOLDER_GPU.items():
        for path in sorted((root / folder).glob("dense*.json")):
            doc, timings = load(path)
            model = doc["model"]
            tables = shipped_tables(gpu, model)
            if tables is None:
                continue
            run = path.name[: -len(f"-{model}.json")]
            for op, e in errors(tables, timings).items():
                errs.append(f"| {gpu} | {run} | {model} | {op} | {e.points} | "
                            f"{e.mean:.1%} / {e.worst:.1%} | {e.worst_at} |")
            for r in layer_sums(tables, [t for t in timings if t.op == "layer"]):
                lay.append(f"| {gpu} | {run} | {model} | {r['requests']} x {r['new']}, "
                           f"{r['context']} | {r['layer_s'] * 1e3:.3f} ms | "
                           f"{r['operators_s'] * 1e3:.3f} ms | "
                           f"{r['layer_s'] / r['operators_s']:.2f} | "
                           f"{r['unpriced_per_token_s'] * 1e9:,.0f} ns |")
    return "\n".join(errs) + "\n\n" + "\n".join(lay)


def main(argv: Sequence[str]) -> int:
    """``table_check [FOLDER]``: the three checks of the shipped tables on the timings they
    were packed from; ``table_check --run FOLDER``: a later run against them."""
    if argv[:1] == ["--run"]:
        if len(argv) != 2:
            print("usage: python -m mars.emulate.table_check --run FOLDER", file=sys.stderr)
            return 2
        print(run_report(argv[1]))
        return 0
    print(report(argv[0] if argv else "../shared/gpu-timings"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
