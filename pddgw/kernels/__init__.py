"""Attention kernels behind one interface, and the CPU's layer kernels.

`get_ops(backend, device)` returns the module (Triton, the CPU kernels or the torch
reference) whose `store_kv`, `paged_decode_attention` and `extend_attention` the
engine calls.  "auto" is Triton on CUDA, the CPU backend (`cpu_ops`: decode attention
in C, bfloat16 prompt rows on AMX tiles) on the CPU where its kernel builds, and the
torch reference elsewhere.  Triton is imported only when it is selected.  The CPU's
bfloat16 GEMMs on AMX tiles are `cpu_linear` (the model packs its weights for them),
its bfloat16 RMSNorm, RoPE and SiLU x up passes `cpu_pointwise`; `cpu_build` builds the C kernels.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

from pddgw.kernels import reference

BACKENDS = ("auto", "triton", "cpu", "torch")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def get_ops(backend: str = "auto", device: str = "cpu") -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (expected auto, triton, cpu or torch)")
    on_cuda = str(device).startswith("cuda")
    if backend == "cpu" or (backend == "auto" and str(device) == "cpu"):
        from pddgw.kernels import cpu_ops

        if str(device) != "cpu":
            raise RuntimeError(f"attention_backend 'cpu' runs on the CPU, not {device!r}")
        if cpu_ops.available():
            return cpu_ops
        if backend == "cpu":
            raise RuntimeError("attention_backend 'cpu': its kernel does not build here (see the log; "
                               "a C compiler with OpenMP is needed), use 'torch'")
    if backend == "torch" or (backend == "auto" and not (on_cuda and triton_available())):
        return reference
    if not triton_available():
        raise RuntimeError("attention_backend 'triton' needs the triton package")
    if not on_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(f"attention_backend 'triton' runs on CUDA devices, not {device!r} "
                           "(or under TRITON_INTERPRET=1)")
    from pddgw.kernels import triton_ops

    return triton_ops
