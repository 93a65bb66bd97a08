"""The test tree itself: pytest imports test files by basename (tests/unit, tests/parallel and
tests/backends are not packages), so two files with one basename stop the whole run at
collection (the CI of b9b96f3 ended there: tests/unit/test_metrics.py next to
tests/parallel/test_metrics.py)."""

from __future__ import annotations

from collections import Counter

from tests.conftest import ROOT


def test_every_test_file_basename_is_unique_across_the_tree():
    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)
