"""TOML -> frozen dataclasses, generically: every error is a `ConfigError` naming the key.

`build(cls, data)` walks a mapping against the dataclass fields (nested
dataclasses, Literal and Enum choices, unions, tuples, dicts, the scalars);
`load_toml(path, cls)` reads a file into it and prefixes every error with the
file.  An unknown key, a value of the wrong type or one outside its choices is
an error naming the dotted key; a section's `__post_init__` ValueError is
re-raised as a ConfigError naming that section.  Messages are stable: tests and
users match them.
"""

from __future__ import annotations

import dataclasses
import enum
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A config file or value is invalid; the message names file and key."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _choices(tp: Any) -> tuple[Any, ...]:
    """The values a Literal or an Enum type admits (() for any other type)."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tuple(m.value for m in tp)
    return ()


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Convert one TOML value to field type `tp`; raise ConfigError naming key."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__}")
        return build(tp, value, key)
    if origin is Literal or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        allowed = _choices(tp)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(repr(a) for a in allowed)}")
        return value if origin is Literal else tp(value)
    if origin in (types.UnionType, typing.Union) and all(_choices(a) for a in args):
        for arm in args:
            if value in _choices(arm):
                return _convert(arm, value, key)
        allowed = ", ".join(repr(c) for a in args for c in _choices(a))
        raise ConfigError(f"{key}: {value!r} is not one of {allowed}")
    if origin in (types.UnionType, typing.Union):
        errors = []
        for arm in args:
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _convert(arm, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} fits no allowed type")
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected an array, got {type(value).__name__}")
        item = args[0] if args else Any
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__}")
        vt = args[1] if len(args) == 2 else Any
        return {k: _convert(vt, v, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"{key}: unknown key (known keys here: {known})")
        kwargs[k] = _convert(hints[k], v, key)
    try:
        return cls(**kwargs)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix or '<top level>'}: {e}") from None


def load_toml(path: str | Path, cls: type, what: str = "config") -> Any:
    """Read a TOML file into dataclass `cls`; every error names the file (and the key)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read {what}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    try:
        return build(cls, data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
