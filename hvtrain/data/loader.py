"""Prefetch: a rank's next batches read in a background thread while the current step runs."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from hvtrain.data.batches import Batch
from hvtrain.data.dataset import Split


class Prefetcher:
    """A rank's batches with their arrays, gathered `depth` batches ahead in a background thread
    (indexing, reading, normalisation, dtype) while the current step runs.

    Yields (batch, x, y); x or y is None when the rank's part of the step does not read it (a
    middle pipeline stage reads neither). An exception in the thread is raised in the training
    thread at the batch it concerns, so it ends the run like any other failure of this rank.
    `wait_seconds` is the time the training thread spent waiting for data.
    """

    def __init__(self, split: Split, batches: Iterable[Batch], depth: int, want_x: bool = True,
                 want_y: bool = True) -> None:
        self.split, self.batches, self.depth = split, iter(batches), depth
        self.want_x, self.want_y = want_x, want_y
        self.wait_seconds = 0.0
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._thread: threading.Thread | None = None

    def _load(self, batch: Batch) -> tuple[Batch, np.ndarray | None, np.ndarray | None]:
        x = self.split.features(batch.indices) if self.want_x else None
        y = self.split.y[batch.indices] if self.want_y else None
        return batch, x, y

    def _work(self) -> None:
        try:
            for batch in self.batches:
                if self._stop.is_set():
                    return
                item = ("ok", self._load(batch))
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
            for batch in self.batches:
                t = time.perf_counter()
                item = self._load(batch)
                self.wait_seconds += time.perf_counter() - t
                yield item
            return
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
