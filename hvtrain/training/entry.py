"""The training entry points behind the CLI and the Python API: `train` (checks, signal handlers,
then the session and the loop) and `evaluate` (saved weights on the validation split).

All input checks (config, layers, dataset, shapes) run before Horovod or a framework is
imported (hvtrain.runtime.experiment), so bad input fails fast with a located message and no rank
starts training.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

from hvtrain.config.schema import Config
from hvtrain.config.validate import draws_seed, per_replica_batch
from hvtrain.errors import ConfigError
from hvtrain.io import tensorboard as tbevents
from hvtrain.launch.process import affinity, elastic_launch, launch_rank
from hvtrain.metrics.suite import MetricSet
from hvtrain.model.spec import check_weights
from hvtrain.model.weights import WeightFile
from hvtrain.runtime.experiment import ConfigSource, Prepared, check_output_dir, prepare
from hvtrain.runtime.session import (
    Session,
    build_native,
    check_agreement,
    loaded_model,
    watch_hosts,
    where_ranks_run,
    write_manifest,
)


def train(config: ConfigSource, backend: str | None = None, output_dir: str | None = None,
          overrides: Sequence[str] = (), quiet: bool = False, resume: str | None = None,
          elastic: bool = False, model: Any = None, data: Any = None, signals: Any = None) -> dict[str, Any]:
    """Train one experiment on this process's rank: data parallel, pipelined or hybrid, one loop.
    `signals`: the hvtrain.training.preempt.StopSignals the caller installed already (the CLI does, first)."""
    from hvtrain.runtime.manifest import collect_before_mpi
    from hvtrain.training.preempt import StopSignals

    # Recorded from here on at the latest (the CLI's from its start): a pre-emption notice during
    # start-up ends this rank at the next phase boundary (signals.check), or, once Horovod runs,
    # every rank before the first step, exit 75 with nothing to lose, instead of killing it.
    # Elastic runs keep the default handlers: their loop does not check (Horovod elastic restarts).
    with nullcontext(signals) if signals is not None else StopSignals(enabled=not elastic) as signals:
        signals.check("the config")
        p = prepare(config, backend, output_dir, overrides, model, data, stop=signals.check)
        check_output_dir(p.cfg, output_dir)
        tbevents.check(p.cfg)
        if p.spec is not None and p.cfg.model.init_from is not None:  # checked before any rank starts
            if resuming(p.cfg, resume):  # the checkpoint's weights replace the initial ones anyway
                p.initial_note = (f"init_from {p.cfg.model.init_from}: not read (resuming from a checkpoint, whose "
                                  "weights continue)")
            else:
                from hvtrain.model.weights import initial_weights

                p.initial, p.initial_note = initial_weights(p.cfg, p.spec)
        if elastic and resume is not None:
            raise ConfigError("--elastic and --resume cannot be combined: elastic state is committed in memory "
                              "and restored by Horovod; resume a non-elastic run from its checkpoints instead")
        if elastic and not elastic_launch():
            raise ConfigError("--elastic: not launched by Horovod elastic; use horovodrun -np N --min-np A --max-np "
                              "B --host-discovery-script SCRIPT hvtrain train CONFIG --elastic")
        if elastic and p.cfg.pipelined:
            raise ConfigError("--elastic: pipelined runs cannot be elastic (stages are bound to ranks)")
        if elastic and p.cfg.train.shard_optimizer:
            raise p.cfg.fail("train.shard_optimizer", "--elastic runs keep the whole optimizer state on every rank "
                             "(Horovod's state sync); a sharded one is not built for elastic yet")
        if p.cfg.pipelined:
            from hvtrain.launch.process import launched_with_gloo

            if launched_with_gloo():
                raise p.cfg.fail("parallel.pipeline", "pipeline stages exchange activations by MPI point-to-point, "
                                 "which a horovodrun --gloo launch does not provide; use horovodrun (MPI) or mpirun")
        where = launch_rank()
        if where is not None and not elastic and where[1] % p.cfg.parallel.pipeline.stages == 0:
            per_replica_batch(p.cfg, where[1] // p.cfg.parallel.pipeline.stages)  # before any framework import
        signals.check("the framework's import")
        collect_before_mpi()
        return _train(p, quiet, resume, elastic, signals)


def resuming(cfg: Config, resume: str | None) -> bool:
    """Whether `--resume` will continue from a checkpoint (model.init_from is then not read): a
    checkpoint path, or `auto` with checkpoint files in the output directory. `auto` finding none
    that verifies and matches is an error then (trainer.fit), not a silent seeded start."""
    if resume is None:
        return False
    if resume != "auto":
        return True
    from hvtrain.io.checkpoints import list_checkpoints

    return bool(list_checkpoints(cfg.out_dir))


def _train(p: Prepared, quiet: bool, resume: str | None, elastic: bool, signals: Any) -> dict[str, Any]:
    with Session(p.cfg, p.spec, elastic=elastic, signals=signals) as s:
        # data.global_batch_size: this world's per-replica batch (elastic: again after each reset)
        per_replica_batch(p.cfg, s.plan.replicas if s.plan is not None else s.info.size)
        if not elastic:  # elastic: workers join mid-run, where only Horovod's state sync may talk
            check_agreement(p, s.runtime)
        return fit_session(s, p, quiet, resume, signals)


def evaluate(config: ConfigSource, weights_path: str, backend: str | None = None, output_dir: str | None = None,
             overrides: Sequence[str] = (), model: Any = None, data: Any = None) -> dict[str, Any]:
    """Validation metrics of saved weights (any backend's), reduced across ranks; writes eval.json.
    Every metric, pipelined configs' too: the model is loaded whole."""
    from hvtrain.io.reporter import Reporter
    from hvtrain.model.weights import evaluation_data, read_weights
    from hvtrain.training.loop import reduce_metrics

    p = prepare(config, backend, output_dir, overrides, model, data)
    check_output_dir(p.cfg, output_dir)
    wf = read_weights(weights_path)  # read (a checkpoint: verified) once, its weights and inputs record
    # fed as the weights were trained (their inputs record), on a split that holds none of their training samples
    trained, notes = evaluation_data(p.cfg, p.data, wf.inputs, weights_path)
    p = replace(p, data=trained)
    with _loaded(p, wf) as (s, steps):
        reporter = Reporter(s.info, p.cfg.out_dir, keep_metrics=True)
        for note in [*notes, *steps.metrics.notes]:
            reporter.notice(note)
        metrics, _ = reduce_metrics(s.runtime, steps.metrics, steps.eval_sums(p.data.val))
        result = {"config": p.cfg.source, "weights": weights_path, "backend": p.cfg.backend,
                  "world_size": s.info.size, **{f"val_{k}": v for k, v in metrics.items()}}
        if p.data.series is not None:  # a forecaster: its errors in the series' units too, as training's summary
            from hvtrain.data.timeseries import in_series_units

            result["series"] = {**p.data.series, **in_series_units(p.data.series, metrics)}
        reporter.write_json("eval.json", result)
        reporter.print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
                                if not isinstance(v, (list, dict))))  # per-class values: in eval.json
        return result


