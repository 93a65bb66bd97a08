"""The one training loop, driven on simulated ranks (tests.support.fakes.World): no framework, no
Horovod, milliseconds per run. The real loop, checkpoint manager, reporter, metrics, resume and
pre-emption logic and elastic driver; a float64 linear model whose final weights say whether the
loop fed it the right samples, weights and learning rates. The multi-process proof of each
capability is in tests/parallel."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvtrain.errors import HvtrainError, Preempted
from hvtrain.io.checkpoints import list_checkpoints
from tests.support.fakes import World


def metrics(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k.startswith("val_")}


def assert_same_metrics(a: dict, b: dict) -> None:
    """Counts exactly, real-valued figures to float64 rounding (sums in another order)."""
    a, b = metrics(a), metrics(b)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-12, err_msg=k)


@pytest.mark.parametrize(("ranks", "batch", "accumulation"), [(2, 10, 1), (4, 5, 1), (2, 5, 2), (1, 10, 2)])
def test_any_world_size_with_the_same_global_batch_trains_the_same_model(tmp_path, ranks, batch, accumulation):
    """np=N with batch b (and k accumulated micro-batches) is np=1 with batch N*b*k: the same
    samples, weights and lr reach every optimizer step, and the metrics reduce to the same values."""
    one = World(1).run(tmp_path / "one", "data.batch_size=20")
    many = World(ranks).run(tmp_path / "many", f"data.batch_size={batch}", f"train.grad_accumulation={accumulation}")
    np.testing.assert_allclose(many.steps[0].w, one.steps[0].w, rtol=1e-12, atol=1e-15)
    assert all(np.array_equal(s.w, many.steps[0].w) for s in many.steps)  # replicas bitwise equal
    assert_same_metrics(many.summary, one.summary)
    assert many.summary["steps"] == one.summary["steps"] == 40


def test_every_training_sample_is_seen_once_per_epoch_across_ranks_with_a_short_tail(tmp_path):
    """400 training samples on 3 ranks of batch 7: the global batches of 21 end in a short one;
    ranks with an empty share join with a zero-weight sample."""
    out = World(3).run(tmp_path, "data.batch_size=7", "train.epochs=1")
    seen = sorted(i for s in out.steps for i in s.seen)
    assert seen == list(range(400))
    assert out.summary["steps"] == 20  # ceil(400 / 21)


def test_metrics_reduce_from_global_sums_on_uneven_shares(tmp_path):
    """100 validation samples on 3 ranks (34, 33, 33): the accuracy, confusion matrix and F1 are
    those of the 100, not an average of the ranks' figures."""
    one, three = World(1).run(tmp_path / "a"), World(3).run(tmp_path / "b")
    assert three.summary["val_confusion_matrix"] == one.summary["val_confusion_matrix"]
    assert three.summary["val_samples"] == 100
    assert three.summary["val_accuracy"] == one.summary["val_accuracy"]
    assert three.summary["val_f1"] == pytest.approx(one.summary["val_f1"], abs=1e-15)


def test_a_mid_epoch_preemption_checkpoints_at_one_common_step_and_the_resume_is_exact(tmp_path):
    """Rank 1 alone is signalled after step 13; with signal_check_every 5 every rank stops at step
    15, rank 0 writes the checkpoint there, every rank raises Preempted, and one numbering says
    where. The resume continues to the same weights as an uninterrupted run (bitwise)."""
    whole = World(2).run(tmp_path / "whole")
    cut = World(2).run(tmp_path / "cut", "train.signal_check_every=5", signals=True, signal_at={1: 13})
    assert all(isinstance(e, Preempted) for e in cut.errors), cut.errors
    assert [s.steps_taken for s in cut.steps] == [15, 15]
    assert "preempted at epoch 1, step 15:" in str(cut.errors[0]) and str(cut.errors[0]) == str(cut.errors[1])
    (ckpt,) = list_checkpoints(tmp_path / "cut")
    assert ckpt.name.endswith("-s00000015.safetensors")
    again = World(2).run(tmp_path / "cut", "train.signal_check_every=5", resume="auto")
    assert [s.steps_taken for s in again.steps] == [25, 25]  # 40 steps in all
    assert np.array_equal(again.steps[0].w, whole.steps[0].w)
    assert_same_metrics(again.summary, whole.summary)


def test_a_notice_before_the_first_step_stops_every_rank_with_nothing_written(tmp_path):
    out = World(2).run(tmp_path, "train.checkpoint_every=1", notice_before=True)
    for steps in out.steps:
        assert steps.steps_taken == 0
    assert all(isinstance(e, Preempted) for e in out.errors), out.errors
    assert "before training started" in str(out.errors[0])
    assert list_checkpoints(tmp_path) == [] and not (tmp_path / "summary.json").exists()


