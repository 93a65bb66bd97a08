"""train.shard_optimizer with a user's native model (cold review of issue 24), one rank in process."""

from __future__ import annotations

import numpy as np
import pytest

from hvtrain.errors import ConfigError
from tests.backends.conftest import make_backend

CONFIG = """name: shard-native
seed: 4
data: {{dataset: sklearn:digits, batch_size: 32}}
model: {{input_shape: [64], entrypoint: 'tests.fixtures.user_models:{model}'}}
optimizer: {{name: adam, lr: 0.01, weight_decay: 0.01}}
train: {{epochs: 1}}
"""


def steps(backend, p, n: int = 4) -> dict[str, np.ndarray]:
    for i in range(n):
        x, y = p.data.x_train[i * 32: (i + 1) * 32], p.data.y_train[i * 32: (i + 1) * 32]
        backend.train_step(x, y, np.full(32, 1 / 32, np.float32), apply=True)
    return backend.get_weights()


def test_a_parameter_without_gradient_steps_alike_sharded_or_not_on_one_rank(tmp_path):
    """Defect: torchvision's Inception shape returns (logits, aux) in training; hvtrain trains the
    logits, so the aux head gets no gradient. A plain one-rank optimizer skipped it, Horovod's
    (N > 1 ranks) and the sharded one step it on a zero gradient, where weight decay moves it:
    Adam + L2 ended 0.03 apart after 3 steps. One rank now fills in zeros too."""
    config = tmp_path / "native.yaml"
    config.write_text("backend: torch\n" + CONFIG.format(model="torch_aux_in_training"))
    whole, p = make_backend("torch", str(config))
    sharded, _ = make_backend("torch", str(config), "train.shard_optimizer=true")
    a, b = steps(whole, p), steps(sharded, p)
    gap = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert gap <= 1e-6, gap


def test_a_keras_constraint_is_refused_with_sharding(tmp_path):
    """Defect: the sharded TensorFlow step updates stand-alone pieces and assigns the model's
    variables, which skips Keras' constraints (MaxNorm, NonNeg): trained unconstrained, silently."""
    config = tmp_path / "native.yaml"
    config.write_text("backend: tensorflow\n" + CONFIG.format(model="keras_max_norm"))
    with pytest.raises(ConfigError, match="train.shard_optimizer: .*constraint"):
        make_backend("tensorflow", str(config), "train.shard_optimizer=true")
