"""The runtime of one process: the Horovod runtime (and each framework's Horovod binding, the only
code that calls Horovod), the knobs it reads, the experiment checked before it starts, the session
(backend + runtime + failure path), the lost-host watchdog, the manifest.

Import its modules by name: package __init__ files stay empty, so that importing one module never
imports a layer it does not need (tests/unit/test_layers.py)."""
