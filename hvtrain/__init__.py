"""hvtrain: one experiment config, one CLI, PyTorch or TensorFlow under Horovod.

This package is the framework-neutral core: it imports no deep-learning framework
and no Horovod at module level, so `hvtrain hosts check` and `hvtrain launch
--dry-run` work on a login node that has neither.
"""

__version__ = "0.1.0"
