"""bfloat16 linear layers on the CPU's AMX tiles (`cpu_linear.c`, built by `cpu_build`).

`pack(w)` -> a `Packed` copy of a bfloat16 weight [N, K] in the tiles' order, or None where the
kernel does not take it (not bfloat16 on the CPU, N or K not a multiple of 32, no AMX-BF16 in
this CPU or this build, no C compiler); `linear(x, packed, bias, add)` computes with it.  The
model keeps oneDNN's packed GEMM where `pack` says None (model.py `pack_weight`).

Why hand-written, and its numerics: cpu_linear.c's header (measured: 1.15-1.44 x oneDNN at
decode sizes, `python -m pddgw.bench.linear`; bit-identical to oneDNN for M <= 32 and, unlike it,
batch-invariant for every M).  The call releases the GIL; its threads are torch's count.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from pddgw.kernels import cpu_build

__all__ = ["Packed", "available", "linear", "pack"]

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).with_name("cpu_linear.c")
_P = ctypes.c_void_p
_I = ctypes.c_int64
_ALIGN = 32                    # N and K: whole pairs of 16-column blocks, whole 32-value K steps

@dataclass(frozen=True, slots=True)
class Packed:
    """A weight [n, k] in cpu_linear.c's tile order (`data`: n * k bfloat16 values)."""

    data: torch.Tensor
    n: int
    k: int


def _bind() -> ctypes.CDLL | None:
    """The library where it builds and this process may use AMX tiles; None otherwise (logged)."""
    lib = cpu_build.load_or_log(_SOURCE, "oneDNN's linear layers")
    if lib is None:
        return None
    lib.linear_pack.argtypes, lib.linear_pack.restype = [_P, _I, _P, _I, _I], None
    lib.linear_bf16.argtypes = [_P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, ctypes.c_int]
    lib.linear_bf16.restype = ctypes.c_int
    if lib.linear_ready() != 1:
        log.info("no AMX-BF16 here: bfloat16 linear layers use oneDNN")
        return None
    return lib


_load = cpu_build.Once(_bind)                 # built on first use, once per process


def available() -> bool:
    """Whether bfloat16 linears run on AMX tiles here (builds the kernel on first call)."""
    return _load() is not None


def pack(w: torch.Tensor) -> Packed | None:
    """w [N, K] -> its `Packed` copy, or None where `linear` would not take it (module docstring)."""
    if (w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2 or w.shape[0] % _ALIGN
            or w.shape[1] % _ALIGN or w.stride(1) != 1):
        return None
    lib = _load()
    if lib is None:
        return None
    n, k = w.shape
    out = torch.empty(n * k, dtype=torch.bfloat16)
    lib.linear_pack(w.data_ptr(), w.stride(0), out.data_ptr(), n, k)
    return Packed(out, n, k)


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ w^T (+ bias [N]) (+ add [T, N]) -> [T, N], all bfloat16 (`add` as torch's `add + y`).

    x's rows may be strided, its columns must be packed; an `add` other than bfloat16 [T, N] with
    packed columns is added after, by torch (its type promotion)."""
    lib = _load()
    assert lib is not None, "linear() with a Packed weight from a process without the kernel"
    t, k = x.shape
    if k != packed.k or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"cpu_linear: x {tuple(x.shape)} {x.dtype} (column stride {x.stride(1)}) does not "
                         f"fit a packed [{packed.n}, {packed.k}] bfloat16 weight")
    if add is not None and (add.shape != (t, packed.n) or add.dtype != torch.bfloat16 or add.stride(1) != 1):
        return add + linear(x, packed, bias)
    y = torch.empty(t, packed.n, dtype=torch.bfloat16)
    if t == 0:
        return y
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    lib.linear_bf16(x.data_ptr(), x.stride(0), packed.data.data_ptr(),
                    None if bias is None else bias.data_ptr(), None if add is None else add.data_ptr(),
                    0 if add is None else add.stride(0), y.data_ptr(), y.stride(0), t, packed.n, k,
                    torch.get_num_threads())
    return y