@contextmanager
def _loaded(p: Prepared, wf: WeightFile) -> Iterator[tuple[Session, Any]]:
    """A session whose whole model holds saved weights (any world size; pipelines load whole)."""
    from hvtrain.training.steps import DataParallelSteps

    if p.spec is not None:
        check_weights(p.spec, wf.weights, wf.path)
    form = wf.inputs.output if wf.inputs is not None else None  # an entrypoint model's, as it was trained
    with loaded_model(p.cfg, p.spec, wf.weights, p.data.num_outputs, p.data, form) as s:
        yield s, DataParallelSteps(s.backend, s.runtime, MetricSet.of(p.cfg, p.data))


def fit_session(s: Session, p: Prepared, quiet: bool, resume: str | None, signals: Any = None) -> dict[str, Any]:
    """Train `p` in the session `s` (Horovod up, backend configured): build the model (whole, or
    this rank's pipeline stage) and its StepRunner, the reporter and the checkpoint manager, then
    the one loop; the lost-host watchdog and the signal handlers around it."""
    from hvtrain.io.reporter import Reporter
    from hvtrain.model.weights import describe_inputs
    from hvtrain.training.checkpoint import CheckpointManager
    from hvtrain.training.run import Run
    from hvtrain.training.steps import DataParallelSteps

    cfg, rt = s.cfg, s.runtime
    weights = p.initial if p.initial is not None else p.spec.init_weights(cfg.seed) if p.spec is not None \
        else None
    reporter = Reporter(s.info, cfg.out_dir, quiet=quiet, keep_metrics=resume is not None or s.elastic,
                        tensorboard=cfg.output.tensorboard)
    metrics = MetricSet.of(cfg, p.data)
    if p.initial_note:
        reporter.print(p.initial_note)
    for note in metrics.notes:
        reporter.notice(note)
    if s.plan is None:
        build_native(cfg, s.backend, p.spec, weights, p.data, rt)
        note = s.backend.output_form().note(cfg.model.entrypoint) if p.spec is None else None
        if note:
            reporter.notice(note)
        steps = DataParallelSteps(s.backend, rt, metrics, draws_seed(cfg, p.spec))
        layout = None
    else:
        from hvtrain.pipeline.runner import PipelineSteps
        from hvtrain.pipeline.runner import layout as stage_layout

        index = s.plan.stage_of(s.info.rank)
        stage = s.plan.stages[index]
        engine = s.backend.build_stage(cfg, p.spec, list(stage.layers), stage.sources, stage.outputs,
                                       stage.device, weights, s.plan.replicas, rt,
                                       rt.process_set(index) if s.plan.replicas > 1 else None)
        steps = PipelineSteps(cfg, s.plan, p.spec, engine, rt, s.comm, metrics)
        if cfg.train.shard_optimizer and s.plan.replicas == 1:
            reporter.notice("train.shard_optimizer: each pipeline stage has one replica here, so each keeps its "
                            "whole optimizer state (a stage's state is cut over its data-parallel replicas)")
        layout = stage_layout(s.plan)
    del weights  # the model holds them now: not a second copy of every weight for the whole run
    # travels with every checkpoint and final.safetensors (predict from it), with the output form decided above
    inputs = describe_inputs(cfg, p.data, s.backend.output_form() if s.plan is None and p.spec is None else None)
    checkpoints = CheckpointManager(cfg, rt, reporter, layout, inputs, p.spec is not None and p.spec.draws_random)
    run = Run(cfg, p.spec, p.data, steps, rt, reporter, checkpoints,
              metrics, init_unread=p.initial is None and p.spec is not None and cfg.model.init_from is not None)
    if cfg.data.workers:
        from hvtrain.data.loader import Workers

        run.data_workers = Workers(p.data.train, cfg.data.workers)
    try:
        return _fit(run, s, rt, reporter, resume, signals)
    finally:
        if run.data_workers is not None:
            run.data_workers.close()


def _fit(run: Any, s: Session, rt: Any, reporter: Any, resume: str | None, signals: Any) -> dict[str, Any]:
    """The loop of fit_session, around it the lost-host watchdog and the signal handlers."""
    from hvtrain.training.loop import fit

    cfg = run.cfg
    if s.elastic:  # a joining worker must meet nothing but Horovod's state sync: no gather
        import socket

        from hvtrain.training.elastic import Elastic

        run.manifest = lambda: write_manifest(cfg, rt, reporter, [socket.gethostname()], [list(affinity())])
        return fit(run, resume, Elastic(s.backend))
    places, listener, cpus = where_ranks_run(rt, listen=cfg.train.peer_timeout_s > 0)
    run.manifest = lambda: write_manifest(cfg, rt, reporter, [place.host for place in places], cpus)
    run.signals = signals
    if signals is not None:  # MPI_Init (inside hvd.init) replaced the handlers (measured)
        signals.rearm()
    run.watchdog = watch_hosts(rt, places, cfg.train.peer_timeout_s)
    try:
        return fit(run, resume)
    finally:
        if run.watchdog is not None:
            run.watchdog.stop()
        if listener is not None:
            listener.close()
