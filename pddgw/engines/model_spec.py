"""What a decoder checkpoint looks like, independent of its weights.

`ModelSpec` is the one description of a Llama-family decoder the engine works
with: the layer shapes, RoPE, and the token ids the tokenizer and the stop
logic need.  `from_hf_config` decodes a Hugging Face `config.json` at the edge;
everything it cannot run exactly is rejected with an error that names the key,
so a checkpoint either loads and matches `transformers`, or does not load.

Supported families and what differs between them:

  llama    optional q/k/v/o bias (`attention_bias`), RoPE scaling "llama3"
  qwen2    q/k/v bias always, o_proj never
  qwen3    per-head RMSNorm on q and k before RoPE (`qk_norm`), optional bias
  mistral  no bias; `sliding_window` (see below)
  tiny     the built-in random model (`weights.build_tiny`), a plain Llama

Sliding-window attention (Mistral, Qwen2/3 with `use_sliding_window`): a token
attends to the last `sliding_window` positions, itself included.  For contexts
no longer than the window that is exactly full causal attention, so the spec
caps `max_position_embeddings` at the window; the engine never runs past it
and the model stays exact.  Longer contexts are not supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pddgw.core.errors import check as _check

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "tiny")
HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class WeightsError(ValueError):
    """A checkpoint does not match the model its config describes."""


def quote_names(names: list[str], limit: int = 8) -> str:
    """Up to `limit` names quoted, then how many more: for errors naming tensors."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as an object; WeightsError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise WeightsError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:                       # JSONDecodeError, UnicodeDecodeError
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class UnsupportedModelError(ValueError):
    """A checkpoint's config asks for something this model cannot compute exactly."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 ("llama3") frequency scaling: long wavelengths are divided by
    `factor`, short ones are kept, the band between is interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _check(self.factor >= 1.0, "rope_scaling.factor must be >= 1")
        _check(self.high_freq_factor > self.low_freq_factor > 0,
               "rope_scaling needs high_freq_factor > low_freq_factor > 0")
        _check(self.original_max_position_embeddings > 0,
               "rope_scaling.original_max_position_embeddings must be > 0")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool       # q/k/v projections carry a bias (o_proj: see `o_proj_bias`)
    qk_norm: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        _check(self.arch in ARCHS, f"arch must be one of {ARCHS}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check(getattr(self, name) > 0, f"{name} must be > 0")
        _check(self.num_heads % self.num_kv_heads == 0,
               "num_heads must be a multiple of num_kv_heads")
        _check(self.head_dim % 2 == 0, "head_dim must be even (RoPE rotates pairs)")
        _check(self.rms_norm_eps > 0, "rms_norm_eps must be > 0")
        _check(self.rope_theta > 0, "rope_theta must be > 0")
        for t in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            _check(0 <= t < self.vocab_size, f"special token id {t} outside vocab {self.vocab_size}")

    @property
    def o_proj_bias(self) -> bool:
        # Llama and Qwen3 put `attention_bias` on all four projections; Qwen2
        # has q/k/v bias but never an o_proj bias.
        return self.attention_bias and self.arch != "qwen2"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV cache bytes one token occupies across all layers (K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelSpec:
        """Decode a Hugging Face `config.json` (transformers 4.x `rope_theta` /
        `rope_scaling` or 5.x `rope_parameters`)."""
        model_type = d.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json: unsupported model_type {model_type!r} "
                f"(supported: {', '.join(HF_MODEL_TYPES)})")

        def req(key: str) -> Any:
            if key not in d or d[key] is None:
                raise UnsupportedModelError(f"config.json: missing required key {key!r}")
            return d[key]

        def num(key: str, kind: type, default: Any = None) -> Any:
            """d[key] as an int or float (default when absent or null); the key named otherwise."""
            v = d.get(key)
            if v is None:
                return req(key) if default is None else default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
                raise WeightsError(f"config.json: {key} must be {'an integer' if kind is int else 'a number'}, "
                                   f"got {v!r}")
            return kind(v)

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"config.json: hidden_act {act!r} unsupported (only 'silu')")
        if d.get("mlp_bias"):
            raise UnsupportedModelError("config.json: mlp_bias=true is unsupported")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError("config.json: pretraining_tp != 1 is unsupported")

        hidden = num("hidden_size", int)
        heads = num("num_attention_heads", int)
        kv_heads = num("num_key_value_heads", int, heads) or heads
        head_dim = num("head_dim", int, 0) or hidden // max(heads, 1)
        num_layers = num("num_hidden_layers", int)
        max_pos = num("max_position_embeddings", int, 0) or 2048
        theta, scaling = _decode_rope(d, max_pos)

        window = _sliding_window(d, model_type, num_layers)
        if window is not None:
            max_pos = min(max_pos, window)

        if model_type == "qwen2":
            attention_bias = True
        elif model_type == "mistral":
            if d.get("attention_bias"):
                raise UnsupportedModelError("config.json: attention_bias=true is unsupported for mistral")
            attention_bias = False
        else:
            attention_bias = bool(d.get("attention_bias", False))

        vocab = num("vocab_size", int)
        bos = token_ids(d.get("bos_token_id"), "config.json: bos_token_id", vocab)
        if len(bos) > 1:
            raise WeightsError(f"config.json: bos_token_id must be one id, got {d['bos_token_id']!r}")
        return cls(
            arch=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=num("intermediate_size", int),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=num("rms_norm_eps", float, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=max_pos,
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=token_ids(d.get("eos_token_id"), "config.json: eos_token_id", vocab),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` transformers needs to build the same model."""
        model_type = "llama" if self.arch == "tiny" else self.arch
        d: dict[str, Any] = {
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM",
                               "mistral": "MistralForCausalLM"}[model_type]],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
            # Both spellings so transformers 4.x and 5.x read the same RoPE.
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        }
        if self.rope_scaling is not None:
            rs = {"rope_type": "llama3", "factor": self.rope_scaling.factor,
                  "low_freq_factor": self.rope_scaling.low_freq_factor,
                  "high_freq_factor": self.rope_scaling.high_freq_factor,
                  "original_max_position_embeddings":
                      self.rope_scaling.original_max_position_embeddings}
            d["rope_scaling"] = rs
            d["rope_parameters"] = {**rs, "rope_theta": self.rope_theta}
        if model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        if model_type == "mistral":
            d["sliding_window"] = None
        return d


