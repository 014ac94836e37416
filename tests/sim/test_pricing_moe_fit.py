"""The expert-parallel MoE terms, against hand-computed rooflines, and the rows that fixed them.

Two micro-batches (DeepSeek's inference system, SGLang's two-batch and vLLM's dual-batch overlap)
each read the weights they use; an expert-parallel MoE step computes at the part's fitted MoE
prefill or decode efficiency (pddgw/sim/profiles.py); dense and TP-only steps are as before.
DeepSeek-V3 numbers are written out from its config.json; hardware numbers from the profiles.
"""

import dataclasses
import math

import pytest

from pddgw.sim import calibration as cal
from pddgw.sim import profiles
from pddgw.sim.roofline import EP_MICRO_BATCHES, Parallel, SeqWork, distinct_experts, step_cost
from tests.sim.v3_shape import V3_EXPERT, V3_ACTIVE, V3_BPP, V3_ATTN_BYTES, V3_OTHER_BYTES

V3 = profiles.model("deepseek-v3")
L70 = profiles.model("llama3-70b")
H100, H200 = profiles.hardware("H100-SXM"), profiles.hardware("H200-SXM")


def test_the_fitted_values():
    assert EP_MICRO_BATCHES == 2
    assert (H100.moe_prefill_efficiency, H100.moe_decode_efficiency) == (0.31, 0.14)
    for name in ("H800-SXM", "H200-SXM"):                  # the same SMs and clocks
        hw = profiles.hardware(name)
        assert (hw.moe_prefill_efficiency, hw.moe_decode_efficiency) == (0.31, 0.14)
    a100 = profiles.hardware("A100-80G")                   # no MoE row: compute_efficiency
    assert a100.moe_efficiency(True) == a100.moe_efficiency(False) == a100.compute_efficiency == 0.65
    with pytest.raises(ValueError, match="moe_decode_efficiency"):
        dataclasses.replace(H100, moe_decode_efficiency=1.5)


def test_two_micro_batches_read_the_weights_twice():
    # 8 x H200, DP8 EP8, 5 decodes at 1K: micro-batches of 3 and 2 tokens, each reading all
    # attention weights on every rank, the rest once over the 8 GPUs, and the experts its own
    # tokens visit; the KV once.
    c = step_cost(V3, H200, Parallel(tp=1, dp=8), [SeqWork(1, 1024)] * 5)
    experts = 58 * (256 * (1 - (1 - 8 / 256) ** 3) + 256 * (1 - (1 - 8 / 256) ** 2)) * V3_EXPERT * V3_BPP
    kv = 5 * 1025 * V3.kv_bytes_per_token
    assert c.bytes == pytest.approx(2 * (8 * V3_ATTN_BYTES + V3_OTHER_BYTES) + experts + kv, rel=1e-9)
    per_gpu = 2 * V3_ATTN_BYTES + (2 * V3_OTHER_BYTES + experts + kv) / 8
    assert c.memory_s == pytest.approx(per_gpu / (4.8e12 * 0.8), rel=1e-9)
    # One token cannot split: one micro-batch, the weights once.
    one = step_cost(V3, H200, Parallel(tp=1, dp=8), [SeqWork(1, 1024)])
    experts1 = 58 * 8 * V3_EXPERT * V3_BPP
    assert one.bytes == pytest.approx(8 * V3_ATTN_BYTES + V3_OTHER_BYTES + experts1 + 1025 * V3.kv_bytes_per_token,
                                      rel=1e-9)


def test_tp_only_and_dense_steps_read_once_at_compute_efficiency():
    # ep = 1: the experts are tensor-parallel, no all-to-all to overlap, no micro-batches (the
    # MLA latent is replicated on each of the 8 GPUs).
    tp_only = step_cost(V3, H200, Parallel(tp=8, ep=1), [SeqWork(1, 1024)] * 4)
    experts = 58 * distinct_experts(256, 8, 4) * V3_EXPERT * V3_BPP
    kv = 8 * 4 * 1025 * V3.kv_bytes_per_token
    assert tp_only.bytes == pytest.approx(V3_ATTN_BYTES + V3_OTHER_BYTES + experts + kv, rel=1e-9)
    attn = 61 * 2 * 128 * (128 + 64 + 128) * 4 * 1025
    assert tp_only.compute_s == pytest.approx(
        (2 * V3_ACTIVE * 4 / 1979e12 + attn / 989.5e12) / 8 / H200.compute_efficiency, rel=1e-12)
    # A dense model: exactly FLOPs / peak at compute_efficiency, whatever the MoE efficiencies.
    for hw in (H100, dataclasses.replace(H100, moe_prefill_efficiency=0.0, moe_decode_efficiency=0.0)):
        for batch in ([SeqWork(2048, 0)], [SeqWork(1, 4096)] * 32):
            c = step_cost(L70, hw, 4, batch)
            assert c.compute_s == c.flops / 4 / (989.5e12 * 0.40)


