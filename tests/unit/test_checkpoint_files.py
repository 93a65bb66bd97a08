"""Checkpoint files without processes: pruning, listing, config matching."""

import numpy as np
import pytest

from hvtrain.errors import ConfigError
from hvtrain.io import checkpoints as checkpoint


def save(d, step, run_id="0123abcd", keep=5, config=None):
    meta = {"step": step, "epoch": 0, "run_id": run_id, "config": config or {"seed": 1}}
    return checkpoint.save(d, {"w": np.full(2, step, np.float32)}, meta, keep)


def test_keep_holds_the_newest_written_even_after_resuming_from_an_older_step(tmp_path):
    """Defect: pruning by step deleted the checkpoint just written when the run (resumed from an
    older checkpoint) had left higher-step files of its abandoned continuation."""
    save(tmp_path, 500)
    save(tmp_path, 750)
    newest = save(tmp_path, 625, keep=1)
    assert checkpoint.list_checkpoints(tmp_path) == [newest]


def test_pruning_never_touches_another_run(tmp_path):
    other = [save(tmp_path, s, run_id="aaaaaaaa") for s in (10, 20, 30)]
    mine = [save(tmp_path, s, run_id="bbbbbbbb", keep=1) for s in (1, 2)]
    assert set(checkpoint.list_checkpoints(tmp_path)) == set(other) | {mine[-1]}
    assert checkpoint.list_checkpoints(tmp_path, "bbbbbbbb") == [mine[-1]]


def test_auto_skips_other_experiments_and_names_the_keys_when_none_match(tmp_path):
    notes = []
    save(tmp_path, 5, run_id="aaaaaaaa", config={"seed": 1, "optimizer": {"lr": 0.1}})
    save(tmp_path, 7, run_id="bbbbbbbb", config={"seed": 2, "optimizer": {"lr": 0.1}})
    found = checkpoint.find_resume(tmp_path, "auto", {"seed": 1, "optimizer": {"lr": 0.1}}, notes.append)
    assert found.meta["run_id"] == "aaaaaaaa" and "seed: checkpoint 2, this run 1" in notes[0]
    with pytest.raises(ConfigError, match=r"optimizer.lr: checkpoint 0.1, this run 0.2"):
        checkpoint.find_resume(tmp_path, "auto", {"seed": 1, "optimizer": {"lr": 0.2}}, notes.append)


def test_keys_outside_the_math_may_change():
    assert checkpoint.config_differences({"train": {"epochs": 3, "keep": 2}, "output_dir": "a"},
                                         {"train": {"epochs": 9, "keep": 5}, "output_dir": "b"}) == []
    assert checkpoint.config_differences({"train": {"grad_accumulation": 1}}, {"train": {"grad_accumulation": 2}}) \
        == ["train.grad_accumulation: checkpoint 1, this run 2"]