def token_ids(value: Any, where: str, vocab_size: int) -> tuple[int, ...]:
    """A config's token id or list of ids (null: none) -> ids; WeightsError naming `where`
    ("FILE: KEY") when one is not an integer of the vocabulary."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise WeightsError(f"{where} must be a token id or a list of token ids, got {value!r}")
        if not 0 <= t < vocab_size:
            raise WeightsError(f"{where}: token id {t} is outside the vocabulary (vocab_size {vocab_size})")
    return tuple(dict.fromkeys(ids))


def _decode_rope(d: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise UnsupportedModelError("config.json: rope_parameters must be an object")
    if any(isinstance(v, dict) for v in rp.values()):
        raise UnsupportedModelError("config.json: per-layer-type rope_parameters are unsupported")
    theta = float(rp.get("rope_theta") or d.get("rope_theta") or 10000.0)
    prf = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise UnsupportedModelError(f"config.json: partial_rotary_factor {prf} unsupported (only 1.0)")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"config.json: rope type {rope_type!r} unsupported (supported: 'default', 'llama3')")
    try:
        scaling = RopeScaling(
            factor=float(rp["factor"]),
            low_freq_factor=float(rp["low_freq_factor"]),
            high_freq_factor=float(rp["high_freq_factor"]),
            original_max_position_embeddings=int(
                rp.get("original_max_position_embeddings") or max_pos),
        )
    except KeyError as e:
        raise UnsupportedModelError(f"config.json: llama3 rope scaling is missing {e.args[0]!r}") from None
    except ValueError as e:
        raise UnsupportedModelError(f"config.json: {e}") from None
    return theta, scaling


def _sliding_window(d: dict[str, Any], model_type: str, num_layers: int) -> int | None:
    """The window of the layers that use one, or None when every layer is full causal."""
    window = d.get("sliding_window")
    if window is None:
        return None
    if model_type in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False):
            return None
        layer_types = d.get("layer_types") or [
            "sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention"
            for i in range(num_layers)]
        if "sliding_attention" not in layer_types:
            return None
    window = int(window)
    if window <= 0:
        raise UnsupportedModelError(f"config.json: sliding_window {window} must be > 0")
    return window


def llama_spec(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
               num_heads: int, num_kv_heads: int, head_dim: int | None = None,
               max_position_embeddings: int = 2048, bos_token_id: int | None = None,
               eos_token_ids: tuple[int, ...] = ()) -> ModelSpec:
    """A plain Llama of these sizes: no bias, no q/k norm, no RoPE scaling (theta 10,000),
    untied embeddings, RMSNorm eps 1e-5 (the seeded random models benchmarks build).
    head_dim None: hidden_size / num_heads."""
    if head_dim is None:
        _check(num_heads > 0 and hidden_size % num_heads == 0, "hidden_size must be a multiple of num_heads")
        head_dim = hidden_size // num_heads
    return ModelSpec(arch="llama", vocab_size=vocab_size, hidden_size=hidden_size,
                     intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
                     max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                     eos_token_ids=eos_token_ids)


TINY = "tiny"          # model.path of the built-in random-weight model (as is an empty path)


def is_tiny(path: str | None) -> bool:
    return not path or path == TINY
