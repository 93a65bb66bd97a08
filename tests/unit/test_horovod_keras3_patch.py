"""scripts/horovod_keras3.py (issue 25): the patch hvtrain expects is the one make setup applies, it is
applied to this venv's Horovod, re-running it changes nothing, and an edit that does not apply
(another Horovod version) stops the setup instead of leaving a half-patched binding."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from hvtrain.launch.horovodrun import KERAS3_PATCH, keras3_patch

ROOT = Path(__file__).resolve().parents[2]


def patcher():
    spec = importlib.util.spec_from_file_location("horovod_keras3", ROOT / "scripts/horovod_keras3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed() -> Path:
    return Path(list(importlib.util.find_spec("horovod").submodule_search_locations)[0])


def test_the_expected_patch_is_the_one_setup_applies_and_it_is_installed():
    assert patcher().PATCH == KERAS3_PATCH
    assert keras3_patch() == f"present ({KERAS3_PATCH})"


def test_re_applying_changes_nothing(tmp_path):
    copy = tmp_path / "horovod"
    shutil.copytree(installed(), copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert patcher().apply(copy) == []


def test_an_edit_that_does_not_apply_stops_the_setup(tmp_path):
    copy = tmp_path / "horovod"
    shutil.copytree(installed(), copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (copy / "tensorflow/hvtrain_keras3.py").unlink()
    target = copy / "tensorflow/sync_batch_norm.py"
    target.write_text("class SyncBatchNormalization: pass\n")  # neither the original text nor the patched one
    with pytest.raises(SystemExit, match="occurs 0 times"):
        patcher().apply(copy)
    # no module left behind to say "present" (cold review: it was written before the edits)
    assert not (copy / "tensorflow/hvtrain_keras3.py").exists()


def test_a_reinstalled_horovod_is_not_taken_for_a_patched_one(tmp_path, monkeypatch):
    """pip's reinstall restores Horovod's files and keeps the module (in no wheel's record)."""
    import hvtrain.launch.horovodrun as horovodrun

    copy = tmp_path / "horovod"
    shutil.copytree(installed(), copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    edited = copy / "_keras/__init__.py"
    edited.write_text(edited.read_text().replace("hvtrain's patch (Keras 3)", "upstream"))

    class Spec:
        submodule_search_locations = [str(copy)]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: Spec())
    assert horovodrun.keras3_patch().startswith("absent (its module is there")
