"""What `--resume` does at a run's end: a finished run stays finished (its results kept, not
rewritten), whether its last checkpoint or, for a config that writes none, its summary says so.
"""

from __future__ import annotations

from typing import Any

from hvtrain.config.schema import Config
from hvtrain.errors import HvtrainError
from hvtrain.runtime.manifest import training_hash
from hvtrain.training.run import WEIGHTS_FILE, Position, Run


def finished(cfg: Config, pos: Position) -> bool:
    """Whether training from `pos` has nothing left: train.epochs done or train.max_steps reached."""
    return pos.epoch >= cfg.train.epochs or bool(cfg.train.max_steps) and pos.step >= cfg.train.max_steps


def kept_results(run: Run, path: str, meta: dict[str, Any], pos: Position, resume: str) -> dict[str, Any] | None:
    """A resume from a checkpoint at the run's end (every requeue script passes `--resume auto`,
    finished or not): the run stays finished. Its summary.json, final.safetensors, metrics and
    scores are kept as they are and the summary is returned (it used to be rewritten with no
    train loss or val metrics, and val_scores.npz deleted). None when that run's outputs were never
    written (killed after its last checkpoint; a summary older than the checkpoint is an earlier
    run's): then the caller completes them from the checkpoint.

    Raises:
        HvtrainError: the directory's summary.json is another run's, written after the checkpoint
            (finishing this one would overwrite it).
    """
    reporter, limit, run_id = run.reporter, run.cfg.train.max_steps, meta["run_id"]
    summary, written = reporter.read_json("summary.json"), reporter.modified("summary.json")
    final = reporter.modified(WEIGHTS_FILE) is not None
    summary, written, final = run.runtime.broadcast_object((summary, written, final))
    end = (f"epoch {pos.epoch} of train.epochs {run.cfg.train.epochs}" if pos.epoch >= run.cfg.train.epochs
           else f"step {pos.step} of train.max_steps {limit}")
    if summary is not None and summary.get("run_id") != run_id and written < meta.get("created", 0.0):
        summary = None  # an earlier run's, which this one replaces in the directory
    if summary is None or not final:
        reporter.notice(f"resume: {path} is the end of training ({end}) but the run's outputs were not written: "
                        "writing them from it")
        return None
    if summary.get("run_id") != run_id:
        raise HvtrainError(f"--resume {resume}: {path} is the end of run {run_id} ({end}), but "
                           f"{reporter.out_dir / 'summary.json'} is run {summary.get('run_id')}'s, written after it, "
                           "which finishing it would overwrite; train in another output_dir, or without --resume to "
                           "train anew")
    reporter.notice(f"resume: {path} is the end of training ({end}): the run is finished and its results in "
                    f"{reporter.out_dir} are kept (raise train.epochs or train.max_steps to train on)")
    return summary


def unnamed_data(run: Run) -> str | None:
    """The data's content hash where the config does not name the data (the Python API's data=, a
    data entrypoint's arrays or object), for checkpoints to record and a resume to match; None
    where the config names files (the same paths are the same experiment: a data set copied
    again to a node's scratch disk resumes)."""
    d = run.cfg.data
    return run.data.content_hash() if d.provided is not None or d.entrypoint is not None else None


def finished_without_checkpoints(run: Run) -> dict[str, Any] | None:
    """`--resume auto` (a requeue script passes it every time) where no checkpoint is, because
    this config writes none: when the directory holds the finished outputs of this same config
    on this same data (summary.json with its training_hash and the data's content_hash, and
    final.safetensors), the run is finished and they are kept (they used to be trained over from
    scratch); None otherwise (train anew, as before). A model= factory (the Python API) is known
    by its name only (`python:make`, every lambda `python:<lambda>`), so its results are never
    kept: it trains anew. The config's hash alone left out the Python API's data= arrays, so new
    arrays got the previous arrays' results back without training."""
    summary = run.reporter.read_json("summary.json")
    final = run.reporter.modified(WEIGHTS_FILE) is not None
    summary, final = run.runtime.broadcast_object((summary, final))
    if summary is None or not final or summary.get("config_hash") != training_hash(run.cfg) \
            or summary.get("data_hash") != run.data.content_hash():
        return None
    if run.cfg.model.factory is not None:
        run.reporter.notice(f"resume: the finished run in {run.reporter.out_dir} may be another model's: a model= "
                            f"factory is known only by its name ({run.cfg.model.entrypoint}), so its results are not "
                            "kept")
        return None
    run.reporter.notice(f"resume: no checkpoint in {run.reporter.out_dir}, but the run there finished on this config "
                        "and this data (summary.json, final.safetensors): its results are kept (this config writes no "
                        "checkpoints to continue from: another config or data, or no --resume, trains anew)")
    return summary
