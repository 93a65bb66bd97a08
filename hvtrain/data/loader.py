"""Prefetch: a rank's next batches read in a background thread while the current step runs, and
(data.workers) read, decoded and augmented by worker processes of the rank."""

from __future__ import annotations

import collections
import mmap
import multiprocessing
import os
import pickle
import queue
import secrets
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import resource_tracker
from typing import Any

import numpy as np

from hvtrain.data.batches import Batch
from hvtrain.data.dataset import Split
from hvtrain.errors import DataError

_SPLIT: Split | None = None  # in a worker process: the split it reads
_MAPS: dict[str, Any] = {}  # in a worker process: the result slots it has mapped, by name
SHM = "/dev/shm"


def _start_worker(blob: bytes, parent: int) -> None:
    """A worker's start: the job's signals are its rank's to act on (a scheduler signals every
    process of the step: the rank checkpoints, then closes the pool), and it dies with its rank
    (an MPI abort or a kill skips the rank's close)."""
    global _SPLIT
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    # `parent` is the rank's pid, passed in: a worker that starts after its rank died would read 1
    def orphaned() -> None:  # not PR_SET_PDEATHSIG: that fires when the spawning *thread* ends
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, name="hvtrain-orphan-watch", daemon=True).start()
    _SPLIT = pickle.loads(blob)  # noqa: S301 - the rank's own Split, pickled by Workers below


def _features(indices: Any, epoch: int | None, slot: tuple[str, int] | None) -> Any:
    """A batch's model inputs, written into the rank's shared-memory slot when it fits (then only
    their shape and dtype travel back), else returned whole (pickled through the result pipe)."""
    x = _SPLIT.features(indices, epoch)
    if slot is None or x.nbytes > slot[1]:
        return "inline", x
    name, size = slot
    view = _MAPS.get(name)
    if view is None:
        fd = os.open(os.path.join(SHM, name), os.O_RDWR)
        try:
            view = _MAPS[name] = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    np.frombuffer(view, x.dtype, x.size).reshape(x.shape)[...] = x
    return "slot", x.shape, x.dtype.str


class _Slots:
    """A rank's shared-memory result slots (files in /dev/shm, mapped by the rank and its workers):
    a decoded batch comes back as one copy out of a slot instead of a pipe that moves 64 KB per
    wake-up of the reading thread (measured: the worker idle a third of the time at 1.7 MB a
    batch). Sized from the first batch; a batch that does not fit, a machine without /dev/shm or
    one too full to reserve a slot (posix_fallocate, so a small container's /dev/shm is an
    ENOSPC here, never a SIGBUS in a worker) come back through the pipe instead. Each slot is
    registered with multiprocessing's resource tracker, which removes it if the rank dies."""

    def __init__(self, count: int) -> None:
        self.count, self.size, self.free, self.maps = count, 0, [], {}
        self.enabled = os.path.isdir(SHM)

    def learn(self, nbytes: int, rows: int, most_rows: int) -> None:
        if self.enabled and not self.size and rows:
            self.size = -(-nbytes * most_rows // rows)

    def take(self) -> tuple[str, int] | None:
        if self.free:
            return self.free.pop()
        if not (self.enabled and self.size) or len(self.maps) >= self.count:
            return None
        name = f"hvtrain-{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(SHM, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            self.enabled = False
            return None
        try:
            os.posix_fallocate(fd, 0, self.size)
            self.maps[name] = mmap.mmap(fd, self.size)
        except OSError:
            os.unlink(path)
            self.enabled = False
            return None
        finally:
            os.close(fd)
        resource_tracker.register("/" + name, "shared_memory")
        return name, self.size

    def read(self, slot: tuple[str, int], shape: tuple[int, ...], dtype: str) -> np.ndarray:
        x = np.frombuffer(self.maps[slot[0]], np.dtype(dtype), int(np.prod(shape))).reshape(shape).copy()
        self.free.append(slot)
        return x

    def close(self) -> None:
        for name, view in self.maps.items():
            view.close()
            try:
                os.unlink(os.path.join(SHM, name))
            except FileNotFoundError:
                pass
            resource_tracker.unregister("/" + name, "shared_memory")
        self.maps, self.free = {}, []


class Workers:
    """`data.workers` processes of one rank, started (spawn: a fork after MPI and Horovod started
    their threads is unsafe) on the first batch and kept for the whole run. Each reads a whole
    batch (rows, decoding, augmentation, normalisation) into a shared-memory slot of the rank;
    batches come back in order."""

    IN_FLIGHT = 2  # batches a worker has queued or in hand (Prefetcher keeps this many per worker)

    def __init__(self, split: Split, count: int) -> None:
        self.split, self.count = split, count
        self._pool: ProcessPoolExecutor | None = None
        self._slots = _Slots(self.IN_FLIGHT * count + 1)
        self._held: dict[Future, tuple[tuple[str, int] | None, int]] = {}
        self._most_rows = 0

    def submit(self, indices: Any, epoch: int | None) -> Future:
        if self._pool is None:
            try:
                blob = pickle.dumps(self.split)
            except Exception as exc:  # noqa: BLE001 - a user's dataset object that cannot travel
                raise DataError(f"data.workers: {self.split.source.name} cannot be sent to worker processes "
                                f"({type(exc).__name__}: {exc}); set data.workers: 0") from None
            self._pool = ProcessPoolExecutor(self.count, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker, initargs=(blob, os.getpid()))
        self._most_rows = max(self._most_rows, len(indices))
        slot = self._slots.take()
        future = self._pool.submit(_features, indices, epoch, slot)
        self._held[future] = (slot, len(indices))
        return future

    def result(self, future: Future) -> Any:
        slot, rows = self._held.pop(future, (None, 0))
        try:
            got = future.result()
        except BrokenProcessPool:
            raise DataError("data.workers: a data worker process died while reading a batch (killed, out of "
                            "memory, or it could not start: a script that calls hvtrain.train with data.workers "
                            "needs an `if __name__ == \"__main__\":` guard)") from None
        except BaseException:
            if slot is not None:
                self._slots.free.append(slot)
            raise
        if got[0] == "slot":
            return self._slots.read(slot, got[1], got[2])
        if slot is not None:
            self._slots.free.append(slot)
        self._slots.learn(got[1].nbytes, rows, self._most_rows)
        return got[1]

    def release(self) -> None:
        """Give back the slots of batches submitted but never read (a prefetcher stopped mid-epoch:
        an elastic reset, a pre-emption): at once if cancelled, else when the worker is done with it."""
        held, self._held = self._held, {}
        for future, (slot, _) in held.items():
            if slot is not None:
                future.cancel()
                future.add_done_callback(lambda _f, slot=slot: self._slots.free.append(slot))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._held.clear()
        self._slots.close()


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
        window = Workers.IN_FLIGHT * self.workers.count
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
        if self.workers is not None:
            self.workers.release()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
