"""Data: sources (arrays, .npy/.npz, shards, a user's object), readers of whole-array datasets, the
seeded split and normalisation (Dataset), batches and rank sharding, the prefetch thread, windowed
series, the shipped text corpus.

Import its modules by name: package __init__ files stay empty, so that importing one module never
imports a layer it does not need (tests/unit/test_layers.py)."""
