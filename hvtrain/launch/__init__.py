"""Launching: hostfiles, scheduler allocations, pure argv builders, the one module that executes a
launcher, pre-emption notices passed on to the ranks, and the process facts a launcher gives a rank.

Import its modules by name: package __init__ files stay empty, so that importing one module never
imports a layer it does not need (tests/unit/test_layers.py)."""
