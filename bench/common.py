"""What every benchmark section shares: how processes are started, how results are read back,
the statistics, and the section record that bench/report.py renders.

A section is a dict: {"title", "goal" (str | None), "columns", "rows", "met" (bool | None),
"notes": [str], "raw": {...}} and optionally "checks": [{"goal", "measured", "spread", "met"}],
one per goal with its measured ratio. Sections never catch a failed run: a peer that exits
non-zero raises BenchError with its command, exit status and the tail of its output.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PEERS = BENCH / "peers"
CONFIGS = BENCH / "configs"
BIN = Path(sys.executable).parent
PY = sys.executable
MARK = "HVTRAIN_BENCH "  # peers print one line per rank: MARK + JSON


class BenchError(RuntimeError):
    """A benchmark run failed; the message carries the command and its output."""


def repeats(quick: bool) -> int:
    """Repetitions of each side (BENCH_REPEATS, default 2: the whole `make bench` in its 25 minutes;
    1 in quick mode)."""
    return 1 if quick else max(1, int(os.environ.get("BENCH_REPEATS", "2")))


def bench_env(**extra: str) -> dict[str, str]:
    """The caller's environment plus the venv on PATH and OpenMPI's root permission. HOROVOD_*
    variables the caller set are kept (they apply to every side alike; report.py lists them)."""
    env = dict(os.environ)
    env.update({"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"})
    for name in ("HVTRAIN_BACKEND", "HVTRAIN_OUTPUT_DIR"):  # the bench chooses these per run
        env.pop(name, None)
    env.update(extra)
    return env


def tool(name: str) -> str:
    """A launcher from the venv, else PATH."""
    local = BIN / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        raise BenchError(f"{name} not found next to {PY} or on PATH (run `make setup`)")
    return found


def free_ports(n: int) -> list[int]:
    """n distinct free localhost ports (held open together while chosen, so never the same twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _failure(argv: Sequence[str], code: int | str, out: str, err: str) -> BenchError:
    return BenchError(f"{' '.join(map(str, argv))}\n  exited {code}\n--- stdout (tail) ---\n{out[-3000:]}\n"
                      f"--- stderr (tail) ---\n{err[-5000:]}")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the bench process dies, however it dies (killed by a
    test's timeout too), so no launcher and its ranks go on loading the machine (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    # its own process group: a timeout ends the launcher's ranks too, not just the launcher
    return subprocess.Popen([str(a) for a in argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_die_with_parent)


def _kill_group(p: subprocess.Popen, grace: float = 5.0) -> None:
    """End whatever is left of the run's process group: SIGTERM (mpirun then ends its ranks,
    torchrun its workers), SIGKILL after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + grace
        while time.monotonic() < end:
            p.poll()  # reap the leader, or the group never empties
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def _finish(argv: Sequence[str], p: subprocess.Popen, deadline: float, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = p.communicate()
        raise _failure(argv, f"nothing: killed after the {timeout:.0f} s timeout", out, err) from None
    finally:
        _kill_group(p)  # nothing of a finished run may linger and load the next one
    if p.returncode != 0:
        raise _failure(argv, p.returncode, out, err)
    return subprocess.CompletedProcess([str(a) for a in argv], 0, out, err)


def run(argv: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run from the repository root; raise BenchError (with the output) on failure or timeout."""
    return _finish(argv, _start(argv, env or bench_env()), time.monotonic() + timeout, timeout)


def run_together(argvs: Sequence[Sequence[str]], timeout: float,
                 envs: Sequence[dict[str, str]] | None = None) -> list[subprocess.CompletedProcess]:
    """Start every command at once (each with its env), wait for all: the two-independent-ranks
    ceiling, or workers that find each other themselves (MultiWorkerMirroredStrategy)."""
    envs = envs or [bench_env()] * len(argvs)
    procs = [_start(argv, env) for argv, env in zip(argvs, envs, strict=True)]
    deadline = time.monotonic() + timeout
    try:
        # the first to fail is reported (its own output), not a survivor left waiting for it
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            failed = [(argv, p) for argv, p in zip(argvs, procs, strict=True) if p.poll() not in (None, 0)]
            if failed:
                return [_finish(*failed[0], deadline, timeout)]  # raises BenchError with its output
            time.sleep(0.2)
        return [_finish(argv, p, deadline, timeout) for argv, p in zip(argvs, procs, strict=True)]
    finally:
        for p in procs:
            _kill_group(p)
            p.wait()


def peer_records(proc: subprocess.CompletedProcess, ranks: int | Sequence[int]) -> list[dict]:
    """The MARK lines of every rank (launchers may prefix lines with tags), ordered by rank;
    `ranks`: how many (0..ranks-1), or exactly which ranks this process printed for."""
    expected = list(range(ranks)) if isinstance(ranks, int) else sorted(ranks)
    records = []
    for line in proc.stdout.splitlines():
        if MARK in line:
            try:
                records.append(json.loads(line[line.index(MARK) + len(MARK):]))
            except json.JSONDecodeError as exc:
                raise _failure(proc.args, f"0 but printed an unreadable result line ({exc}): {line!r}",
                               proc.stdout, proc.stderr) from None
    if sorted(r["rank"] for r in records) != expected:
        raise _failure(proc.args, f"0 but printed results for ranks {sorted(r['rank'] for r in records)}, "
                       f"expected {expected}", proc.stdout, proc.stderr)
    return sorted(records, key=lambda r: r["rank"])


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB), as hvtrain's summary does."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def emit(rank: int, **values: Any) -> None:
    """A peer's result line (one per rank), in one write: ranks share the launcher's stdout."""
    sys.stdout.flush()
    os.write(1, (MARK + json.dumps({"rank": rank, **values, "peak_rss_mb": peak_rss_mb()}) + "\n").encode())


# -- hvtrain as users run it ----------------------------------------------------------------
def hvtrain_argv(np: int, config: Path | str, out: Path, sets: Sequence[str] = (), backend: str = "torch") -> list[str]:
    """np=1: `hvtrain train` alone; np>1: `hvtrain launch -np N --hostfile hostfiles/localhost -- train`
    (hvtrain launch's default launcher, horovodrun, with hvtrain's own Horovod knobs)."""
    train = ["train", str(config), "--backend", backend, "--quiet", "--output-dir", str(out)]
    for s in sets:
        train += ["--set", s]
    if np == 1:
        return [PY, "-m", "hvtrain", *train]
    return [PY, "-m", "hvtrain", "launch", "-np", str(np), "--hostfile", "hostfiles/localhost", "--", *train]


def hvtrain_result(out: Path) -> dict:
    """samples/s of every epoch (metrics.jsonl) and peak RSS per rank (summary.json)."""
    rates = [json.loads(line)["samples_per_sec"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"epoch_rates": rates, "peak_rss_mb": summary["peak_rss_mb"]["ranks"]}


def steady(rates: Sequence[float]) -> float:
    """Median over the epochs after the first (warm-up: allocation, first negotiations, tracing)."""
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


# -- statistics ---------------------------------------------------------------------------------
@dataclass
class Side:
    """One side of a comparison: `measure(rep)` returns {"rate": samples/s, "peak_rss_mb": [per rank]}."""

    name: str
    measure: Callable[[int], dict]


def interleave(sides: Sequence[Side], reps: int, log: Callable[[str], None] | None = None) -> dict[str, list[dict]]:
    """A, B, C, A, B, C, ...: drift on the machine hits every side alike."""
    out: dict[str, list[dict]] = {s.name: [] for s in sides}
    for rep in range(reps):
        for s in sides:
            load = round(os.getloadavg()[0], 2)
            t0 = time.perf_counter()
            r = s.measure(rep)
            r["wall_s"], r["load_1min_before"] = round(time.perf_counter() - t0, 1), load
            out[s.name].append(r)
            if log:
                log(f"{s.name} rep {rep + 1}/{reps}: {r['rate']:,.0f} samples/s ({r['wall_s']} s, load {load})")
    return out


def load_note(runs: dict[str, list[dict]] | Sequence[dict]) -> str:
    """How busy the machine was: the 1-minute load average before each run."""
    flat = [r for rs in runs.values() for r in rs] if isinstance(runs, dict) else list(runs)
    loads = [r["load_1min_before"] for r in flat if "load_1min_before" in r]
    if not loads:
        return "load average not recorded"
    cores = len(os.sched_getaffinity(0))
    return (f"1-minute load average before each run: {min(loads):.2f}-{max(loads):.2f} on {cores} cores (the runs "
            "themselves add up to their rank count; more means other work shared the machine and every ratio is "
            "noisier).")


def ceiling_warnings(runs: dict[str, list[dict]], ceiling: str = "ceiling") -> list[str]:
    """A side far above the two-independent-ranks ceiling means the machine changed between runs."""
    if ceiling not in runs:
        return []
    top = med([r["rate"] for r in runs[ceiling]])
    return [f"WARNING: {name} ran at {med([r['rate'] for r in rs]) / top:.2f}x the ceiling, which no side can beat: "
            "the machine's load changed between the runs; repeat on a quiet machine (or raise BENCH_REPEATS)."
            for name, rs in runs.items() if name != ceiling and med([r["rate"] for r in rs]) > 1.1 * top]


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float], digits: int = 0) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:,.{digits}f}-{hi:,.{digits}f}"


