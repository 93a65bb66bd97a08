"""Tools on a run's outputs: predict, export, report, the scaling plan and its step measurement,
doctor. They run the model through the runtime session, never through training.

Import its modules by name: package __init__ files stay empty, so that importing one module never
imports a layer it does not need (tests/unit/test_layers.py)."""
