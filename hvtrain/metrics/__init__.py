"""Metrics: their names (a leaf the config validates with) and the suite, reduced across ranks from
additive statistics.

Import its modules by name: package __init__ files stay empty, so that importing one module never
imports a layer it does not need (tests/unit/test_layers.py)."""
