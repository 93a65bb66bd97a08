"""hvtrain launch's horovodrun (hvtrain/launch/horovodrun.py): Horovod's build check asked once per
installed build and then answered from the cache (the real launch: tests/parallel/test_launch.py)."""

from __future__ import annotations

import json
import os

from hvtrain.launch.horovodrun import cache_file, cached


def test_the_check_is_asked_once_per_build_and_an_unusable_cache_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lib = tmp_path / "horovod" / "torch" / "mpi_lib_v2.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"x")
    path = cache_file(tmp_path / "horovod", "0.28.1")
    asked = []

    def check(verbose=False):
        asked.append(verbose)
        return True

    answer = cached("mpi", check, path)
    assert answer() is True and answer(verbose=True) is True and asked == [False]
    assert json.loads(path.read_text()) == {"mpi": True}
    assert cached("gloo", lambda verbose=False: True, path)() is True
    assert json.loads(path.read_text()) == {"mpi": True, "gloo": True}  # one entry per build, both answers
    no = []
    assert cached("mpi", lambda verbose=False: no.append(1) or False, tmp_path / "no.json")() is False
    assert cached("mpi", lambda verbose=False: no.append(1) or False, tmp_path / "no.json")() is False
    assert no == [1, 1] and not (tmp_path / "no.json").exists()  # a no is Horovod's to say, every time
    os.utime(lib, ns=(0, 0))  # a rebuilt or reinstalled Horovod is another build
    assert cache_file(tmp_path / "horovod", "0.28.1") != path != cache_file(tmp_path / "horovod", "0.28.2")
    path.write_text("{not json")
    assert answer() is True and asked == [False, False]  # asked again, and the entry rewritten
    assert json.loads(path.read_text()) == {"mpi": True}
    none = cached("mpi", lambda verbose=False: None, tmp_path / "other.json")
    assert none() is None and not (tmp_path / "other.json").exists()  # no extension loaded: not an answer
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert cached("mpi", check, blocked / "sub" / "c.json")() is True  # unwritable: still answers


def test_no_home_means_no_cache_not_a_failed_launch(tmp_path, monkeypatch):
    """An arbitrary container user: no HOME, no passwd entry; Path.home() raises RuntimeError."""
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr("pathlib.Path.home", staticmethod(no_home))
    assert cache_file(tmp_path, "0.28.1") is None
