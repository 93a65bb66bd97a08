"""Sharded optimizer state in TensorFlow (train.shard_optimizer: ZeRO stage 1 on Horovod).

The same cut as torch's (backends/torch/shard.py): the trainable variables, flattened in order and
padded to a multiple of the world size, are cut into chunks of at most the Horovod fusion threshold,
each a multiple of the world size; rank r owns the r-th equal piece of every chunk, as a Keras
variable of its own, and its optimizer is built over those pieces alone (1/N of the state). Inside
the compiled step: the gradients flattened, each chunk reduce-scattered (Horovod's average), the
pieces updated, allgathered, and the model's variables assigned from them. Every optimizer hvtrain
offers is elementwise, so this is the unsharded update, element for element.

Checkpoints hold the unsharded optimizer's variables at their positions (`state_arrays`, gathered
on rank 0, which writes the checkpoint: a collective, every rank calls it), so an unsharded run
resumes them and `load_arrays` takes an unsharded run's on any world size. The positions come from
the same optimizer built over stand-ins (Keras orders slot variables by the variables it is built on).
"""

from __future__ import annotations

import re
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvtrain.backends.base import Collectives
from hvtrain.config.schema import Config
from hvtrain.io.checkpoints import decode, encode

from .ops import make_optimizer, state_bytes

PIECE, STANDIN = "hvtrain_zero_", "hvtrain_standin_"


