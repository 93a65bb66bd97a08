"""The model: the layer catalogue and the neutral spec graph, a user's native model (entrypoint and
its output contract), and weight files (final.safetensors / checkpoints, the inputs record).

Import its modules by name: package __init__ files stay empty, so that importing one module never
imports a layer it does not need (tests/unit/test_layers.py)."""
