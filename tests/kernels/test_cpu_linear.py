"""The bfloat16 linear kernel on AMX tiles (pddgw/kernels/cpu_linear.c): bit for bit oneDNN's
result at decode sizes, the same bits for a row whatever its batch, the residual and bias as
torch rounds them, interleaved with oneDNN's own AMX calls, and the model's use of it."""

from __future__ import annotations

import pytest
import torch

from pddgw.engines.model import linear, pack_weight
from pddgw.engines.weights import build_tiny
from pddgw.kernels import cpu_linear

needs_amx = pytest.mark.skipif(not cpu_linear.available(), reason="no AMX-BF16 (or no C compiler) on this machine")

# [N, K]: SmolLM2's four layer GEMMs, a Llama-3-8B-like odd pair count, the tiny model's qkv.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (224, 4096), (128, 64)]


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), b, "none", [], "")


def test_pack_declines_what_the_kernel_does_not_take():
    assert cpu_linear.pack(torch.ones(64, 64)) is None                          # float32
    assert cpu_linear.pack(torch.ones(48, 64, dtype=torch.bfloat16)) is None    # N % 32
    assert cpu_linear.pack(torch.ones(64, 48, dtype=torch.bfloat16)) is None    # K % 32
    assert cpu_linear.pack(torch.ones(64, 64, dtype=torch.bfloat16).t()) is None       # columns strided


@needs_amx
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
def test_equals_onednn_bit_for_bit_at_decode_sizes(n, k):
    w, b = _rand(n, k, seed=n + k, scale=k ** -0.5), _rand(n, seed=1)
    packed = cpu_linear.pack(w)
    assert packed is not None and (packed.n, packed.k) == (n, k)
    for m in (1, 2, 7, 16, 17, 31, 32):
        x = _rand(m, k, seed=m)
        assert torch.equal(cpu_linear.linear(x, packed), _onednn(x, w)), m
        assert torch.equal(cpu_linear.linear(x, packed, b), _onednn(x, w, b)), m


@needs_amx
def test_a_row_has_the_same_bits_in_any_batch_and_with_any_thread_count():
    n, k = 3072, 576                      # a shape where oneDNN's rows change beside more than 32
    w, x = _rand(n, k, seed=3, scale=k ** -0.5), _rand(300, k, seed=4)
    packed = cpu_linear.pack(w)
    alone = torch.cat([cpu_linear.linear(x[i:i + 1], packed) for i in range(0, 300, 37)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (33, 64, 100, 300):
                got = cpu_linear.linear(x[:m], packed)
                assert torch.equal(got[0:m:37], alone[: len(range(0, m, 37))]), (t, m)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_residual_bias_and_strided_rows_round_as_torch_does():
    n, k, m = 576, 1536, 40
    w, b = _rand(n, k, seed=5, scale=k ** -0.5), _rand(n, seed=6)
    wide, h = _rand(m, 2 * k, seed=7), _rand(m, n, seed=8)
    x = wide[:, k:]                                          # rows 2k apart, columns packed
    packed = cpu_linear.pack(w)
    plain = cpu_linear.linear(x.contiguous(), packed, b)
    assert torch.equal(cpu_linear.linear(x, packed, b), plain)
    assert torch.equal(cpu_linear.linear(x, packed, b, add=h), h + plain)
    h32 = h.float()                                          # another dtype: torch's promotion
    assert torch.equal(cpu_linear.linear(x, packed, b, add=h32), h32 + plain)
    assert cpu_linear.linear(x[:0], packed).shape == (0, n)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_linear.linear(_rand(2, 64, seed=9), packed)


@needs_amx
def test_interleaved_with_onednns_amx_calls_both_keep_their_results():
    """Tile registers are per-thread state that oneDNN's GEMMs use too (on the same OpenMP threads)."""
    w1, w2 = _rand(960, 576, seed=10, scale=0.04), _rand(576, 1536, seed=11, scale=0.03)
    x1, x2 = _rand(8, 576, seed=12), _rand(8, 1536, seed=13)
    pk1 = torch.ops.mkldnn._reorder_linear_weight(w1, None)
    before = torch.ops.mkldnn._linear_pointwise(x1, pk1, None, "none", [], "")
    packed = cpu_linear.pack(w2)
    for _ in range(3):
        mine = cpu_linear.linear(x2, packed)
        assert torch.equal(torch.ops.mkldnn._linear_pointwise(x1, pk1, None, "none", [], ""), before)
    assert torch.equal(mine, _onednn(x2, w2))


@needs_amx
def test_a_bfloat16_model_packs_for_tiles_and_keeps_oneDNN_logits():
    model = build_tiny(0, torch.bfloat16, "cpu")
    model.prepack()
    assert isinstance(model.layers[0].qkv_pk, cpu_linear.Packed) and isinstance(model.lm_head_pk, cpu_linear.Packed)
    ids = torch.tensor(list(range(40, 72)))                 # 32 rows: oneDNN's decode sizes
    tiles = model.forward_dense(ids)
    for owner, attr, w in model._packable():
        setattr(owner, attr, torch.ops.mkldnn._reorder_linear_weight(w, None))
    assert torch.equal(model.forward_dense(ids), tiles)
    w = model.layers[0].gate_up_w
    assert isinstance(pack_weight(w), cpu_linear.Packed) and not isinstance(pack_weight(w.float()), cpu_linear.Packed)
    x, h = _rand(5, 64, seed=14), _rand(5, 256, seed=15)
    assert torch.equal(linear(x, w, None, pack_weight(w), add=h), h + _onednn(x, w))
