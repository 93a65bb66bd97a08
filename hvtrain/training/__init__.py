"""Training: the entry points (train, evaluate), the one loop and its records, the LR schedule,
resume decisions, the finish, the data-parallel step, the checkpoint manager, elastic training,
pre-emption signals.

Import its modules by name: package __init__ files stay empty, so that importing one module never
imports a layer it does not need (tests/unit/test_layers.py)."""
