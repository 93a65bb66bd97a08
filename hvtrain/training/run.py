"""What one training run holds (Run) and where it stands (Position, EpochResult): the records the
loop, the resume decisions, the finish and the elastic driver share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hvtrain.backends.steps import StepRunner
from hvtrain.config.schema import Config
from hvtrain.data.dataset import Dataset
from hvtrain.io.reporter import Reporter
from hvtrain.metrics.suite import MetricSet
from hvtrain.model.spec import ModelSpec
from hvtrain.runtime.horovod import Runtime
from hvtrain.runtime.watchdog import Watchdog
from hvtrain.training.checkpoint import CheckpointManager
from hvtrain.training.preempt import StopSignals

WEIGHTS_FILE = "final.safetensors"


@dataclass
class EpochResult:
    epoch: int
    train_loss: float
    val: dict[str, Any]  # scalars, per-class lists, the confusion matrix (hvtrain.metrics.suite)
    samples_per_sec: float
    seconds: float
    data_wait: float = 0.0  # seconds a rank's training thread waited for batches this epoch (mean over ranks)


@dataclass
class Position:
    """Where training stands: completed epochs, optimizer steps, samples of the current epoch
    already consumed, and the (global) train-loss sum of those samples."""

    epoch: int = 0
    step: int = 0
    offset: int = 0
    loss_sum: float = 0.0
    epoch_steps: int = 0


@dataclass
class Run:
    """Everything one training run holds: what it trains, who it talks to, where it writes."""

    cfg: Config
    spec: ModelSpec | None
    data: Dataset
    steps: StepRunner
    runtime: Runtime
    reporter: Reporter
    checkpoints: CheckpointManager
    metrics: MetricSet  # what evaluation sums and reports (the StepRunner's eval_sums layout)
    init_unread: bool = False  # model.init_from was not read: --resume expected a checkpoint to continue
    data_wait: float = 0.0  # seconds this rank's training thread waited for batches
    steps_done: int = 0  # optimizer steps taken in all (across resumes)
    stopped_early: bool = False  # train.max_steps ended the run before its last epoch's end
    signals: StopSignals | None = None  # SIGTERM/SIGUSR1 seen by this rank (pre-emption); None: not watched
    watchdog: Watchdog | None = None  # lost-host watchdog, told of every step (None: one rank, elastic, off)
    data_workers: Any = None  # hvtrain.data.loader.Workers of data.workers (None: none)
    manifest: Callable[[], None] | None = None  # writes manifest.json once the run trains (not for a finished one)
