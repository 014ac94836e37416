"""The bfloat16 RMSNorm, RoPE and SiLU x up passes in C (pddgw/kernels/cpu_pointwise.c): the bits
of the torch formulas they replace, on any row stride and any width (vector tails included),
subnormal results included, and declining what they do not take."""

from __future__ import annotations

import pytest
import torch

from pddgw.engines import model
from pddgw.kernels import cpu_pointwise

needs_kernel = pytest.mark.skipif(not cpu_pointwise.available(),
                                  reason="no AVX-512 BF16 (or no C compiler) on this machine")


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)


def _torch_rope(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    return x * cos2 + x.roll(x.shape[-1] // 2, -1) * sin2


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("n", [576, 768, 4096, 100, 17])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_rms_norm_is_the_transformers_formula_bit_for_bit(n, t):
    # Rows of very different magnitudes, so that the float32 mean and its rsqrt vary widely.
    x = _rand(t, n, seed=n + t) * _rand(t, 1, seed=t, scale=4.0)
    w = _rand(n, seed=n)
    got = cpu_pointwise.rms_norm(x, w, 1e-5)
    assert got is not None and _same_bits(got, _hf_rms_norm(x, w, 1e-5))
    strided = torch.cat((x, x), 1)[:, 5:5 + n]                   # rows 2n apart, unaligned start
    assert _same_bits(cpu_pointwise.rms_norm(strided, w, 1e-5), _hf_rms_norm(strided, w, 1e-5))


@needs_kernel
@pytest.mark.parametrize("t,n", [(20000, 576), (3000, 4096), (1500, 8192), (4000, 100)])
def test_rms_norm_sums_the_squares_in_torchs_order(t, n):
    # A float32 sum in another order differs in its last bit on about half the rows, and shows
    # in the rounded output on ~1 row in 1,000 (4-6 rows in 4,096 for 16-lane vectors): many rows,
    # so that any other order fails.  8192 runs torch's cascade over three levels.
    x, w = _rand(t, n, seed=11), _rand(n, seed=12)
    assert _same_bits(cpu_pointwise.rms_norm(x, w, 1e-5), _hf_rms_norm(x, w, 1e-5))


@needs_kernel
def test_rms_norm_of_no_rows_and_the_models_use():
    assert cpu_pointwise.rms_norm(torch.empty(0, 64, dtype=torch.bfloat16),
                                  torch.ones(64, dtype=torch.bfloat16), 1e-6).shape == (0, 64)
    x, w = _rand(9, 64, seed=3), _rand(64, seed=4)
    assert _same_bits(model.rms_norm(x, w, 1e-6), cpu_pointwise.rms_norm(x, w, 1e-6))


def test_rms_norm_declines_what_it_does_not_take():
    x, w = _rand(4, 64, seed=0), _rand(64, seed=1)
    assert cpu_pointwise.rms_norm(x.float(), w.float(), 1e-6) is None             # float32
    assert cpu_pointwise.rms_norm(x, w.float(), 1e-6) is None                     # mixed dtypes
    assert cpu_pointwise.rms_norm(x.view(4, 2, 32), w[:32], 1e-6) is None         # 3-D (q / k norms)
    assert cpu_pointwise.rms_norm(x.t(), _rand(4, seed=2), 1e-6) is None          # columns strided
    assert cpu_pointwise.rms_norm(x, w[:32], 1e-6) is None                        # weight of another width
    assert cpu_pointwise.rms_norm(_rand(1, 32768, seed=3), _rand(32768, seed=4), 1e-6) is None   # split sums
    assert cpu_pointwise.rms_norm(x[:, :7], w[:7], 1e-6) is None                  # summed without vectors
    assert torch.equal(model.rms_norm(x[:, :7], w[:7], 1e-6), _hf_rms_norm(x[:, :7], w[:7], 1e-6))


@needs_kernel
@pytest.mark.parametrize("d", [64, 128, 80, 20])
@pytest.mark.parametrize("t,h", [(1, 1), (5, 3), (300, 16)])
def test_rope_is_the_torch_formula_bit_for_bit(d, t, h):
    x = _rand(t, h + 2, d, seed=d + t + h)[:, 1:h + 1]            # heads of a wider row, like q | k
    cos2, sin2 = model.rope_tables(_rand(t, d // 2, seed=1), _rand(t, d // 2, seed=2))
    got = cpu_pointwise.rope(x, cos2, sin2)
    assert got is not None and _same_bits(got, _torch_rope(x, cos2, sin2))
    assert _same_bits(model.rope_rotate(x, cos2, sin2), got)


def test_rope_declines_what_it_does_not_take():
    x = _rand(3, 4, 64, seed=0)
    cos2, sin2 = model.rope_tables(_rand(3, 32, seed=1), _rand(3, 32, seed=2))
    assert cpu_pointwise.rope(x.float(), cos2.float(), sin2.float()) is None      # float32
    assert cpu_pointwise.rope(x[:, ::2], cos2, sin2) is None                      # heads not packed
    assert cpu_pointwise.rope(x[:, :, :32], cos2, sin2) is None                   # factors of another width
    assert cpu_pointwise.rope(x, cos2.expand(3, 4, 64), sin2) is None             # factors per head


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return torch.nn.functional.silu(gate).mul_(up)


def _every_bfloat16() -> torch.Tensor:
    """Each of the 65536 bfloat16 bit patterns once: [65536]."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@needs_kernel
def test_silu_mul_is_torch_for_every_bfloat16_gate():
    gate = _every_bfloat16().view(64, 1024)
    up = _rand(64, 1024, seed=5, scale=4.0)
    up[0, :64] = 1.0                                  # the gate's subnormals and zeros times 1: kept
    got = cpu_pointwise.silu_mul(torch.cat((gate, up), 1))
    want = _torch_silu_mul(torch.cat((gate, up), 1))
    nan = torch.isnan(want.float())
    assert int(nan.sum()) == 255          # 254 NaN gates and -inf (-inf / inf): 0xffff both ways
    assert _same_bits(got, want)
    assert int((want.view(torch.int16)[0, :64] & 0x7F80).eq(0).sum()) == 64     # subnormals seen


@needs_kernel
@pytest.mark.parametrize("t,i", [(1, 1), (3, 37), (7, 16), (300, 1536), (0, 8)])
def test_silu_mul_of_any_width_and_row_stride(t, i):
    wide = _rand(t, 2 * i + 5, seed=t + i, scale=3.0)
    gate_up = wide[:, 1:2 * i + 1]                   # rows 2i + 5 apart, unaligned start
    got = cpu_pointwise.silu_mul(gate_up)
    assert got is not None and got.shape == (t, i) and _same_bits(got, _torch_silu_mul(gate_up))
    assert _same_bits(model.silu_mul(gate_up), got)


def test_silu_mul_declines_what_it_does_not_take():
    x = _rand(4, 64, seed=0)
    assert cpu_pointwise.silu_mul(x.float()) is None                              # float32
    assert cpu_pointwise.silu_mul(x.t()) is None                                  # columns strided
    assert cpu_pointwise.silu_mul(x[:, :63]) is None                              # odd width
    assert cpu_pointwise.silu_mul(x.view(4, 2, 32)) is None                       # 3-D
    assert _same_bits(model.silu_mul(x.float()).bfloat16(), _torch_silu_mul(x.float()).bfloat16())


@needs_kernel
def test_subnormal_results_are_rounded_as_torch_rounds():
    # The CPU's bfloat16 conversion flushes subnormals to zero; torch keeps them.
    tiny = torch.full((2, 1, 64), 2.0 ** -120).bfloat16()
    cos2, sin2 = model.rope_tables(torch.full((2, 32), 2.0 ** -10).bfloat16(),
                                   torch.full((2, 32), 2.0 ** -11).bfloat16())
    want = _torch_rope(tiny, cos2, sin2)
    assert bool((want != 0).all()) and _same_bits(cpu_pointwise.rope(tiny, cos2, sin2), want)
