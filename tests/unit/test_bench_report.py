"""bench/run.py and bench/report.py without running a benchmark: a section that raises is
reported in its place and fails the run; the report shows goals, ratios, spreads and verdicts."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import report  # noqa: E402
import run as bench_run  # noqa: E402

SECTION = {"title": "Demo", "goal": "fast", "columns": ["side", "samples/s"], "rows": [["a", "1,000"]],
           "checks": [{"goal": "a ÷ b >= 1.0", "measured": 0.97, "spread": [0.95, 0.99], "met": False}],
           "met": False, "notes": ["a note"], "raw": {}, "when": "2026-01-01 00:00:00", "seconds": 3.0}


def latest(sections: dict, quick: bool = False) -> dict:
    machine = {"date": "2026-01-01", "cpu": "CPU", "cores": 2, "usable_cores": 2, "memory_gib": 8, "kernel": "k",
               "os": "os", "python": "3", "mpi": "mpi", "versions": {"torch": "2"}, "git_commit": "abc",
               "load_average_at_start": [0.1, 0.2, 0.3], "horovod_env_of_caller": {}}
    return {"quick": quick, "repeats": 3, "machine": machine, "sections": sections, "seconds": 60}


def test_a_section_that_raises_is_reported_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "bench_broken_section.py").write_text(
        "def run(quick):\n    raise RuntimeError('peer exited 3: no such model')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    section = bench_run.run_section("bench_broken_section", quick=True)
    assert "peer exited 3: no such model" in section["error"]
    text = report.render(latest({"broken": section}))
    assert "**FAILED**" in text and "peer exited 3: no such model" in text


def test_a_section_missing_keys_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "bench_partial_section.py").write_text("def run(quick):\n    return {'title': 'x', 'rows': []}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "returned no" in bench_run.run_section("bench_partial_section", quick=True)["error"]


def test_report_shows_goal_ratio_spread_verdict_and_the_machine():
    text = report.render(latest({"demo": SECTION}))
    assert "| Demo | a ÷ b >= 1.0 | 0.97 | 0.95-0.99 | **missed** |" in text
    assert "| a | 1,000 |" in text and "- a note" in text and "| CPU | CPU, 2 cores (2 usable) |" in text
    assert "QUICK" not in text
    assert "QUICK smoke run" in report.render(latest({"demo": SECTION}, quick=True))


def test_only_rejects_an_unknown_section():
    with pytest.raises(SystemExit):
        bench_run.parse(["--only", "torch_dp,nope"])


def test_quick_results_never_go_to_the_committed_report(monkeypatch):
    monkeypatch.delenv("BENCH_QUICK", raising=False)
    args = bench_run.parse(["--quick"])
    assert args.out == ROOT / "bench/results/quick" and args.report == ROOT / "bench/results/quick/BENCHMARKS-quick.md"
    assert bench_run.parse([]).report == ROOT / "BENCHMARKS.md"


def test_a_partial_run_says_which_sections_it_ran_and_what_every_section_adds_up_to():
    """`--only` re-ran two sections and the header said "This invocation took 3.9 min" over a
    report whose other sections came from a 21-minute run: the budget could not be read off it."""
    sections = {"demo": SECTION, "other": {**SECTION, "seconds": 600.0}}
    full = report.render({**latest(sections), "ran": ["demo", "other"]})
    assert "This invocation took 1.0 min." in full
    partial = report.render({**latest(sections), "ran": ["demo"]})
    assert "This invocation re-ran demo (1.0 min); the other sections' results are kept from an earlier " \
           "invocation. Every section's own duration adds up to 10.1 min." in partial
