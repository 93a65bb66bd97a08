"""The end of a run: the whole model's weights gathered on rank 0 (replicas checked bitwise equal),
final.safetensors with its inputs record, val_scores.npz and summary.json.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from hvtrain.config.schema import Config
from hvtrain.data.dataset import Dataset
from hvtrain.data.timeseries import in_series_units
from hvtrain.errors import HvtrainError
from hvtrain.io.checkpoints import decode, encode
from hvtrain.io.reporter import SCORES_FILE
from hvtrain.model.spec import ModelSpec
from hvtrain.model.weights import INPUTS_KEY, describe_inputs, layer_metadata
from hvtrain.runtime.manifest import training_hash
from hvtrain.training.run import WEIGHTS_FILE, EpochResult, Run
from hvtrain.training.steps import digest
from hvtrain.version import __version__


def final_weights(run: Run) -> tuple[dict[str, np.ndarray], bool]:
    """The neutral weights of the whole model on rank 0 (each shard from its first rank), and whether
    every replica of every shard holds bitwise the same trainable weights (a silent divergence
    otherwise; batchnorm statistics are per replica and the file holds the first replica's)."""
    steps, rt = run.steps, run.runtime
    mine = steps.weights()
    trainable = steps.trainable_names()
    fingerprints = rt.allgather_object((steps.shard, digest({k: v for k, v in mine.items() if k in trainable})))
    agree = all(len({d for s, d in fingerprints if s == shard}) == 1 for shard, _ in fingerprints)
    own = steps.owns_shard and rt.info.is_main  # rank 0's own share stays as it is: no copy through bytes
    blobs = rt.gather_bytes(encode(mine if steps.owns_shard and not own else {}))
    weights: dict[str, np.ndarray] = dict(mine) if own else {}
    for blob in blobs or []:
        weights.update(decode(blob))
    return weights, agree


def finish(run: Run, result: EpochResult | None, t0: float, extra: dict[str, Any]) -> dict[str, Any]:
    """final.safetensors and summary.json (the last epoch's figures plus run facts)."""
    cfg, info = run.cfg, run.runtime.info
    state_bytes = run.steps.optimizer_state_bytes()
    run.steps.release_training_state()  # before every weight is copied below: the run's peak memory is training's
    weights, agree = final_weights(run)
    if not agree:
        raise HvtrainError("replicas ended with different weights (every data-parallel replica must hold the "
                           "same model); the run's outputs were not written")
    layout = run.steps.summary()
    per_rank = run.runtime.allgather_object(layout.pop("rank", None)) if "rank" in layout else None
    usage = run.runtime.allgather_object((peak_rss_mb(), run.data_wait, state_bytes))
    run.reporter.write_weights(WEIGHTS_FILE, weights, weight_metadata(cfg, run.spec, run.data, run.checkpoints.inputs))
    run.reporter.write_arrays(SCORES_FILE, final_scores(run, result))
    summary = {
        "name": cfg.name, "backend": cfg.backend, "world_size": info.size, "controller": info.controller,
        "epochs": cfg.train.epochs, "train_loss": result.train_loss if result else None,
        **({f"val_{k}": v for k, v in result.val.items()} if result else {}),
        "samples_per_sec": result.samples_per_sec if result else None,
        "steps": run.steps_done, "max_steps": cfg.train.max_steps or None,
        "stopped_at_max_steps": run.stopped_early,
        "total_seconds": time.perf_counter() - t0, "weights": WEIGHTS_FILE, "replicas_agree": agree,
        "peak_rss_mb": {"max": max(u[0] for u in usage), "rank0": usage[0][0], "ranks": [u[0] for u in usage]},
        "data_wait_seconds": {"max": max(u[1] for u in usage), "rank0": usage[0][1]},
        **({"optimizer_state_bytes": {"max": max(u[2] for u in usage), "ranks": [u[2] for u in usage]},
            "shard_optimizer": cfg.train.shard_optimizer} if usage[0][2] is not None else {}),
        **({"pipeline": {**layout, "ranks": per_rank}} if per_rank is not None else {}),
        **({"series": series_summary(run.data.series, result)} if run.data.series else {}),
        **extra, "config_hash": training_hash(cfg), "data_hash": run.data.content_hash(),
        "hvtrain_version": __version__,
    }
    run.reporter.write_json("summary.json", summary)
    run.reporter.close()
    if "val_mae" in summary.get("series", {}) and "persistence_val_mae" in summary["series"]:
        f = summary["series"]
        run.reporter.print(f"forecast val_mae={f['val_mae']:.4g} in the series' units (persistence: "
                           f"{f['persistence_val_mae']:.4g})")
    run.reporter.print(f"done in {summary['total_seconds']:.1f}s; outputs in {run.reporter.out_dir}")
    # Every rank returns once rank 0's files exist: the Python API's next call (evaluate, predict,
    # init_from) reads final.safetensors on every rank.
    run.runtime.broadcast_object(None)
    return summary


def series_summary(facts: dict[str, Any], result: EpochResult | None) -> dict[str, Any]:
    """data.window's facts and the model's validation MAE / RMSE in the series' own units."""
    return {**facts, **(in_series_units(facts, result.val) if result else {})}


def final_scores(run: Run, result: EpochResult | None) -> dict[str, np.ndarray] | None:
    """The last evaluation's validation scores (roc_auc: gathered on rank 0, which writes them),
    for `hvtrain report`'s ROC curve: `scores` [n, 1] P(class 1) (binary) or [n, classes],
    `labels` (class ids), `epoch`. None without roc_auc (any old file is removed)."""
    last = run.metrics.last_scores
    if last is None or result is None:
        return None
    return {"scores": last[0], "labels": last[1], "epoch": np.array(result.epoch)}


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux reports KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def weight_metadata(cfg: Config, spec: ModelSpec | None, data: Dataset,
                    inputs: dict[str, Any] | None = None) -> dict[str, str]:
    """safetensors header metadata: how to read the file without the config, and `inputs` (the raw
    row shape, the training split's normalisation, the classes, an entrypoint model's output form:
    predict needs no training data): the run's record `inputs`, which its checkpoints hold too."""
    return {
        INPUTS_KEY: json.dumps(inputs if inputs is not None else describe_inputs(cfg, data)),
        "format": "hvtrain-neutral-v1" if spec is not None else f"hvtrain-native-{cfg.backend}",
        "backend": cfg.backend,
        **layer_metadata(spec),
        "input_shape": ",".join(map(str, spec.input_shape)) if spec else "",
        "hvtrain_version": __version__,
    }