def rss_text(runs: Sequence[dict]) -> str:
    """Median peak RSS of each rank over the repetitions, 'r0 / r1' in MiB."""
    ranks = len(runs[0]["peak_rss_mb"])
    return " / ".join(f"{med([r['peak_rss_mb'][i] for r in runs]):.0f}" for i in range(ranks))


def paired(a: Sequence[dict], b: Sequence[dict], fn: Callable[[float, float], float]) -> list[float]:
    """fn(a_rate, b_rate) per repetition (the sides ran next to each other)."""
    return [fn(x["rate"], y["rate"]) for x, y in zip(a, b, strict=True)]


def check(goal: str, ratios: Sequence[float], ok: Callable[[float], bool], quick: bool) -> dict:
    """One goal: the median of the paired ratios, their spread, met (None in quick mode)."""
    m = med(ratios)
    return {"goal": goal, "measured": round(m, 3), "spread": [round(min(ratios), 3), round(max(ratios), 3)],
            "met": None if quick else bool(ok(m))}


def all_met(checks: Sequence[dict]) -> bool | None:
    flags = [c["met"] for c in checks]
    if any(f is None for f in flags):
        return None
    return all(flags)


def logger(section: str) -> Callable[[str], None]:
    def log(message: str) -> None:
        print(f"  [{section}] {message}", file=sys.stderr, flush=True)

    return log