class ShardedOptimizer:
    """The optimizer of `variables` (the model's trainable variables, in order) with state sharded
    over the ranks of `runtime` (its Horovod binding: hvtrain.runtime.tensorflow_horovod), or over
    those of a Horovod `process_set` (a pipeline stage's data-parallel replicas).

    Raises:
        ConfigError: at train.shard_optimizer, no trainable variable or several dtypes.
    """

    def __init__(self, cfg: Config, variables: list, runtime: Collectives, process_set: Any = None) -> None:
        self.runtime, self.horovod, self.process_set = runtime, runtime.horovod, process_set
        self.rank, self.size = (runtime.info.rank, runtime.info.size) if process_set is None else \
            (process_set.rank(), process_set.size())
        self.variables_of_model = variables
        size = self.size
        dtypes = sorted({str(v.dtype) for v in variables})
        if dtypes != ["float32"]:
            raise cfg.fail("train.shard_optimizer", "keeps the trainable variables in float32 pieces; "
                           + (f"the model's are {', '.join(dtypes)}" if dtypes else "the model has none"))
        constrained = [v.path for v in variables if getattr(v, "constraint", None) is not None
                       or getattr(v, "overwrite_with_gradient", False)]
        if constrained:  # the optimizer applies them to the variables it updates: here, the pieces
            raise cfg.fail("train.shard_optimizer", "updates pieces of the weights, where Keras applies no "
                           f"constraint (nor overwrite_with_gradient); {constrained[0]} has one: train this model "
                           "without sharding")
        self.shapes = [tuple(v.shape) for v in variables]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.total = sum(self.sizes)
        self.padded = -(-self.total // size) * size
        limit = (cfg.horovod.fusion_threshold_mb or 64.0) * 2**20 / 4
        step = max(size, int(limit) // size * size)
        self.chunks = [(a, min(a + step, self.padded)) for a in range(0, self.padded, step)]
        self.pieces = [keras.Variable(np.zeros((b - a) // size, np.float32), name=f"{PIECE}{j}")
                       for j, (a, b) in enumerate(self.chunks)]
        self.take_weights()
        self.optimizer = make_optimizer(cfg, self.pieces)
        standins = [keras.Variable(np.zeros(1, np.float32), name=f"{STANDIN}{i}") for i in range(len(variables))]
        self.layout = [_slot(v.path, STANDIN) for v in make_optimizer(cfg, standins).variables]

    def take_weights(self) -> None:
        """This rank's pieces from the model's variables (at build, and after they were loaded)."""
        self._assign_pieces(self.pieces, self._flat([np.asarray(v.numpy(), np.float32)
                                                     for v in self.variables_of_model]))

    def _assign_pieces(self, variables: list, flat: np.ndarray) -> None:
        for v, (a, b) in zip(variables, self.chunks, strict=True):
            n = (b - a) // self.size
            v.assign(flat[a + self.rank * n: a + (self.rank + 1) * n])

    def _flat(self, arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([a.reshape(-1) for a in arrays] + [np.zeros(self.padded - self.total, np.float32)])

    @property
    def learning_rate(self) -> Any:
        return self.optimizer.learning_rate

    def state_bytes(self) -> int:
        return state_bytes(self.optimizer)

    def apply(self, grads: list[tf.Tensor], l2: float) -> None:
        """Inside the compiled step: this rank's pieces updated from the ranks' gradients (L2 added
        to the averaged gradient, as unsharded), the model's variables assigned the new values."""
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads]
                         + ([tf.zeros([self.padded - self.total])] if self.padded > self.total else []), 0)
        piece_grads = [self.horovod.reducescatter_mean(flat[a:b], f"hvtrain.zero.g{a}", self.process_set)
                       for a, b in self.chunks]
        if l2:
            piece_grads = [g + l2 * p.value for g, p in zip(piece_grads, self.pieces, strict=True)]
        self.optimizer.apply(piece_grads, self.pieces)
        full = tf.concat([self.horovod.allgather(p, f"hvtrain.zero.p{a}", self.process_set)
                          for p, (a, _) in zip(self.pieces, self.chunks, strict=True)], 0)
        at = 0
        for v, shape, n in zip(self.variables_of_model, self.shapes, self.sizes, strict=True):
            v.assign(tf.reshape(full[at: at + n], shape))
            at += n

    # -- the unsharded optimizer's variables ------------------------------------------------------
    def _slots(self) -> dict[str, list]:
        """slot name -> its variable of each piece, in piece order; and the scalars by name."""
        out: dict[str, list] = {}
        for v in self.optimizer.variables:
            piece, slot = _slot(v.path, PIECE)
            if piece is None:
                out.setdefault(slot, []).append(v)
            else:
                out.setdefault(slot, [None] * len(self.pieces))[piece] = v
        return out

    def state_arrays(self) -> dict[str, np.ndarray]:
        """optim.<position> of the unsharded optimizer on rank 0: every rank's pieces gathered there
        (a collective: every rank calls it); nothing on the other ranks (they write no state)."""
        slots = self._slots()
        per_element = [k for k, vs in slots.items() if len(vs[0].shape)]
        blobs = self.runtime.gather_bytes(encode({f"{slot}.{j}": np.asarray(v.numpy()) for slot in per_element
                                                  for j, v in enumerate(slots[slot])}),
                                          process_set=self.process_set)
        if blobs is None:
            return {}
        shares, full = [decode(blob) for blob in blobs], {}
        for slot in per_element:
            full[slot] = np.zeros(self.padded, np.float32)
            for j, (a, b) in enumerate(self.chunks):
                n = (b - a) // self.size
                for r, share in enumerate(shares):
                    full[slot][a + r * n: a + (r + 1) * n] = share[f"{slot}.{j}"]
        offsets = np.cumsum([0, *self.sizes])
        out = {}
        for pos, (index, slot) in enumerate(self.layout):
            if index is None:
                out[f"optim.{pos}"] = np.array(slots[slot][0].numpy())
            else:
                out[f"optim.{pos}"] = full[slot][offsets[index]: offsets[index + 1]].reshape(self.shapes[index])
        return out

    def load_arrays(self, state: dict[str, np.ndarray]) -> None:
        """An unsharded optimizer's variables (this class's state_arrays, or a plain run's) cut to
        this rank's pieces; the pieces of the weights from the model's (loaded before)."""
        self.take_weights()
        slots, per_slot = self._slots(), {}
        for pos, (index, slot) in enumerate(self.layout):
            if index is None:
                slots[slot][0].assign(state[f"optim.{pos}"])
            else:
                per_slot.setdefault(slot, [None] * len(self.sizes))[index] = np.asarray(state[f"optim.{pos}"])
        for slot, arrays in per_slot.items():
            self._assign_pieces(slots[slot], self._flat(arrays))


def _slot(path: str, prefix: str) -> tuple[int | None, str]:
    """(variable index, slot name) of an optimizer variable built over variables named prefix<i>;
    (None, name) for a scalar (iteration, learning_rate)."""
    m = re.search(re.escape(prefix) + r"(\d+)_(\w+)$", path)
    return (int(m.group(1)), m.group(2)) if m else (None, path.rsplit("/", 1)[-1])
