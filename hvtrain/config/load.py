"""load_config: a YAML file, a mapping or a Config -> a typed, validated Config.

The raw mapping (hvtrain.config.yaml, with each key's line) is built into the schema's dataclasses
(hvtrain.config.schema) field by field: unknown keys and wrong types are errors located at
`file:line: key.path:`, never silently ignored; each numeric field's Range is checked as it is
read; then hvtrain.config.validate checks what spans several keys."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

from hvtrain.config.schema import Config, plain
from hvtrain.config.validate import validate
from hvtrain.config.yaml import apply_override, collect_keys, collect_lines, kind, parse_override, read_yaml
from hvtrain.errors import ConfigError


def load_config(source: str | Path | typing.Mapping[str, Any] | Config,
                overrides: typing.Sequence[str] = (), *, model: Any = None, data: Any = None,
                need_data: bool = True) -> Config:
    """Read, override and validate an experiment config: a YAML file, a mapping (the Python API;
    errors name `<dict>` and the key path) or a Config (copied, then overridden).

    `model` (a callable returning a native model) and `data` (arrays or a random-access object)
    come from the Python API and take the place of model.layers/entrypoint and data.dataset.
    `need_data=False` (predict: inputs come from elsewhere) accepts a config without data.

    Raises:
        ConfigError: missing file, YAML syntax, unknown key, wrong type or value; the
            message names `file:line` and the key path.
    """
    lines: dict[str, int] = {}
    if isinstance(source, Config):
        raw, name = source.to_dict(), source.source
        lines.update(source.lines)
    elif isinstance(source, typing.Mapping):
        raw, name = plain(dict(source)), "<dict>"
        collect_keys(raw, "", lines)
    else:
        raw, name = read_yaml(source), str(source)
        collect_lines(raw, "", lines)
    for text_override in overrides:
        parts, value = parse_override(text_override)
        apply_override(raw, parts, value, text_override, lines)
    cfg = Config.__new__(Config)
    cfg.source, cfg.lines = name, lines  # so that errors raised while building can locate
    built = _build(Config, raw, "", cfg)
    built.source, built.lines = name, lines
    if isinstance(source, Config):  # the Python API's objects travel with a copied Config
        built.data.provided, built.model.factory = source.data.provided, source.model.factory
    if model is not None:
        if not callable(model):
            raise ConfigError(f"model=: expected a callable returning a native model, got {type(model).__name__}")
        if built.model.layers or (built.model.entrypoint and built.model.factory is None):
            raise built.fail("model", "model= replaces the config's model.layers / model.entrypoint; remove them")
        built.model.factory = model
        built.model.entrypoint = f"python:{getattr(model, '__qualname__', type(model).__name__)}"
    if data is not None:
        if built.data.dataset is not None or built.data.entrypoint is not None:
            raise built.fail("data", "data= replaces the config's data.dataset / data.entrypoint; remove them")
        built.data.provided = data
    validate(built, need_data)
    return built


def _build(tp: Any, value: Any, path: str, cfg: Config) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path, cfg)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _build(arg, value, path, cfg)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            raise cfg.fail(path, f"expected one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise cfg.fail(path, f"expected a list, got {kind(value)} {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_build(item_tp, v, f"{path}[{i}]", cfg) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise cfg.fail(path, f"expected a mapping, got {kind(value)} {value!r}")
        return plain(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise cfg.fail(path, f"expected true or false, got {kind(value)} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise cfg.fail(path, f"expected an integer, got {kind(value)} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise cfg.fail(path, f"expected a number, got {kind(value)} {value!r}")
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise cfg.fail(path, f"expected a finite number, got an integer of {len(str(value))} digits") from None
    if tp is str:
        if not isinstance(value, str):
            raise cfg.fail(path, f"expected a string, got {kind(value)} {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")  # a bug in the schema, not input


def _build_dataclass(cls: type, value: Any, path: str, cfg: Config) -> Any:
    if not isinstance(value, dict):
        raise cfg.fail(path or "<top>", f"expected a mapping, got {kind(value)} {value!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for key in value:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            raise cfg.fail(where, f"unknown key; expected one of {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in value:
            kwargs[name] = _build(hints[name], value[name], sub, cfg)
            _check_range(f, kwargs[name], sub, cfg)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise cfg.fail(path or sub, f"missing required key {name!r}")
    return cls(**kwargs)


def _check_range(f: dataclasses.Field, value: Any, path: str, cfg: Config) -> None:
    bounds = f.metadata.get("range")
    if bounds is None or value is None:
        return
    items = [(f"{path}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(path, value)]
    for where, item in items:
        if isinstance(item, str):  # a list of names where the field also takes a number (data.features)
            continue
        problem = bounds.problem(item)
        if problem:
            raise cfg.fail(where, problem)
