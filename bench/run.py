"""`make bench`: every comparison side by side in one invocation, then BENCHMARKS.md.

Each section is a module of bench/ with `run(quick: bool) -> dict` (the record described in
bench/common.py); the sides of a comparison alternate (A, B, C, A, B, C, ...) for BENCH_REPEATS
repetitions (default 2) and are reported as median, spread (min-max) and ratios.

    python bench/run.py [--quick] [--only SECTION[,SECTION]] [--out DIR] [--report FILE]

Full mode writes bench/results/<section>.json, bench/results/latest.json and BENCHMARKS.md at the
repository root. --quick (or BENCH_QUICK=1) is the smoke version CI runs: tiny steps and sizes,
one repetition, no goal judged, written to bench/results/quick/ (ignored by git) with its own
BENCHMARKS-quick.md, so it never replaces the committed numbers. --only re-runs some sections and
keeps the others' last results in latest.json and the report.

A section that fails does not stop the others; the run ends with exit status 1 naming every
failed section, and the report shows the failure in the section's place.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
from common import ROOT, repeats  # noqa: E402

SECTIONS = ("startup", "torch_dp", "tf_dp", "small_models", "allreduce", "weak_scaling", "levers", "plan_check",
            "pipeline", "transformer", "data_scale", "image_decode", "file_scale", "zero")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
                   help="smoke run: tiny sizes, one repetition, nothing judged (default: BENCH_QUICK=1)")
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=list(SECTIONS),
                   help=f"comma-separated sections, of: {','.join(SECTIONS)}")
    p.add_argument("--out", type=Path, help="results directory (default bench/results, quick: bench/results/quick)")
    p.add_argument("--report", type=Path,
                   help="markdown report (default BENCHMARKS.md, quick: OUT/BENCHMARKS-quick.md)")
    args = p.parse_args(argv)
    unknown = [s for s in args.only if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; expected some of {', '.join(SECTIONS)}")
    args.out = args.out or ROOT / ("bench/results/quick" if args.quick else "bench/results")
    args.report = args.report or (args.out / "BENCHMARKS-quick.md" if args.quick else ROOT / "BENCHMARKS.md")
    return args


def run_section(name: str, quick: bool) -> dict:
    t0 = time.perf_counter()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        section = importlib.import_module(name).run(quick)
    except Exception:  # noqa: BLE001 - reported in the section's place, and the run fails at the end
        return {"title": name, "error": traceback.format_exc(limit=4), "when": started,
                "seconds": round(time.perf_counter() - t0, 1)}
    missing = {"title", "goal", "columns", "rows", "met", "notes", "raw"} - set(section)
    if missing:
        return {"title": name, "error": f"bench/{name}.py run() returned no {sorted(missing)}", "when": started}
    return {"repeats": repeats(quick), **section, "when": started, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # SIGTERM ends the run like Ctrl-C: the running benchmark's process group is killed on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.out.mkdir(parents=True, exist_ok=True)
    latest_path = args.out / "latest.json"
    previous = json.loads(latest_path.read_text()) if latest_path.is_file() else {}
    keep = {k: v for k, v in previous.get("sections", {}).items() if k in SECTIONS and k not in args.only}
    latest = {"quick": args.quick, "repeats": repeats(args.quick), "machine": report.machine(),
              "ran": [s for s in SECTIONS if s in args.only], "sections": keep}
    t0 = time.perf_counter()
    for name in [s for s in SECTIONS if s in args.only]:
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        section = run_section(name, args.quick)
        latest["sections"][name] = section
        (args.out / f"{name}.json").write_text(json.dumps(section, indent=2) + "\n")
        status = "FAILED" if "error" in section else f"met={section['met']}"
        print(f"bench: {name} done in {section.get('seconds', 0):.0f} s, {status}", file=sys.stderr, flush=True)
    latest["seconds"] = round(time.perf_counter() - t0, 1)
    latest["sections"] = {k: latest["sections"][k] for k in SECTIONS if k in latest["sections"]}
    latest_path.write_text(json.dumps(latest, indent=2) + "\n")
    args.report.write_text(report.render(latest))
    print(report.summary(latest))
    print(f"bench: {latest['seconds']:.0f} s; results in {args.out}, report {args.report}", file=sys.stderr)
    failed = {k: v["error"] for k, v in latest["sections"].items() if "error" in v and k in args.only}
    for name, error in failed.items():
        print(f"\nbench: section {name} FAILED:\n{error}", file=sys.stderr)
    if failed:
        print(f"bench: {len(failed)} section(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
