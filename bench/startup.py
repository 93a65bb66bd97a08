"""Start-up of the login-node commands (`hvtrain hosts check`, `hvtrain launch --dry-run`): they
import no framework, so they start in well under a second, next to a bare `python -c pass`."""

from __future__ import annotations

import time

from common import PY, all_met, check, med, repeats
from common import run as run_command

CASES = {"hosts check": ["hosts", "check", "hostfiles/example-cluster"],
         "launch --dry-run": ["launch", "-np", "2", "--dry-run", "--", "train", "examples/digits_mlp.yaml"]}


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    run_command(argv, 120)
    return time.perf_counter() - t0


def run(quick: bool) -> dict:
    n = 2 if quick else 5 * repeats(quick)
    cases = {"python -c pass": [PY, "-c", "pass"], **{k: [PY, "-m", "hvtrain", *v] for k, v in CASES.items()}}
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(n):  # interleaved
        for name, argv in cases.items():
            seconds[name].append(timed(argv))
    rows = [[name, f"{med(s):.3f}", f"{min(s):.3f}-{max(s):.3f}"] for name, s in seconds.items()]
    checks = [check(f"`hvtrain {name}` seconds < 1", seconds[name], lambda v: v < 1.0, quick) for name in CASES]
    return {
        "title": "Start-up of the login-node commands",
        "goal": "hosts check and launch --dry-run start in under 1 s (no framework imported)",
        "columns": ["command", "seconds (median)", "spread"], "rows": rows, "checks": checks,
        "met": all_met(checks),
        "notes": [f"{n} runs of each, interleaved; wall time of the whole process."],
        "raw": {"seconds": seconds},
    }
