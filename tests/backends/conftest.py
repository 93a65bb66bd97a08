"""One process, every backend. MPI is initialised by mpi4py first, so neither Horovod
library owns (or finalises) it and both backends can init in this process."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402,F401

from hvtrain.backend import BACKENDS, get_backend  # noqa: E402
from hvtrain.session import prepare  # noqa: E402

_instances = {}


@pytest.fixture(params=sorted(BACKENDS))
def backend_name(request):
    return request.param


def make_backend(name: str, config: str, *overrides: str):
    """A fresh backend built for `config` (Horovod initialised once per backend, size 1)."""
    p = prepare(config, backend=name, overrides=overrides)
    engine = get_backend(name)
    info = engine.init(p.cfg)
    assert info.size == 1
    engine.build(p.cfg, p.spec, p.spec.init_weights(p.cfg.seed) if p.spec else None, p.data.num_outputs)
    return engine, p