def test_max_steps_stops_inside_an_epoch_and_a_larger_limit_resumes_exactly(tmp_path):
    """max_steps=15 stops in epoch 1 with a checkpoint at the stop and a partial metrics line; a
    resume with max_steps=30 ends where an uninterrupted max_steps=30 run ends."""
    whole = World(2).run(tmp_path / "whole", "train.max_steps=30")
    first = World(2).run(tmp_path / "cut", "train.max_steps=15", "train.checkpoint_every=100",
                         "train.checkpoint_unit=step")
    assert first.summary["stopped_at_max_steps"] and first.summary["steps"] == 15
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [lines[0]] and lines[0]["partial"] is True and lines[0]["epoch"] == 1
    more = World(2).run(tmp_path / "cut", "train.max_steps=30", "train.checkpoint_every=100",
                        "train.checkpoint_unit=step", resume="auto")
    assert more.summary["steps"] == 30 and [s.steps_taken for s in more.steps] == [15, 15]
    assert np.array_equal(more.steps[0].w, whole.steps[0].w)


def test_a_non_finite_loss_on_one_rank_stops_the_job_naming_that_rank_and_step(tmp_path):
    out = World(2).run(tmp_path, nan_at={1: 5})
    assert isinstance(out.errors[1], HvtrainError)
    assert str(out.errors[1]).startswith("non-finite loss at epoch 1, step 5 on rank 1 (train.on_nan: stop")
    assert not (tmp_path / "summary.json").exists()


def test_on_nan_skip_leaves_the_decision_to_the_step_and_trains_on(tmp_path):
    out = World(2).run(tmp_path, "train.on_nan=skip", nan_at={1: 5})
    assert out.summary["steps"] == 40
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in lines] == [1, 0]  # one rank's non-finite loss skips the step for all


def test_on_nan_skip_of_every_step_of_an_epoch_ends_the_run_instead_of_reporting_a_zero_loss(tmp_path):
    """Defect (found with the inf-loss fix): an epoch whose every step had a non-finite loss was
    recorded with train_loss 0.0 and the run went on, exit 0. Every rank now ends it in one line."""
    out = World(2).run(tmp_path, "train.on_nan=skip", nan_at={0: range(1, 10_000)})
    said = [e for e in out.errors if isinstance(e, HvtrainError)]  # a rank that raised first breaks the
    assert said and all("skipped every one of epoch 1's 20 steps" in str(e) for e in said), out.errors  # sim barrier
    assert not (tmp_path / "summary.json").exists()


def test_an_elastic_reset_rolls_back_to_the_last_commit_and_ends_like_an_uninterrupted_run(tmp_path):
    """A worker failure before step 13 (elastic_commit_every 5): the attempt restarts from the
    commit at step 10, its unfinished micro-batches discarded, and the run ends bitwise as one
    that never failed."""
    whole = World(2).run(tmp_path / "whole", elastic=True)
    reset = World(2).run(tmp_path / "reset", "train.elastic_commit_every=5", elastic=True, reset_at=13)
    assert np.array_equal(reset.steps[0].w, whole.steps[0].w)
    assert all(np.array_equal(s.w, reset.steps[0].w) for s in reset.steps)
    assert reset.steps[0].steps_taken == whole.steps[0].steps_taken + 2  # steps 11, 12 taken again
    assert_same_metrics(reset.summary, whole.summary)


def test_checkpoints_are_pruned_to_keep_and_only_the_runs_own(tmp_path):
    """train.keep 2 with a checkpoint every 4 steps: this run leaves its two newest; an earlier
    run's checkpoint in the same directory is never touched."""
    World(1).run(tmp_path, "train.epochs=1", "train.checkpoint_every=40", "train.checkpoint_unit=step")
    (earlier,) = list_checkpoints(tmp_path)
    World(2).run(tmp_path, "train.checkpoint_every=4", "train.checkpoint_unit=step", "train.keep=2")
    mine = [p for p in list_checkpoints(tmp_path) if p != earlier]
    assert sorted(p.name[-22:] for p in mine) == ["-s00000036.safetensors", "-s00000040.safetensors"]
    assert earlier.exists()


def test_every_rank_meets_the_same_collectives_in_the_same_order(tmp_path):
    """A rank that skipped or added a collective would hang a real job: the simulated runtime
    checks every allreduce's name across ranks, and here the whole sequence."""
    out = World(3).run(tmp_path, "train.checkpoint_every=1", signals=True)
    assert out.runtimes[0].calls == out.runtimes[1].calls == out.runtimes[2].calls
    assert out.runtimes[0].calls.count("sim.grads") == 28  # 2 epochs x 14 steps of 30 samples
