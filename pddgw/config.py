"""config.toml -> frozen, slotted dataclasses.

Every section is a dataclass; `load_config(path)` walks the TOML tree against
the dataclass fields, so an unknown key or a value of the wrong type is a
`ConfigError` that names the file and the dotted key.  Semantic checks live in
each class's `__post_init__` and raise `ValueError`; the loader re-raises them
as `ConfigError` with the key of the section.  Defaults describe the embedded
deployment (`pddgw serve` with no config): every role in one process, the
built-in tiny model.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A config file or value is invalid; the message names file and key."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


DType = Literal["float32", "float16", "bfloat16", "float64"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights every role serves."""

    # Hugging Face-format directory (config.json, *.safetensors, tokenizer.json);
    # empty = the built-in tiny model.
    path: str = ""
    dtype: DType = "float32"
    # Seed of the built-in tiny model's weights (ignored for `path`).
    tiny_seed: int = 0
    # Cap on prompt + output tokens; 0 = the model's own max_position_embeddings.
    max_model_len: int = 0

    def __post_init__(self) -> None:
        _check(self.max_model_len >= 0, "max_model_len must be >= 0")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Paged KV pool and scheduler limits of one engine instance."""

    device: str = "cpu"
    block_size: int = 16
    # KV blocks per layer in the pool.
    num_blocks: int = 512
    max_num_seqs: int = 64
    # Tokens computed in one forward step (prefill chunks + extends + decodes).
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "triton", "torch"] = "auto"

    def __post_init__(self) -> None:
        _check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
               "block_size must be a positive power of two")
        _check(self.num_blocks > 0, "num_blocks must be > 0")
        _check(self.max_num_seqs > 0, "max_num_seqs must be > 0")
        _check(self.max_num_batched_tokens >= self.max_num_seqs,
               "max_num_batched_tokens must be >= max_num_seqs")


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    json: bool = False


@dataclass(frozen=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    log: LogConfig = field(default_factory=LogConfig)


# --------------------------------------------------------------------------
# Generic TOML -> dataclass conversion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Convert one TOML value to field type `tp`; raise ConfigError naming key."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__}")
        return build(tp, value, key)
    if origin is Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key}: {value!r} is not one of {allowed}")
        return value
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


def load_config(path: str | Path | None) -> Config:
    """Load and validate a config file; None gives the embedded default."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    try:
        return build(Config, data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
