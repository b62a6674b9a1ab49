"""Pack GPU operator timings into the shipped step-time tables (mars/emulate/gpu_tables/).

    .venv/bin/python scripts/pack_gpu_tables.py ../shared/gpu-timings

Reads ``<src>/<folder>/dense-<model>.json`` (the harness's ``mars-op-timings/1`` output on the
dense grid) and ``<src>/<folder>/nvidia-smi.csv`` for each measured GPU, and writes
``mars/emulate/gpu_tables/<gpu>/<model>.json``: the timed points and their provenance
(device, driver, torch, CUDA, date, the harness's commit, the source file). Nothing is fitted
here; the step-time model interpolates the points when it loads them.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

#: packaged GPU name -> folder of the timing run
FOLDERS = {"h100": "h100-sxm", "h200": "h200"}
MODELS = ("qwen3-coder-30b-a3b", "gpt-oss-120b")
#: the harness code the timings were taken with (../shared/gpu-timings/README.md)
HARNESS_COMMIT = "df6af23"
OUT = Path(__file__).resolve().parent.parent / "mars" / "emulate" / "gpu_tables"
KEEP = ("op", "seconds", "tokens", "requests", "new", "context")


def smi(folder: Path) -> dict[str, str]:
    with open(folder / "nvidia-smi.csv") as f:
        rows = list(csv.reader(f, skipinitialspace=True))
    return dict(zip(rows[0], rows[1]))


def main(src: str) -> int:
    root = Path(src)
    for gpu, folder in FOLDERS.items():
        card = smi(root / folder)
        for model in MODELS:
            path = root / folder / f"dense-{model}.json"
            d = json.loads(path.read_text())
            assert d["format"] == "mars-op-timings/1" and d["model"] == model and d["complete"]
            dev = d["device"]
            doc = {
                "format": "mars-gpu-tables/1", "gpu": gpu, "model": model,
                "provenance": {
                    "device": dev["name"], "multiprocessors": dev["multiprocessors"],
                    "memory_bytes": dev["memory_bytes"],
                    "max_sm_clock_mhz": int(card["clocks.max.sm [MHz]"].split()[0]),
                    "driver": card["driver_version"], "torch": dev["torch"],
                    "cuda": dev["cuda"], "when": dev["when"], "dtype": d["dtype"],
                    "moe_impl": d["moe_impl"], "graphs": all(r["graph"] for r in d["records"]),
                    "harness": f"mars.emulate.op_timing at {HARNESS_COMMIT}",
                    "source": f"shared/gpu-timings/{folder}/{path.name}",
                    "peaks": d["peaks"]},
                "records": [{k: r[k] for k in KEEP} for r in d["records"]],
            }
            out = OUT / gpu / f"{model}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=0) + "\n")
            print(f"{out.relative_to(OUT.parent.parent.parent)}: {len(doc['records'])} points")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "../shared/gpu-timings"))
