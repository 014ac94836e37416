"""The dtype a model's engines compute in: `model.dtype`, or for "auto" (the default) the
checkpoint's own where this machine computes it natively.

`checkpoint_dtype`: a Hugging Face directory's config.json (`torch_dtype`, or `dtype` as
newer transformers write it; float32 when it names none); a GGUF file's `general.file_type`
(F32 -> float32, F16 -> float16, BF16 -> bfloat16; a quantized file -> bfloat16, the 16-bit
type its weights were converted from and dequantize into); the built-in tiny model:
float32.

`model_dtype` ("auto"): float32 and float64 as they are.  A 16-bit checkpoint keeps its
dtype where this machine has a CUDA device; on CPU, bfloat16 where the CPU has native
bfloat16 dot products (`cpu_has_bf16`: the `avx512_bf16` or `amx_bf16` flag of Linux's
/proc/cpuinfo, which oneDNN's bfloat16 GEMMs need), float16 as bfloat16 there (as vLLM's
CPU backend does: oneDNN has no float16 GEMM for most CPUs), and float32 on any other CPU
(emulated bfloat16 is slower than float32).  An explicit `model.dtype` is never changed.

The choice is per machine: nodes of one deployment on different machines should name
`model.dtype` (the shipped multi-node config.toml does), so that every node computes alike.
"""

from __future__ import annotations

import functools
from pathlib import Path

import orjson
import torch

from pddgw.config import ModelConfig
from pddgw.engines import gguf
from pddgw.engines.model_spec import is_tiny

AUTO = "auto"
_HF_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
             "half": "float16", "float64": "float64"}
_GGUF_FLOAT = {0: "float32", 1: "float16", 32: "bfloat16"}      # llama.cpp's LlamaFileType


def checkpoint_dtype(path: str | None) -> str:
    """The dtype the checkpoint at `path` (a `model.path`) stores its weights in (module doc)."""
    if is_tiny(path):
        return "float32"
    assert path is not None
    g = gguf.resolve_gguf(path)
    if g is not None:
        return _GGUF_FLOAT.get(gguf.read_gguf(g).file_type, "bfloat16")
    try:
        config = orjson.loads((Path(path) / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return "float32"            # load_spec reports an unreadable checkpoint, naming the file
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    return _HF_NAMES.get(str(name).removeprefix("torch."), "float32")


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has native bfloat16 dot products (Linux: /proc/cpuinfo's flags)."""
    try:
        return bf16_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return False


def bf16_flags(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo text lists `avx512_bf16` or `amx_bf16` among its first CPU's flags."""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def _cuda() -> bool:
    return torch.cuda.is_available()


def model_dtype(model: ModelConfig) -> str:
    """`model.dtype`, with "auto" resolved for this machine (module docstring)."""
    return model.dtype if model.dtype != AUTO else _native(checkpoint_dtype(model.path or None))


def _native(found: str) -> str:
    """The checkpoint's dtype `found`, or what this machine computes in its place."""
    if found in ("float32", "float64") or _cuda():
        return found
    return "bfloat16" if cpu_has_bf16() else "float32"


def why(model: ModelConfig) -> str:
    """One line for the start-up log: the dtype chosen and what chose it."""
    if model.profile:
        return f"the precisions of profile {model.profile!r} (cost model)"
    if model.dtype != AUTO:
        return f"{model.dtype} (model.dtype)"
    found = checkpoint_dtype(model.path or None)
    got = _native(found)
    if got == found:
        return f"{got} (auto: the checkpoint's)"
    cpu = "native bfloat16 on this CPU" if got == "bfloat16" else "no native bfloat16 on this CPU"
    return f"{got} (auto: the checkpoint's {found}, {cpu})"
