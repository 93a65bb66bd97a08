"""Counter-based draws: a random number is a function of (seed, epoch, sample, site), never the next
value of a per-process stream (STYLE.md 21), so a sample's draws do not depend on the batch it travels
in, the rank that computes it, the world size or a resume.

Two users, one key:

- augmentation (hvtrain.data.augment): `uniforms`, float64 draws in numpy;
- the catalogue's random layers under `train.randomness: per_sample` (dropout, attention dropout):
  `dropout_keys` gives each sample two 32-bit words, and each backend (backends/<fw>/draws.py) hashes
  them with the layer and the element's position into a keep/drop decision, with int64 tensor ops that
  compute exactly `keep_mask` below (the numpy reference the conformance test compares both to). A
  sample is drawn once an epoch, so (epoch, sample) names its draw on any batch size too.
"""

from __future__ import annotations

import numpy as np

AUGMENT_KEY = 0xA067
DROPOUT_KEY = 0xD209

_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1

# The 32-bit finaliser of the tensor side (hash-prospector's 16/0x21f0aaad/15/0x735a2d97/15, bias
# 0.021): both multipliers are below 2**31, so a 32-bit value times one stays below 2**63 and int64
# tensor arithmetic (all torch and TF have for every op used) computes it without overflow.
MIX32_A, MIX32_B = 0x21F0AAAD, 0x735A2D97
GOLDEN32, LAYER32 = 0x9E3779B9, 0x27D4EB2F
M32 = 0xFFFFFFFF


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (a bijection of uint64 with full avalanche), elementwise."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def sample_keys(seed: int, epoch: int, samples: np.ndarray, domain: int) -> np.ndarray:
    """One uint64 key per sample: a hash of (seed, domain, epoch, sample index) alone."""
    with np.errstate(over="ignore"):
        key = mix64(np.array([(int(seed) ^ (domain << 32)) & _MASK], np.uint64) + _GOLDEN)
        key = mix64(key + np.uint64(int(epoch) & _MASK) * _GOLDEN)
        return mix64(key + np.asarray(samples, np.int64).astype(np.uint64) * _GOLDEN)


def uniforms(seed: int, epoch: int, samples: np.ndarray, count: int, domain: int = AUGMENT_KEY) -> np.ndarray:
    """(len(samples), count) float64 draws in [0, 1); draw j of sample s a hash of (seed, epoch, s, j)."""
    with np.errstate(over="ignore"):
        per = sample_keys(seed, epoch, samples, domain)[:, None]
        z = mix64(per + (np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN)[None, :])
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def dropout_keys(seed: int, epoch: int, samples: np.ndarray) -> np.ndarray:
    """int64 [n, 2]: the two 32-bit words of each sample's dropout key (what the backends hash)."""
    k = sample_keys(seed, epoch, samples, DROPOUT_KEY)
    return np.stack([k & np.uint64(M32), k >> np.uint64(32)], axis=1).astype(np.int64)


def drop_threshold(rate: float) -> int:
    """An element is dropped when its 32-bit hash is below this: P(drop) = rate to 2**-32."""
    return int(rate * 2 ** 32)


def mix32(x: np.ndarray) -> np.ndarray:
    """The backends' 32-bit finaliser on int64 values in [0, 2**32), in numpy (the reference)."""
    x = x ^ (x >> 16)
    x = (x * MIX32_A) & M32
    x = x ^ (x >> 15)
    x = (x * MIX32_B) & M32
    return x ^ (x >> 15)


def element_salts(layer: int, n: int) -> np.ndarray:
    """int64 [n]: the hash of each element position of a sample's activation in layer `layer`."""
    return mix32((np.arange(n, dtype=np.int64) * GOLDEN32 + (layer + 1) * LAYER32) & M32)


def keep_mask(keys: np.ndarray, layer: int, shape: tuple[int, ...], rate: float) -> np.ndarray:
    """bool [n, *shape]: which elements of `layer`'s per-sample activations of `shape` a dropout of
    `rate` keeps, for the samples whose keys are `keys` (dropout_keys). What both backends compute."""
    n = int(np.prod(shape, dtype=np.int64))
    salts = element_salts(layer, n)[None, :]
    h = mix32(mix32(keys[:, :1] ^ salts) ^ keys[:, 1:2])
    return (h >= drop_threshold(rate)).reshape((len(keys), *shape))
