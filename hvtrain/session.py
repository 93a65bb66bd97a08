"""Library entry points behind the CLI: validate everything, then train.

All input checks (config, layers, dataset, shapes) run before Horovod or a framework is
imported, so bad input fails fast with a located message and no rank starts training.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvtrain.config import Config, load_config
from hvtrain.data import Dataset, load_dataset
from hvtrain.dist import elastic_launch, setting
from hvtrain.errors import ConfigError, DataError, HvtrainError
from hvtrain.spec import ModelSpec, build_spec, check_against_data, check_weights


@dataclass
class Prepared:
    cfg: Config
    spec: ModelSpec | None
    data: Dataset


def prepare(config_path: str, backend: str | None = None, output_dir: str | None = None,
            overrides: Sequence[str] = ()) -> Prepared:
    """Load and check a config and its data. Raises HvtrainError subclasses on bad input."""
    extra = list(overrides)
    backend = setting(backend, "HVTRAIN_BACKEND")
    output_dir = setting(output_dir, "HVTRAIN_OUTPUT_DIR")
    if backend is not None:
        extra.append(f"backend={backend}")
    if output_dir is not None:
        extra.append(f"output_dir={output_dir}")
    cfg = load_config(config_path, extra)
    spec = build_spec(cfg) if cfg.model.entrypoint is None else None
    data = load_dataset(cfg, spec.input_shape if spec else _tuple(cfg.model.input_shape),
                        spec.integer_input if spec else False)
    if spec is not None:
        check_against_data(cfg, spec, data.feature_shape, data.num_outputs)
    return Prepared(cfg, spec, data)


def train(config_path: str, backend: str | None = None, output_dir: str | None = None,
          overrides: Sequence[str] = (), quiet: bool = False, resume: str | None = None,
          elastic: bool = False) -> dict[str, Any]:
    from hvtrain.backend import get_backend
    from hvtrain.output import Reporter
    from hvtrain.trainer import fit

    p = prepare(config_path, backend, output_dir, overrides)
    if elastic and resume is not None:
        raise ConfigError("--elastic and --resume cannot be combined: elastic state is committed in memory "
                          "and restored by Horovod; resume a non-elastic run from its checkpoints instead")
    if elastic and not elastic_launch():
        raise ConfigError("--elastic: not launched by Horovod elastic; use horovodrun -np N --min-np A --max-np B "
                          "--host-discovery-script SCRIPT hvtrain train CONFIG --elastic")
    if p.cfg.pipelined:
        if elastic:
            raise ConfigError("--elastic: pipelined runs cannot be elastic (stages are bound to ranks)")
        return _train_pipeline(p, quiet, resume)
    engine = get_backend(p.cfg.backend)
    info = engine.init(p.cfg)
    with ending_cleanly(info):
        if not elastic:  # elastic: workers join mid-run, where only Horovod's state sync may talk
            check_agreement(p, engine, info)
        reporter = Reporter(info, p.cfg.out_dir, quiet=quiet, keep_metrics=resume is not None or elastic)
        summary = fit(p.cfg, p.spec, p.data, engine, info, reporter, resume, elastic)
    engine.shutdown()
    return summary


@contextmanager
def ending_cleanly(info) -> Iterator[None]:
    """On several ranks, an error on one rank ends the whole job at once: the rank says who it
    is and why, then aborts MPI (mpirun/horovodrun kill the others) or exits (Gloo: horovodrun
    ends the others). The other ranks would otherwise wait in the next allreduce forever."""
    try:
        yield
    except BaseException as exc:
        if info.size == 1 or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        from hvtrain.dist import abort_job
        from hvtrain.output import report_failure

        report_failure(info, exc)
        abort_job(info, exc.exit_code if isinstance(exc, HvtrainError) else 1)


def check_agreement(p: Prepared, engine, info) -> None:
    """Cheap start-up check that every rank runs the same experiment on the same data: rank 0's
    fingerprints are broadcast and each rank compares its own (a rank that differs names itself)."""
    mine = fingerprints(p)
    theirs = engine.broadcast_object(mine)
    differ = [k for k in mine if mine[k] != theirs[k]]
    agreed = engine.allgather_object(differ)
    bad = {r: d for r, d in enumerate(agreed) if d}
    if bad:
        detail = "; ".join(f"rank {r}: {', '.join(d)}" for r, d in bad.items())
        raise HvtrainError(f"ranks disagree with rank 0 ({detail}): every rank must run the same config on the "
                           "same data and model")


def fingerprints(p: Prepared) -> dict[str, str]:
    cfg = dict(p.cfg.to_dict())
    cfg.pop("output_dir", None)

    def digest(*arrays: np.ndarray) -> str:
        h = hashlib.sha256()
        for a in arrays:
            h.update(str(a.shape).encode() + a.dtype.str.encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    model = [(w.name, w.shape) for w in p.spec.weight_specs()] if p.spec else [p.cfg.model.entrypoint]
    return {"config": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16],
            "data": digest(p.data.x_train, p.data.y_train, p.data.x_val, p.data.y_val),
            "model": hashlib.sha256(repr(model).encode()).hexdigest()[:16]}


def _train_pipeline(p: Prepared, quiet: bool, resume: str | None) -> dict[str, Any]:
    """Pipeline / hybrid run: MPI world shared by mpi4py (activations) and Horovod (gradients)."""
    from hvtrain.backend import get_backend
    from hvtrain.dist import launched_with_gloo
    from hvtrain.output import Reporter
    from hvtrain.placement.plan import make_plan

    if launched_with_gloo():
        raise p.cfg.fail("parallel.pipeline", "pipeline stages exchange activations by MPI point-to-point, "
                         "which a horovodrun --gloo launch does not provide; use horovodrun (MPI) or mpirun")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    engine = get_backend(p.cfg.backend)
    plan = make_plan(p.cfg, p.spec, comm.Get_size(), {"gpu": engine.local_gpus()})
    from hvtrain.placement.runner import fit_pipeline

    groups = [plan.dp_group(s) for s in range(plan.num_stages)] if plan.replicas > 1 else None
    info = engine.init(p.cfg, comm=comm, groups=groups)
    with ending_cleanly(info):
        check_agreement(p, engine, info)
        stage = plan.stages[plan.stage_of(info.rank)]
        stage_engine = engine.build_stage(p.cfg, p.spec, stage, plan, p.spec.init_weights(p.cfg.seed))
        reporter = Reporter(info, p.cfg.out_dir, quiet=quiet, keep_metrics=resume is not None)
        summary = fit_pipeline(p.cfg, p.spec, p.data, stage_engine, plan, info, reporter, comm, resume)
    engine.shutdown()
    return summary


def evaluate(config_path: str, weights_path: str, backend: str | None = None, output_dir: str | None = None,
             overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Validation metrics of saved weights (any backend's), reduced across ranks; writes eval.json."""
    from hvtrain.backend import get_backend
    from hvtrain.output import Reporter
    from hvtrain.trainer import evaluate as run_eval

    p = prepare(config_path, backend, output_dir, overrides)
    weights = load_weights(weights_path)
    if p.spec is not None:
        check_weights(p.spec, weights, weights_path)
    engine = get_backend(p.cfg.backend)
    info = engine.init(p.cfg)
    try:
        engine.build(p.cfg, p.spec, weights, p.data.num_outputs)
        metrics = run_eval(p.cfg, p.data, engine, info)
        result = {"config": config_path, "weights": weights_path, "backend": p.cfg.backend,
                  "world_size": info.size, **{f"val_{k}": v for k, v in metrics.items()}}
        reporter = Reporter(info, p.cfg.out_dir, keep_metrics=True)
        reporter.write_json("eval.json", result)
        reporter.print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
        return result
    finally:
        engine.shutdown()


def load_weights(path: str) -> dict[str, np.ndarray]:
    """A safetensors file (never pickle: loading cannot run code)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except FileNotFoundError:
        raise DataError(f"{path}: weights file not found") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable safetensors file ({exc})") from None


def _tuple(shape: list[int] | None) -> tuple[int, ...] | None:
    return tuple(shape) if shape else None
