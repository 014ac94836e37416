"""The model's CPU fast paths: oneDNN-prepacked GEMM weights, the fused residual add,
RoPE in four ops, torch's rms_norm -- each against the plain formulation."""

from __future__ import annotations

import pytest
import torch

from pddgw.config import EngineConfig
from pddgw.engines.model import apply_rope, linear, pack_weight, rms_norm
from pddgw.engines.naive import naive_greedy
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.weights import build_tiny

from .conftest import req, run_to_end

needs_onednn = pytest.mark.skipif(pack_weight(torch.ones(4, 4)) is None,
                                  reason="no oneDNN float32 GEMM in this torch build")


def _logits(model, ids):
    return model.forward_dense(torch.tensor(ids))


@needs_onednn
def test_prepacked_forward_matches_plain():
    plain = build_tiny(0, torch.float32, "cpu")
    packed = build_tiny(0, torch.float32, "cpu")
    assert packed.prepack() and packed.is_prepacked and not plain.is_prepacked
    ids = list(range(40, 90))
    torch.testing.assert_close(_logits(packed, ids), _logits(plain, ids), atol=1e-4, rtol=1e-4)
    assert naive_greedy(packed, ids[:7], 20) == naive_greedy(plain, ids[:7], 20)
    packed.unpack()
    assert not packed.is_prepacked
    assert torch.equal(_logits(packed, ids), _logits(plain, ids))      # F.linear again


@needs_onednn
def test_prepack_repacks_weights_written_since():
    model = build_tiny(0, torch.float32, "cpu")
    model.prepack()
    first = model.layers[0].qkv_pk
    model.prepack()
    assert model.layers[0].qkv_pk is first                            # nothing written: kept
    with torch.no_grad():
        model.hf_tensors()["model.layers.1.mlp.down_proj.weight"].mul_(-1.0)   # in place
    model.prepack()
    assert model.layers[0].qkv_pk is first                            # untouched layer kept
    ids = list(range(60, 80))
    fresh = build_tiny(0, torch.float32, "cpu")
    with torch.no_grad():
        fresh.hf_tensors()["model.layers.1.mlp.down_proj.weight"].mul_(-1.0)
    torch.testing.assert_close(_logits(model, ids), _logits(fresh, ids), atol=1e-4, rtol=1e-4)


def test_float64_is_not_packed():
    model = build_tiny(0, torch.float64, "cpu")
    assert not model.prepack() and not model.is_prepacked


@needs_onednn
def test_cpu_engine_prepacks_and_generates_the_naive_tokens():
    model = build_tiny(0, torch.float32, "cpu")
    eng = TorchEngine(model, model.spec, EngineConfig(num_blocks=32), torch.float32)
    assert model.is_prepacked
    eng.add_request(req("r", [70, 71, 72, 73], max_tokens=12))
    assert run_to_end(eng)["r"] == naive_greedy(model, [70, 71, 72, 73], 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_residual_add_rounds_like_the_separate_add(dtype):
    g = torch.Generator().manual_seed(0)
    w, x, h, b = (torch.randn(*s, generator=g).to(dtype) for s in ((48, 32), (7, 32), (7, 48), (48,)))
    for packed in (None, pack_weight(w)):
        assert torch.equal(linear(x, w, b, packed, add=h), h + linear(x, w, b, packed))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rope_and_rms_norm_equal_the_transformers_formulas(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 20, 64, generator=g).to(dtype)[:, 2:18]        # a strided view, like q|k
    cos, sin = (torch.randn(9, 32, generator=g).to(dtype) for _ in range(2))
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    assert torch.equal(apply_rope(x, cos, sin), torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1))
    h = torch.randn(9, 64, generator=g).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    hf = h.to(acc)
    want = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(rms_norm(h, w, 1e-6), want)
