"""Backend selection (pddgw.kernels.get_ops)."""

from __future__ import annotations

import pytest

import pddgw.kernels as K
from pddgw.kernels import reference


def test_torch_selects_the_reference_anywhere():
    assert K.get_ops("torch", "cpu") is reference
    assert K.get_ops("torch", "cuda:0") is reference


def test_auto_on_cuda_selects_triton():
    from pddgw.kernels import triton_ops

    assert K.get_ops("auto", "cuda") is triton_ops
    assert K.get_ops("triton", "cuda:1") is triton_ops


def test_auto_on_cuda_without_triton_falls_back(monkeypatch):
    monkeypatch.setattr(K, "triton_available", lambda: False)
    assert K.get_ops("auto", "cuda") is reference
    with pytest.raises(RuntimeError, match="needs the triton package"):
        K.get_ops("triton", "cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA"):
        K.get_ops("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.get_ops("triton", "cpu").__name__ == "pddgw.kernels.triton_ops"


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="flash"):
        K.get_ops("flash", "cpu")
