"""One process, every backend. MPI is initialised by mpi4py first, so neither Horovod
library owns (or finalises) it and both backends can init in this process."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402,F401

from hvtrain.backends.base import get_backend
from hvtrain.backends.registry import BACKENDS
from hvtrain.model.native import adopt_inputs, probe_batch
from hvtrain.runtime.experiment import prepare
from hvtrain.runtime.horovod import Runtime

_runtimes: dict[str, Runtime] = {}


@pytest.fixture(params=sorted(BACKENDS))
def backend_name(request):
    return request.param


def runtime_for(name: str, cfg) -> Runtime:
    """Horovod initialised once per backend (size 1)."""
    if name not in _runtimes:
        get_backend(name)  # the framework imported first, as a session does
        rt = Runtime(name)
        rt.init(cfg.horovod, elastic=False)
        _runtimes[name] = rt
    return _runtimes[name]


def make_backend(name: str, config: str, *overrides: str, weights=None):
    """A fresh backend built for `config` (size 1)."""
    p = prepare(config, backend=name, overrides=overrides)
    backend = get_backend(name)
    rt = runtime_for(name, p.cfg)
    assert rt.info.size == 1
    backend.configure(p.cfg, rt.info, None)
    if weights is None and p.spec is not None:
        weights = p.spec.init_weights(p.cfg.seed)
    example = probe_batch(p.data) if p.spec is None else None  # an entrypoint model is probed on it
    backend.build(p.cfg, p.spec, weights, p.data.num_outputs, rt, example)
    if p.spec is None:
        adopt_inputs(p.cfg, backend.native_inputs(), p.data)
    return backend, p
