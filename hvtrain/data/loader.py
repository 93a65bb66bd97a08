"""Prefetch: a rank's next batches read in a background thread while the current step runs, and
(data.workers) read, decoded and augmented by worker processes of the rank."""

from __future__ import annotations

import collections
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from hvtrain.data.batches import Batch
from hvtrain.data.dataset import Split
from hvtrain.errors import DataError

_SPLIT: Split | None = None  # in a worker process: the split it reads


def _start_worker(blob: bytes) -> None:
    """A worker's start: the job's signals are its rank's to act on (a scheduler signals every
    process of the step: the rank checkpoints, then closes the pool), and it dies with its rank
    (an MPI abort or a kill skips the rank's close)."""
    global _SPLIT
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    parent = os.getppid()

    def orphaned() -> None:  # not PR_SET_PDEATHSIG: that fires when the spawning *thread* ends
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, name="hvtrain-orphan-watch", daemon=True).start()
    _SPLIT = pickle.loads(blob)  # noqa: S301 - the rank's own Split, pickled by Workers below


def _features(indices: Any, epoch: int | None) -> Any:
    return _SPLIT.features(indices, epoch)


class Workers:
    """`data.workers` processes of one rank, started (spawn: a fork after MPI and Horovod started
    their threads is unsafe) on the first batch and kept for the whole run. Each reads a whole
    batch (rows, decoding, augmentation, normalisation); batches come back in order."""

    def __init__(self, split: Split, count: int) -> None:
        self.split, self.count = split, count
        self._pool: ProcessPoolExecutor | None = None

    def submit(self, indices: Any, epoch: int | None) -> Future:
        if self._pool is None:
            try:
                blob = pickle.dumps(self.split)
            except Exception as exc:  # noqa: BLE001 - a user's dataset object that cannot travel
                raise DataError(f"data.workers: {self.split.source.name} cannot be sent to worker processes "
                                f"({type(exc).__name__}: {exc}); set data.workers: 0") from None
            self._pool = ProcessPoolExecutor(self.count, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker, initargs=(blob,))
        return self._pool.submit(_features, indices, epoch)

    @staticmethod
    def result(future: Future) -> Any:
        try:
            return future.result()
        except BrokenProcessPool:
            raise DataError("data.workers: a data worker process died while reading a batch (killed, out of "
                            "memory, or it could not start: a script that calls hvtrain.train with data.workers "
                            "needs an `if __name__ == \"__main__\":` guard)") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class Prefetcher:
    """A rank's batches with their arrays, gathered `depth` batches ahead in a background thread
    (indexing, reading, normalisation, dtype) while the current step runs.

    Yields (batch, x, y); x or y is None when the rank's part of the step does not read it (a
    middle pipeline stage reads neither). An exception in the thread is raised in the training
    thread at the batch it concerns, so it ends the run like any other failure of this rank.
    `wait_seconds` is the time the training thread spent waiting for data.
    """

    def __init__(self, split: Split, batches: Iterable[Batch], depth: int, want_x: bool = True,
                 want_y: bool = True, epoch: int | None = None, workers: Workers | None = None) -> None:
        self.split, self.batches, self.depth, self.epoch = split, iter(batches), depth, epoch
        self.workers = workers if want_x else None
        self.want_x, self.want_y = want_x, want_y
        self.wait_seconds = 0.0
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._thread: threading.Thread | None = None

    def _load(self, batch: Batch) -> tuple[Batch, np.ndarray | None, np.ndarray | None]:
        x = self.split.features(batch.indices, self.epoch) if self.want_x else None
        y = self.split.y[batch.indices] if self.want_y else None
        return batch, x, y

    def _loaded(self) -> Iterator[tuple[Batch, np.ndarray | None, np.ndarray | None]]:
        """The batches with their arrays, in order: read here, or by the worker processes with
        up to two batches a worker in flight."""
        if self.workers is None:
            for batch in self.batches:
                yield self._load(batch)
            return
        pending: collections.deque = collections.deque()
        window = 2 * self.workers.count
        for batch in self.batches:
            pending.append((batch, self.workers.submit(batch.indices, self.epoch)))
            if len(pending) >= window:
                done, future = pending.popleft()
                yield done, self.workers.result(future), self.split.y[done.indices] if self.want_y else None
            if self._stop.is_set():
                return
        while pending:
            done, future = pending.popleft()
            yield done, self.workers.result(future), self.split.y[done.indices] if self.want_y else None

    def _work(self) -> None:
        try:
            for loaded in self._loaded():
                if self._stop.is_set():
                    return
                item = ("ok", loaded)
                while not self._put(item):
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread, raised there
            self._put_until_stopped(("error", exc))
            return
        self._put_until_stopped(("end", None))

    def _put(self, item: Any) -> bool:
        try:
            self._queue.put(item, timeout=0.1)
            return True
        except queue.Full:
            return False

    def _put_until_stopped(self, item: Any) -> None:
        while not self._put(item) and not self._stop.is_set():
            pass

    def __iter__(self) -> Iterator[tuple[Batch, np.ndarray | None, np.ndarray | None]]:
        if self.depth == 0:
            loaded = self._loaded()
            while True:
                t = time.perf_counter()
                item = next(loaded, None)
                self.wait_seconds += time.perf_counter() - t
                if item is None:
                    return
                yield item
        self._thread = threading.Thread(target=self._work, name="hvtrain-prefetch", daemon=True)
        self._thread.start()
        while True:
            t = time.perf_counter()
            kind, item = self._queue.get()
            self.wait_seconds += time.perf_counter() - t
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while True:  # unblock a worker waiting to put
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join()  # never two threads in a Source: evaluation reads it next

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
