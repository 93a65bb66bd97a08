"""Small helpers to carry JSON inside array dictionaries (checkpoints are safetensors only)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np


def encode_json(obj: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(obj, sort_keys=True).encode(), dtype=np.uint8).copy()


def decode_json(arr: np.ndarray) -> Any:
    return json.loads(np.asarray(arr, np.uint8).tobytes().decode())