# -- the usual sides ----------------------------------------------------------------------------
TIMEOUT = 900.0  # seconds a single run may take before it counts as hung


def hvtrain_side(name: str, np: int, config: Path | str, tmp: Path, sets: Sequence[str] = (),
                 backend: str = "torch", env: dict[str, str] | None = None) -> Side:
    """hvtrain on `np` ranks; `env`: variables added to the bench environment (a lever)."""
    def measure(rep: int) -> dict:
        out = tmp / f"{name}-np{np}-{rep}".replace(" ", "_").replace("'", "")
        run(hvtrain_argv(np, config, out, sets, backend), TIMEOUT, bench_env(**env) if env else None)
        r = hvtrain_result(out)
        return {"rate": steady(r["epoch_rates"]), **r}

    return Side(name, measure)


def ceiling_side(config: Path | str, tmp: Path, sets: Sequence[str] = (), backend: str = "torch",
                 np: int = 2) -> Side:
    """`np` independent one-rank hvtrain runs of the per-rank workload started together; their
    samples/s summed: what np ranks can do on this machine with no communication at all."""
    def measure(rep: int) -> dict:
        outs = [tmp / f"ceiling-{backend}-{Path(config).stem}-{rep}-{i}" for i in range(np)]
        run_together([hvtrain_argv(1, config, o, sets, backend) for o in outs], TIMEOUT)
        results = [hvtrain_result(o) for o in outs]
        return {"rate": sum(steady(r["epoch_rates"]) for r in results),
                "epoch_rates": [r["epoch_rates"] for r in results],
                "peak_rss_mb": [r["peak_rss_mb"][0] for r in results]}

    return Side("ceiling", measure)


def peer_side(name: str, argv: Sequence[str], ranks: int, env: dict[str, str] | None = None) -> Side:
    """A peer script under its launcher; rank 0's epoch rates, every rank's peak RSS."""
    def measure(rep: int) -> dict:
        records = peer_records(run(argv, TIMEOUT, env), ranks)
        return {"rate": steady(records[0]["samples_per_sec"]), "epoch_rates": records[0]["samples_per_sec"],
                "peak_rss_mb": [r["peak_rss_mb"] for r in records]}

    return Side(name, measure)


def side_rows(prefix: Sequence[Any], runs: dict[str, list[dict]], global_batch: int | dict[str, int],
              ceiling: str | None = None, reference: str = "hvtrain") -> list[list[Any]]:
    """One table row per side: median samples/s, spread, ms/step (`global_batch`: samples a step,
    or per side), hvtrain ÷ side, side ÷ ceiling, peak RSS per rank."""
    rows = []
    for name, rs in runs.items():
        batch = global_batch[name] if isinstance(global_batch, dict) else global_batch
        rates = [r["rate"] for r in rs]
        vs_ref = "" if name == reference else f"{med(paired(runs[reference], rs, lambda a, b: a / b)):.2f}"
        vs_ceiling = f"{med(paired(rs, runs[ceiling], lambda a, b: a / b)):.2f}" \
            if ceiling and ceiling in runs and name != ceiling else ""
        rows.append([*prefix, name, f"{med(rates):,.0f}", spread(rates), f"{batch / med(rates) * 1000:.1f}",
                     vs_ref, vs_ceiling, rss_text(rs)])
    return rows


SIDE_COLUMNS = ["side", "samples/s", "spread (min-max)", "ms/step", "hvtrain ÷ side (throughput)",
                "÷ ceiling", "peak RSS MiB per rank"]
