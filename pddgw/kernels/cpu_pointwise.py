"""bfloat16 RMSNorm and RoPE on the CPU in C passes (`cpu_pointwise.c`), torch's bits.

`rms_norm(x, w, eps)` -> transformers' bfloat16 RMSNorm; `rope(x, cos2, sin2)` -> the model's
rotate-half RoPE; each the same bits as the torch ops it replaces, or None where the kernel does
not take the inputs (not bfloat16 on the CPU, strides it does not read, no AVX-512 BF16 in this
CPU or this build, no C compiler); the model then computes it with torch ops.

Why hand-written: torch computes transformers' RMSNorm in six passes over float32 temporaries
(cast, square, mean, scale, cast back, weight) and RoPE in four bfloat16 ops; in the engine
bench's bfloat16 prefill step (4 x 256 tokens, hidden 768) they took ~13 % and ~7 % of its
time.  RMSNorm: one pass writes the squares, torch's `mean` reduces them (its summation order,
so the bits do not change), one pass scales, rounds, multiplies by the weight and rounds again;
RoPE: one pass.  `python -m pddgw.bench.prefill_ops` compares both with torch's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import structlog
import torch

from pddgw.kernels import cpu_build

__all__ = ["available", "rms_norm", "rope"]

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).with_name("cpu_pointwise.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _bind() -> ctypes.CDLL | None:
    """The library where it builds and this CPU has AVX-512 BF16; None otherwise (logged)."""
    lib = cpu_build.load_or_log(_SOURCE, "torch ops for RMSNorm and RoPE")
    if lib is None:
        return None
    lib.rms_squares.argtypes, lib.rms_squares.restype = [_P, _I, _P, _I, _I, ctypes.c_int], ctypes.c_int
    lib.rms_scale.argtypes, lib.rms_scale.restype = [_P, _I, _P, _P, _P, _I, _I, ctypes.c_int], ctypes.c_int
    lib.rope_bf16.argtypes, lib.rope_bf16.restype = [_P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int], ctypes.c_int
    if lib.rms_squares(None, 0, None, 0, 0, 1) != 0:
        log.info("no AVX-512 BF16 here: bfloat16 RMSNorm and RoPE use torch ops")
        return None
    return lib


_load = cpu_build.Once(_bind)                 # built on first use, once per process


def available() -> bool:
    """Whether bfloat16 RMSNorm and RoPE run in C here (builds the kernel on first call)."""
    return _load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [T, N] bfloat16 (rows may be strided) normalized over N in float32, rounded, times weight
    [N] -> [T, N] bfloat16, the bits of `w * (xf * rsqrt(mean(xf^2) + eps)).to(bfloat16)`; None
    where the kernel does not take the inputs (module docstring)."""
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
            or x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],)):
        return None
    lib = _load()
    if lib is None:
        return None
    t, n = x.shape
    w = weight.contiguous()
    threads = torch.get_num_threads()
    squares = torch.empty(t, n, dtype=torch.float32)                        # [T, N]
    lib.rms_squares(x.data_ptr(), x.stride(0), squares.data_ptr(), t, n, threads)
    scale = torch.rsqrt(squares.mean(-1) + eps)                             # [T], torch's sum order
    out = torch.empty(t, n, dtype=torch.bfloat16)
    lib.rms_scale(x.data_ptr(), x.stride(0), scale.data_ptr(), w.data_ptr(), out.data_ptr(), t, n, threads)
    return out


def rope(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] bfloat16 (tokens may be strided, heads packed) rotated with `model.rope_tables`'
    factors cos2 / sin2 [T, 1, D] -> [T, H, D], the bits of `x * cos2 + x.roll(D // 2, -1) * sin2`
    in bfloat16; None where the kernel does not take the inputs."""
    if (x.dtype != torch.bfloat16 or cos2.dtype != torch.bfloat16 or sin2.dtype != torch.bfloat16
            or x.device.type != "cpu" or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]
            or x.shape[2] % 2 or cos2.shape != (x.shape[0], 1, x.shape[2]) or sin2.shape != cos2.shape
            or not (cos2.is_contiguous() and sin2.is_contiguous())):
        return None
    lib = _load()
    if lib is None:
        return None
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=torch.bfloat16)
    lib.rope_bf16(x.data_ptr(), x.stride(0), cos2.data_ptr(), sin2.data_ptr(), out.data_ptr(), t, h, d,
                  torch.get_num_threads())
    return out
