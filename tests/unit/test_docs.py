"""The guide (docs/, MkDocs) builds in strict mode, and no page or README link points at a
missing page or anchor."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = [sys.executable, "-m", "mkdocs"]


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MKDOCS, "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)


def test_the_guide_builds_strict(tmp_path):
    proc = build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").exists()


def test_a_link_to_a_missing_anchor_fails_the_build(tmp_path):
    """The strict build is what catches a broken link: shown on a copy with one anchor broken."""
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "index.md"
    page.write_text(page.read_text() + "\n[broken](configs.md#no-such-heading)\n")
    proc = build(copy, tmp_path / "site")
    assert proc.returncode != 0 and "no-such-heading" in proc.stderr, proc.stderr[-2000:]


def slug(heading: str) -> str:
    """Python-Markdown's toc slug (MkDocs' default): lowercase, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def anchors(page: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+?)\s*$", body, flags=re.M)}


def test_readme_links_into_the_guide_resolve():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert links, "the README points into the guide"
    for target, anchor in links:
        page = ROOT / target
        assert page.exists(), target
        if anchor:
            assert anchor in anchors(page), f"README links to {target}#{anchor}, which has no such heading"


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
