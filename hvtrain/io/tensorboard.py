"""TensorBoard event files (rank 0, through hvtrain.io.reporter.Reporter), written with tensorboard's own
protos and record writer.

Not `tensorboard.summary.writer.event_file_writer.EventFileWriter`: it opens its file through
`tf.io.gfile`, which imports TensorFlow whenever it is installed (measured: a torch run would load
all of TensorFlow on rank 0). tensorboardX imports torch at import time, the same problem in a
TensorFlow run. `RecordWriter` (the TFRecord framing with masked CRC32C) and the `Event` /
`Summary` protos need neither framework; this module only names the file as EventFileWriter does
and writes the `brain.Event:2` header event first.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hvtrain.config.schema import Config

TB_DIR = "tensorboard"  # under output_dir
_files = itertools.count()


def available() -> bool:
    """Whether the tensorboard package is installed (found, not imported)."""
    return importlib.util.find_spec("tensorboard") is not None


def check(cfg: Config) -> None:
    """Before training: `output.tensorboard: true` written in the config needs the package.

    Raises:
        ConfigError: located at output.tensorboard.
    """
    if cfg.output.tensorboard and "output.tensorboard" in cfg.lines and not available():
        raise cfg.fail("output.tensorboard", "the tensorboard package is not installed: pip install "
                       "'hvtrain[tensorboard]' (make setup installs it), or set output.tensorboard: false")


def tag(key: str) -> str:
    """A metrics.jsonl key -> its TensorBoard tag: `val_X` -> `val/X`, `train_loss` -> `train/loss`,
    any other key K (lr, samples_per_sec, data_wait_s, world_size) -> `train/K`."""
    if key.startswith("val_"):
        return "val/" + key[len("val_"):]
    return "train/" + (key[len("train_"):] if key.startswith("train_") else key)


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl record as tags (not the epoch, which is the step; not flags,
    lists or missing values)."""
    return {tag(k): float(v) for k, v in record.items()
            if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def remove_events(directory: Path) -> None:
    """A fresh run's directory holds no earlier run's event files (as metrics.jsonl starts anew)."""
    for path in directory.glob("events.out.tfevents.*"):
        path.unlink(missing_ok=True)


class EventLog:
    """One event file; every write is flushed (a killed run keeps every epoch it reported)."""

    def __init__(self, directory: Path, restart_step: int | None = None) -> None:
        """A new event file in `directory`, its header written.

        Args:
            restart_step: a resumed run's first epoch: a SessionLog START at this step makes
                TensorBoard drop the earlier files' events from this step on (the epochs after the
                checkpoint that the resumed run writes again), as metrics.jsonl is truncated.
        """
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._pb = event_pb2
        directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads a directory's files in name order: the counter is padded, or a process's
        # 10th file (a resume in the same second as its 9th) sorted before it and its epochs lost
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_files):06d}"
        self.path = directory / name
        self._writer = RecordWriter(open(self.path, "wb"))  # noqa: SIM115 - closed by close()
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        if restart_step is not None:
            self._write(event_pb2.Event(wall_time=time.time(), step=restart_step,
                                        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto import summary_pb2

        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v)
                                             for k, v in values.items()])
        self._write(self._pb.Event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event) -> None:
        self._writer.write(event.SerializeToString())
        self._writer.flush()

    def close(self) -> None:
        if not self._writer.closed:
            self._writer.close()
