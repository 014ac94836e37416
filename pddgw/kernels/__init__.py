"""Attention kernels behind one interface.

`get_ops(backend, device)` returns the module (Triton or torch reference) whose
`store_kv`, `paged_decode_attention` and `extend_attention` the engine calls.
"auto" is Triton on CUDA and the torch reference elsewhere.
"""

from __future__ import annotations

from types import ModuleType

from pddgw.kernels import reference


def get_ops(backend: str = "auto", device: str = "cpu") -> ModuleType:
    if backend == "torch" or (backend == "auto" and not str(device).startswith("cuda")):
        return reference
    if backend in ("triton", "auto"):
        from pddgw.kernels import triton_ops

        return triton_ops
    raise ValueError(f"unknown attention backend {backend!r} (expected auto, triton or torch)")
