"""The config's YAML: a safe loader with YAML 1.2 numbers that keeps the line of every mapping key
and list item (so errors point into the file), duplicate keys refused, and `--set key.path=value`
overrides applied to the raw mapping."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from hvtrain.config.schema import parent_path
from hvtrain.errors import ConfigError


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats: `3e-4`, `1E5`, `-2.5e+3`, `-.5`.

    PyYAML resolves plain scalars by YAML 1.1, where a float needs a dot and a signed exponent,
    so `lr: 3e-4` (how nearly every ML config writes a learning rate) would be the string '3e-4'.
    The YAML 1.1 forms (`.5`, `1_000.5`, `.inf`, `.nan`) keep working; integers stay integers
    (the int resolver is consulted first); `1e` and `1.2.3` stay strings.
    """


_FLOAT_12 = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")


def _construct_int(loader: _Yaml12Loader, node: yaml.ScalarNode) -> int:
    """PyYAML's int, with Python's limit on digits (4300) a located YAML error, not a ValueError."""
    try:
        return loader.construct_yaml_int(node)
    except ValueError:
        raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(node.value)} characters is too long",
                                                node.start_mark) from None


class _LineLoader(_Yaml12Loader):
    """Records the 1-based line of each mapping key and list item."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    lines: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: mapping keys must be scalars")
        if key in out:
            raise _DuplicateKey(key, key_node.start_mark.line + 1)
        out[key] = loader.construct_object(value_node, deep=True)
        lines[key] = key_node.start_mark.line + 1
    return _LineDict(out, lines)


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> list:
    items = [loader.construct_object(child, deep=True) for child in node.value]
    return _LineList(items, [child.start_mark.line + 1 for child in node.value])


_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int):
        super().__init__(key, line)
        self.key, self.line = key, line


class _LineDict(dict):
    def __init__(self, data: dict, lines: dict):
        super().__init__(data)
        self.lines = lines


class _LineList(list):
    def __init__(self, data: list, lines: list[int]):
        super().__init__(data)
        self.lines = lines


def collect_lines(obj: Any, prefix: str, out: dict[str, int]) -> None:
    if isinstance(obj, _LineDict):
        for key, value in obj.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out[path] = obj.lines.get(key, 0)
            collect_lines(value, path, out)
    elif isinstance(obj, _LineList):
        for i, value in enumerate(obj):
            path = f"{prefix}[{i}]"
            out[path] = obj.lines[i]
            collect_lines(value, path, out)


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """Parse `key.path=value` (value as a YAML scalar/list: `3`, `true`, `[1, 2]`).

    List items are addressed by number: `model.layers.0.units=64`.
    """
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or any(not p or not _is_key(p) for p in parts):
        raise ConfigError(f"--set {text!r}: expected key.path=value, e.g. train.epochs=5")
    try:
        value = yaml.load(raw, Loader=_Yaml12Loader) if raw.strip() else ""  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({first_line(exc)})") from None
    return [int(p) if p.isdigit() else p for p in parts], value


def _is_key(part: str) -> bool:
    return all(c.isalnum() or c in "_-" for c in part)


def apply_override(raw: dict, parts: list[str | int], value: Any, text: str, lines: dict[str, int]) -> None:
    node: Any = raw
    path = ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(part, int):
            path = f"{path}[{part}]"
            if not isinstance(node, list) or part >= len(node):
                raise ConfigError(f"--set {text!r}: {path} does not exist")
        else:
            path = f"{path}.{part}" if path else part
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {parent_path(path)} is not a mapping")
        if last:
            node[part] = value
        else:
            if isinstance(part, str) and part not in node:
                node[part] = {}
                lines[path] = 0  # created by --set: errors about it point at the --set
            node = node[part]
    lines[path] = 0  # 0 = "from --set"
    for key in [k for k in lines if k.startswith(path + ".") or k.startswith(path + "[")]:
        lines[key] = 0


def read_yaml(path: str | Path) -> Any:
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    try:
        raw = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise ConfigError(f"{source}:{exc.line}: duplicate key {exc.key!r}") from None
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else 0
        raise ConfigError(f"{source}:{line}: invalid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {first_line(exc)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}:1: expected a mapping of config keys, got {kind(raw)}")
    return raw


def collect_keys(obj: Any, prefix: str, out: dict[str, int]) -> None:
    """Key paths of a plain mapping (no lines: -1, located by the source name alone)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out[path] = -1
            collect_keys(value, path, out)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out[f"{prefix}[{i}]"] = -1
            collect_keys(value, f"{prefix}[{i}]", out)


def kind(value: Any) -> str:
    for tp, name in [(bool, "a boolean"), (dict, "a mapping"), (list, "a list"), (str, "a string"),
                     (int, "an integer"), (float, "a number"), (type(None), "nothing")]:
        if isinstance(value, tp):
            return name
    return type(value).__name__


def first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