def test_ep_prefill_and_decode_compute_at_their_moe_efficiencies():
    par = Parallel(tp=1, dp=32)
    # Prefill, 4 x 4K prompts per GPU on EP32 H100 (DeepSeek's profile shape): the GEMMs at the
    # FP8 peak, the attention core at the BF16 one, both x 0.31.
    pre = step_cost(V3, H100, par, [SeqWork(4096, 0)] * 128)
    attn = 128 * 61 * 2 * 128 * (128 + 64 + 128) * (4096 * 4097 // 2)
    assert pre.compute_s == pytest.approx((2 * V3_ACTIVE * 128 * 4096 / 1979e12 + attn / 989.5e12) / 32 / 0.31,
                                          rel=1e-12)
    # Decode, 128 per GPU at 4K: x 0.14.
    dec = step_cost(V3, H100, par, [SeqWork(1, 4096)] * 4096)
    attn_d = 4096 * 61 * 2 * 128 * (128 + 64 + 128) * 4097
    assert dec.compute_s == pytest.approx((2 * V3_ACTIVE * 4096 / 1979e12 + attn_d / 989.5e12) / 32 / 0.14,
                                          rel=1e-12)
    # 0 falls back to compute_efficiency: the step as before the fit.
    unfit = dataclasses.replace(H100, moe_prefill_efficiency=0.0, moe_decode_efficiency=0.0)
    assert step_cost(V3, unfit, par, [SeqWork(4096, 0)] * 128).compute_s == pytest.approx(
        pre.compute_s * 0.31 / 0.40, rel=1e-12)
    assert step_cost(V3, unfit, par, [SeqWork(1, 4096)] * 4096).compute_s == pytest.approx(
        dec.compute_s * 0.14 / 0.40, rel=1e-12)


def _ratios(hw_overrides: dict[str, float]) -> dict[str, float]:
    saved = dict(profiles.HARDWARE)
    try:
        for n in ("H100-SXM", "H800-SXM", "H200-SXM"):
            profiles.HARDWARE[n] = dataclasses.replace(saved[n], **hw_overrides)
        out = {}
        for i, m in enumerate(cal.MEASUREMENTS):
            out[f"{i} {m.engine} {m.kind}"] = cal.predict(m)[1] / cal.measured_seconds(m)
        return out
    finally:
        profiles.HARDWARE.clear()
        profiles.HARDWARE.update(saved)


def test_the_fit_rows_and_the_dense_rows():
    moe = {f"{i} {m.engine} {m.kind}": bool(cal.model_profile(m.model).num_experts)
           for i, m in enumerate(cal.MEASUREMENTS)}
    fitted, unfit = _ratios({}), _ratios({"moe_prefill_efficiency": 0.0, "moe_decode_efficiency": 0.0})
    # Dense rows: the same ratio to the bit with the MoE terms off.
    assert all(fitted[k] == unfit[k] for k, is_moe in moe.items() if not is_moe)
    # The fit rows (SGLang's and DeepSeek's profile): geometric-mean ratio 1 per kind, but for
    # rounding the values to two decimals.
    for kind in ("prefill_tok_s", "decode_tok_s"):
        rows = [fitted[k] for k in fitted if moe[k] and k.endswith(kind)
                and (" SGLang " in k or " DeepSeek profile " in k)]
        assert len(rows) == (4 if kind == "prefill_tok_s" else 2)
        assert math.exp(sum(map(math.log, rows)) / len(rows)) == pytest.approx(1.0, abs=0.03)
