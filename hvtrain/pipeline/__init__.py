"""Model parallelism, framework-neutral: the layer -> stage -> rank plan, GPipe / 1F1B schedules, and
PipelineSteps (a StepRunner driving a backend's StageEngine, exchanging tensors over MPI).

Import its modules by name: package __init__ files stay empty, so that importing one module never
imports a layer it does not need (tests/unit/test_layers.py)."""
