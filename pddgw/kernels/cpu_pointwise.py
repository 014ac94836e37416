"""bfloat16 RMSNorm, RoPE and SiLU x up on the CPU in C passes (`cpu_pointwise.c`), torch's bits.

`rms_norm(x, w, eps)` -> transformers' bfloat16 RMSNorm; `rope(x, cos2, sin2)` -> the model's
rotate-half RoPE; `silu_mul(gate_up)` -> `F.silu(gate).mul_(up)`; each the same bits as the torch
ops it replaces, or None where the kernel does not take the inputs (not bfloat16 on the CPU,
strides it does not read, no AVX-512 BF16 in this CPU or this build, no C compiler); the model
then computes it with torch ops.

Why hand-written: torch computes transformers' RMSNorm in six passes over float32 temporaries
(cast, square, mean, scale, cast back, weight), RoPE in four bfloat16 ops and SiLU x up in two;
in the server's 512-token bfloat16 prefill steps (SmolLM2) RMSNorm, SiLU x up and RoPE took
~15, ~13 and ~4 ms of ~145.  Each is one pass here: 2-5 x torch's time, `python -m
pddgw.bench.prefill_ops`.  Same bits by construction: RMSNorm sums the squares in torch's order
(its vectorized row sum, reproduced and pinned by the tests on thousands of rows), SiLU is read
from a table of torch's own SiLU of all 65536 bfloat16 values (torch's vectorized and scalar
SiLU agree on each but NaNs' payloads), and every result is rounded as torch rounds.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from pddgw.kernels import cpu_build

__all__ = ["available", "rms_norm", "rope", "silu_mul"]

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).with_name("cpu_pointwise.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_VECTOR = 8                    # torch sums a shorter row without vectors, in another order
_SPLIT_ROW = 32768             # torch's grain size: a lone row this long may be summed by several threads


def _bind() -> ctypes.CDLL | None:
    """The library where it builds and this CPU has AVX-512 BF16; None otherwise (logged)."""
    lib = cpu_build.load_or_log(_SOURCE, "torch ops for RMSNorm, RoPE and SiLU x up")
    if lib is None:
        return None
    lib.rms_norm_bf16.argtypes = [_P, _I, _P, ctypes.c_float, _P, _I, _I, ctypes.c_int]
    lib.rms_norm_bf16.restype = ctypes.c_int
    lib.rope_bf16.argtypes, lib.rope_bf16.restype = [_P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int], ctypes.c_int
    lib.silu_mul_bf16.argtypes, lib.silu_mul_bf16.restype = [_P, _I, _P, _P, _I, _I, ctypes.c_int], ctypes.c_int
    if lib.rms_norm_bf16(None, 0, None, 0.0, None, 0, 0, 1) != 0:
        log.info("no AVX-512 BF16 here: bfloat16 RMSNorm, RoPE and SiLU x up use torch ops")
        return None
    return lib


_load = cpu_build.Once(_bind)                 # built on first use, once per process


def available() -> bool:
    """Whether the bfloat16 passes run in C here (builds the kernel on first call)."""
    return _load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [T, N] bfloat16 (rows may be strided) normalized over N in float32, rounded, times weight
    [N] -> [T, N] bfloat16, the bits of `w * (xf * rsqrt(mean(xf^2) + eps)).to(bfloat16)`; None
    where the kernel does not take the inputs (module docstring; and rows torch sums another way:
    shorter than its 8-lane vector, or of 32768 values or more, which it may split between threads)."""
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
            or x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],)
            or not _VECTOR <= x.shape[1] < _SPLIT_ROW):
        return None
    lib = _load()
    if lib is None:
        return None
    t, n = x.shape
    w = weight.contiguous()
    out = torch.empty(t, n, dtype=torch.bfloat16)
    lib.rms_norm_bf16(x.data_ptr(), x.stride(0), w.data_ptr(), eps, out.data_ptr(), t, n, torch.get_num_threads())
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


def _silu_table() -> torch.Tensor:
    """torch's bfloat16 SiLU of every bfloat16 bit pattern, indexed by it, and one spare entry
    (`silu_mul_bf16` reads 32 bits an entry): [65537] int16."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.cat((F.silu(every).view(torch.int16), torch.zeros(1, dtype=torch.int16)))


_silu = cpu_build.Once(_silu_table)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [T, 2I] bfloat16 (rows may be strided) -> [T, I] bfloat16, the bits of
    `F.silu(gate).mul_(up)` for gate, up = gate_up.chunk(2, -1); None where the kernel does not
    take the input.  SiLU is read from a table of torch's own SiLU of each of the 65536 bfloat16
    values (torch's vectorized and scalar SiLU agree on every one but NaNs' payloads), so only
    the product is computed here, rounded as torch rounds it."""
    if (gate_up.dtype != torch.bfloat16 or gate_up.device.type != "cpu" or gate_up.dim() != 2
            or gate_up.stride(1) != 1 or gate_up.shape[1] % 2):
        return None
    lib = _load()
    if lib is None:
        return None
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    table = _silu()
    out = torch.empty(t, i, dtype=torch.bfloat16)
    lib.silu_mul_bf16(gate_up.data_ptr(), gate_up.stride(0), table.data_ptr(), out.data_ptr(), t, i,
                      torch.get_num_threads())
    return out
