"""Files and output: the Reporter (every print and file write, gated on rank 0 in one place),
TensorBoard event files, checkpoint files, JSON state inside arrays.

Import its modules by name: package __init__ files stay empty, so that importing one module never
imports a layer it does not need (tests/unit/test_layers.py)."""
