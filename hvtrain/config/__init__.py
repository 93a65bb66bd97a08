"""The experiment config: schema (dataclasses, ranges), YAML with line numbers, --set overrides,
validation. The lowest layer above errors and launch facts: it imports no other hvtrain layer
but the registry and metric names (leaves).

Import its modules by name (`from hvtrain.config.load import load_config`): package __init__
files stay empty so that importing one layer never drags in another."""
