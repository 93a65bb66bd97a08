"""Issue 21, config values and re-runs on every backend: item 16 (a killed export's leftovers) and
a seed in the config's range that crashed TensorFlow (found by the config-value property test)."""

from __future__ import annotations

import os
import subprocess

import pytest

from hvtrain.tools.export import export_model
from tests.backends.conftest import make_backend
from tests.support.configs import write_config, write_weights

MLP = "tests/configs/parity_mlp.yaml"
FORMAT = {"torch": "torchscript", "tensorflow": "savedmodel"}  # SavedModel: the partial is a directory


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_defect_16_the_next_export_removes_a_killed_exports_partial(tmp_path, backend_name):
    """Defect: a killed `hvtrain export` left `.NAME.PID.partial` (a directory for SavedModel)
    beside -o for good. The next export removes a dead process's, as predict does its .tmp files;
    a live process's stays (another export writing now)."""
    cfg = write_config(tmp_path)
    weights = write_weights(tmp_path, cfg)
    fmt = FORMAT[backend_name]
    out = tmp_path / "models" / "m.export"
    out.parent.mkdir()
    dead = out.with_name(f".{out.name}.{_dead_pid()}.partial")
    live = out.with_name(f".{out.name}.{os.getppid()}.partial")
    for partial in (dead, live):
        if fmt == "savedmodel":
            (partial / "variables").mkdir(parents=True)
            (partial / "saved_model.pb").write_bytes(b"half written")
        else:
            partial.write_bytes(b"half written")
    result = export_model(str(cfg), str(weights), fmt, str(out), backend=backend_name)
    assert result["path"] == str(out) and out.exists()
    assert not dead.exists()
    assert live.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, live.name])


@pytest.mark.parametrize("seed", [542363, 20240101, 2**32 - 1])
def test_a_seed_in_the_configs_range_configures_every_backend(backend_name, seed):
    """Defect (found by tests/unit/test_config_values_property.py): TensorFlow seeded Keras with
    seed * 7919 + rank, and numpy's legacy generator (which Keras seeds) takes < 2**32: any seed of
    542363 or more (`seed: 20240101`) raised ValueError after Horovod had started; torch trained."""
    backend, p = make_backend(backend_name, MLP, f"seed={seed}")
    assert p.cfg.seed == seed
    x, y = p.data.x_train[:8], p.data.y_train[:8]
    import numpy as np

    assert backend.train_step(x, y, np.full(8, 1 / 8, np.float32), apply=True)
