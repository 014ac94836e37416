"""The attention core at its real precision, against hand-computed rooflines.

DeepSeek keeps attention in BF16 while the GEMMs run FP8 (DeepSeek-V3 technical report, arXiv
2412.19437, sec. 3.3.1; FlashMLA computes in BF16), so the QK^T / PV FLOPs run at the BF16
peak; DeepSeek-V4's indexer scores FP8 keys at the FP8 one.  Model numbers are written out from
the shipped config.json; hardware numbers are read from the profiles.
"""

import pytest

from pddgw.sim import profiles
from pddgw.sim.roofline import Parallel, SeqWork, decode_step_cost, step_cost
from tests.sim.v3_shape import V3_ACTIVE

V3 = profiles.model("deepseek-v3")
PRO = profiles.model("deepseek-v4-pro")
L70 = profiles.model("llama3-70b")
H100, H200 = profiles.hardware("H100-SXM"), profiles.hardware("H200-SXM")


def test_mla_prefill_core_at_the_bf16_peak():
    # One 8K-token chunk of DeepSeek-V3 on 8 x H200 (TP8): the GEMMs at 1,979 TFLOPS (FP8), the
    # causal MHA-form attention, 2 x 128 heads x (128 + 64 + 128) per pair, at 989.5 (BF16); an
    # expert-parallel (EP8) MoE prefill, so both at the MoE prefill efficiency.
    c = step_cost(V3, H200, Parallel(tp=8), [SeqWork(8192, 0)])
    gemm = 2 * V3_ACTIVE * 8192
    attn = 61 * 2 * 128 * (128 + 64 + 128) * (8192 * 8193 // 2)
    assert c.flops == pytest.approx(gemm + attn, rel=1e-12)
    assert c.compute_s == pytest.approx((gemm / 1979e12 + attn / 989.5e12) / 8 / H200.moe_prefill_efficiency,
                                        rel=1e-12)
    assert c.bound == "compute"


def test_v4_core_at_bf16_indexer_at_fp8():
    # DeepSeek-V4-Pro decodes on 16 x H200 (DP16): the same batch at 65,535 and at 4,096 cached
    # tokens differs only in attention, so the GEMMs cancel.  Per decode at position p: core
    # 2 x 128 heads x (512 + 512) per entry over 61 x 128 window + 30 x min(p // 4, 1024) CSA +
    # 31 x (p // 128) HCA entries; indexer 2 x 64 heads x 128 per CSA entry scored, 30 x p // 4.
    def core(p):
        return 262_144 * (61 * 128 + 30 * min(p // 4, 1024) + 31 * (p // 128))

    def index(p):
        return 2 * 64 * 128 * 30 * (p // 4)

    par = Parallel(tp=1, dp=16)
    long, short = (decode_step_cost(PRO, H200, par, [p] * 64) for p in (65_536, 4_097))
    assert long.flops - short.flops == pytest.approx(64 * (core(65_536) + index(65_536) - core(4_097) - index(4_097)),
                                                     rel=1e-12)
    eff = H200.moe_decode_efficiency          # an expert-parallel (EP16) MoE decode
    want = 64 * ((core(65_536) - core(4_097)) / 989.5e12 + (index(65_536) - index(4_097)) / 1979e12) / 16 / eff
    assert long.compute_s - short.compute_s == pytest.approx(want, rel=1e-9)


def test_bf16_model_unchanged_to_the_bit():
    # Llama-3-70B (BF16): GEMMs and attention at the same peak, so compute is FLOPs / peak exactly.
    for batch in ([SeqWork(2048, 0)], [SeqWork(1, 4096)] * 32, [SeqWork(512, 1000), SeqWork(1, 70)]):
        c = step_cost(L70, H100, 4, batch)
        assert c.compute_s == c.flops / 4 / (H100.peak_flops(False) * H100.compute_efficiency)
