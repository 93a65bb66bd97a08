"""`make bench` cannot rot: its quick version (BENCH_QUICK=1) runs every section's every side
for real (hvtrain, hand-written Horovod, DDP, MWMS, raw MPI, the ceilings, pipelines, data
scale; the pipeline's np=4 hybrid for one backend) and must produce rows of positive
measurements. Nothing about speed is asserted."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_env

sys.path.insert(0, str(ROOT / "bench"))
from run import SECTIONS  # noqa: E402

# columns holding measurements (not ratios or spreads), by a word in their header
MEASURED = ("samples/s", "images/s", "GB/s", "seconds", "RSS", " ms")


def numbers(cell: object) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"-?[\d,]*\.?\d+", str(cell))]


@pytest.mark.timeout(2400)
def test_quick_bench_runs_every_section_and_measures_something(tmp_path):
    env = run_env()
    env["BENCH_QUICK"] = "1"
    proc = subprocess.Popen([sys.executable, "bench/run.py", "--out", str(tmp_path), "--report", str(tmp_path / "B.md")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=2300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # bench/run.py then ends the running launcher and its ranks
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the quick bench did not finish in 2300 s\n{err[-4000:]}")
    assert proc.returncode == 0, f"bench/run.py exited {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["quick"] is True
    assert list(latest["sections"]) == list(SECTIONS), err[-3000:]
    for name, section in latest["sections"].items():
        assert "error" not in section, f"{name}:\n{section['error']}"
        assert (tmp_path / f"{name}.json").is_file()
        assert section["rows"], name
        assert section["met"] is None and all(c["met"] is None for c in section.get("checks", [])), name
        columns = [i for i, c in enumerate(section["columns"])
                   if any(k in c for k in MEASURED) and "spread" not in c and "÷" not in c]
        for row in section["rows"]:
            assert len(row) == len(section["columns"]), (name, row)
            cells = [row[i] for i in columns] if columns else row
            values = [v for cell in cells for v in numbers(cell)]
            assert values and all(v > 0 for v in values), (name, section["columns"], row)
    report = (tmp_path / "B.md").read_text()
    assert "QUICK smoke run" in report
    for section in latest["sections"].values():
        assert f"## {section['title']}" in report
