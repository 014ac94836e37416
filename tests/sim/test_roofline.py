"""The roofline step model and the profiles it reads, against hand-computed numbers.

Model-side quantities (parameters, FLOPs, bytes) are written out as
integers with their arithmetic; hardware-side factors are read from the
shipped profile, so a recalibration changes no expectation here.
"""

import dataclasses

import pytest
import torch

from pddgw.engines.model_spec import ModelSpec
from pddgw.sim import profiles
from pddgw.sim.profiles import HardwareProfile, ModelProfile
from pddgw.sim.roofline import SeqWork, StepCost, max_kv_tokens, step_cost

L70 = profiles.model("llama3-70b")
H100 = profiles.hardware("H100-SXM")

# Llama-3-70B, per layer: q and o 8192 x 8192 each, k and v 8192 x 1024 each,
# SwiGLU 3 x 8192 x 28672, two RMSNorms of 8192.
LAYER_70B = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192      # 855,654,400
EMBED_70B = 128256 * 8192                                                         # 1,050,673,152
PARAMS_70B = EMBED_70B + 80 * LAYER_70B + 8192 + EMBED_70B                        # + final norm + LM head
ACTIVE_70B = PARAMS_70B - EMBED_70B                                               # no embedding lookup
WEIGHTS_70B = 2 * PARAMS_70B                                                      # bf16
KV_70B = 2 * 80 * 8 * 128 * 2                                                     # K and V, 80 layers, bf16
ATTN_70B = 4 * 80 * 64 * 128                # attention FLOPs per (new token x attended token)


def comm_s(hw: HardwareProfile, tp: int, new_tokens: int) -> float:
    """160 all-reduces of new_tokens x 8192 bf16 values, ring over tp GPUs."""
    ring = 2 * (tp - 1) / tp * (new_tokens * 8192 * 2) / (hw.interconnect_gb_s * 1e9)
    return 160 * (hw.allreduce_latency_us / 1e6 + ring)


# ---- profiles ----------------------------------------------------------------------------

def test_llama3_70b_parameters():
    assert PARAMS_70B == 70_553_706_496
    assert L70.param_count == PARAMS_70B
    assert L70.active_params_per_token == ACTIVE_70B == 69_503_033_344
    assert L70.weight_bytes == WEIGHTS_70B == 141_107_412_992


def test_kv_bytes_per_token():
    assert L70.kv_bytes_per_token == KV_70B == 327_680            # 320 KiB
    # Qwen3-32B: 64 layers x 8 KV heads x 128, K and V, bf16.
    assert profiles.model("qwen3-32b").kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 == 262_144


def test_qwen3_32b_parameters_count_qk_norms():
    # 64 query heads of 128 = 8192 wide on a 5120 residual; q/k RMSNorm of 128 each.
    attn = 5120 * 8192 + 2 * 5120 * 1024 + 8192 * 5120 + 2 * 128
    layer = attn + 3 * 5120 * 25600 + 2 * 5120
    assert profiles.model("qwen3-32b").param_count == 2 * 151936 * 5120 + 64 * layer + 5120 == 32_762_123_264


def test_tied_embeddings_and_moe_active_parameters():
    dense = ModelProfile(name="t", num_layers=2, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4,
                         intermediate_size=32, vocab_size=100, max_position_embeddings=64, eos_token_ids=(1,),
                         bos_token_id=0, arch="llama", rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=True)
    layer = 16 * (16 + 2 * 8) + 16 * 16 + 3 * 16 * 32 + 2 * 16
    assert dense.param_count == 100 * 16 + 2 * layer + 16
    assert dense.active_params_per_token == dense.param_count      # the tied table is the LM head
    moe = dataclasses.replace(dense, tie_word_embeddings=False, intermediate_size=0, num_experts=8,
                              experts_per_token=2, moe_intermediate_size=8)
    expert = 3 * 16 * 8
    moe_layer = 16 * (16 + 2 * 8) + 16 * 16 + 8 * expert + 16 * 8 + 2 * 16
    assert moe.param_count == 2 * 100 * 16 + 2 * moe_layer + 16
    assert moe.active_params_per_token == moe.param_count - 100 * 16 - 2 * 6 * expert
    # The engine's view of a MoE: its own KV layout, the expert's width as the MLP's.
    spec = moe.to_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.intermediate_size) == (2, 2, 4, 8)


def test_to_spec_round_trip():
    spec = L70.to_spec()
    assert isinstance(spec, ModelSpec)
    assert (spec.arch, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            spec.intermediate_size, spec.vocab_size) == ("llama", 80, 8192, 64, 8, 128, 28672, 128256)
    assert (spec.rope_theta, spec.rope_scaling, spec.rms_norm_eps) == (500000.0, None, 1e-5)
    assert (spec.bos_token_id, spec.eos_token_ids, spec.max_position_embeddings) == (128000, (128001,), 8192)
    assert not spec.qk_norm and not spec.attention_bias and not spec.tie_word_embeddings
    assert spec.kv_bytes_per_token(torch.bfloat16) == L70.kv_bytes_per_token
    # The spec survives the engine's own config.json round trip.
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec

    qwen = profiles.model("qwen3-32b").to_spec()
    assert (qwen.arch, qwen.qk_norm, qwen.head_dim, qwen.num_heads) == ("qwen3", True, 128, 64)
    assert (qwen.rope_theta, qwen.bos_token_id, qwen.eos_token_ids) == (1e6, 151643, (151645,))
    long = profiles.model("llama3.1-70b").to_spec()
    assert long.max_position_embeddings == 131072 and long.rope_scaling.factor == 8.0


def test_lookups_name_the_known_profiles():
    assert profiles.hardware("H200-SXM") is profiles.HARDWARE["H200-SXM"]
    assert {"H100-SXM", "H200-SXM", "A100-80G"} <= set(profiles.HARDWARE)
    assert {"llama3-70b", "qwen3-32b", "llama3-8b"} <= set(profiles.MODELS)
    with pytest.raises(KeyError, match="H100-SXM"):
        profiles.hardware("GB300")
    with pytest.raises(KeyError, match="llama3-70b"):
        profiles.model("gpt-5")


def test_profiles_validate():
    with pytest.raises(ValueError, match="compute_efficiency"):
        dataclasses.replace(H100, compute_efficiency=1.5)
    with pytest.raises(ValueError, match="num_heads"):
        dataclasses.replace(L70, num_kv_heads=7)


# ---- step cost ----------------------------------------------------------------------------

def test_decode_batch_is_memory_bound():
    # 32 sequences decode one token each at 4K context on H100 TP4.
    batch = [SeqWork(1, 4096)] * 32
    flops = 2 * ACTIVE_70B * 32 + 32 * ATTN_70B * 1 * (4096 + 1)               # 4,791,875,403,776
    nbytes = WEIGHTS_70B + 32 * (4096 + 1) * KV_70B                            # 184,067,571,712
    assert (flops, nbytes) == (4_791_875_403_776, 184_067_571_712)
    compute = flops / 4 / (H100.peak_tflops_bf16 * 1e12 * H100.compute_efficiency)
    memory = nbytes / 4 / (H100.hbm_tb_s * 1e12 * H100.bandwidth_efficiency)
    c = step_cost(L70, H100, 4, batch)
    assert c.bound == "memory"
    assert (c.flops, c.bytes) == (flops, nbytes)
    assert c.compute_s == pytest.approx(compute, rel=1e-9)
    assert c.memory_s == pytest.approx(memory, rel=1e-9)
    assert c.comm_s == pytest.approx(comm_s(H100, 4, 32), rel=1e-9)
    assert c.seconds == pytest.approx(memory + comm_s(H100, 4, 32) + H100.step_overhead_ms / 1e3, rel=1e-9)


def test_prefill_chunk_is_compute_bound():
    # One 8K-token prefill chunk with nothing cached: causal attention over the chunk.
    c = step_cost(L70, H100, 4, [SeqWork(8192, 0)])
    flops = 2 * ACTIVE_70B * 8192 + ATTN_70B * 8192 * (0 + 8193 / 2)            # 1,226,709,365,948,416
    assert flops == 1_226_709_365_948_416
    compute = flops / 4 / (H100.peak_tflops_bf16 * 1e12 * H100.compute_efficiency)
    assert c.bound == "compute"
    assert c.bytes == WEIGHTS_70B + 8192 * KV_70B == 143_791_767_552
    assert c.flops == pytest.approx(flops, rel=1e-9)
    assert c.seconds == pytest.approx(compute + comm_s(H100, 4, 8192) + H100.step_overhead_ms / 1e3, rel=1e-9)


def test_tp_communication_term():
    decode = [SeqWork(1, 100)] * 8
    assert step_cost(L70, H100, 1, decode).comm_s == 0.0
    # Bandwidth only (no per-call latency): 160 ring all-reduces of 8 x 8192 x 2 B, 2 * 7/8 of it per GPU.
    bw_only = dataclasses.replace(H100, allreduce_latency_us=0.0)
    assert step_cost(L70, bw_only, 8, decode).comm_s == pytest.approx(
        160 * (2 * 7 / 8) * 131_072 / 450e9, rel=1e-9)
    # Latency adds per call; the chunk's size changes only the bandwidth part.
    assert step_cost(L70, H100, 8, decode).comm_s == pytest.approx(comm_s(H100, 8, 8), rel=1e-9)
    assert step_cost(L70, H100, 2, [SeqWork(4096, 0)]).comm_s == pytest.approx(comm_s(H100, 2, 4096), rel=1e-9)


def test_mixed_batch_adds_up():
    # A prefill chunk resuming after 1K cached tokens, an extend of 16 and a decode.
    batch = [SeqWork(512, 1024), SeqWork(16, 3000), SeqWork(1, 70)]
    c = step_cost(L70, H100, 2, batch)
    attn = ATTN_70B * (512 * (1024 + 513 / 2) + 16 * (3000 + 17 / 2) + 1 * (70 + 1))
    assert c.flops == pytest.approx(2 * ACTIVE_70B * 529 + attn, rel=1e-9)
    assert c.bytes == WEIGHTS_70B + (1536 + 3016 + 71) * KV_70B


def test_idle_step_costs_nothing():
    zero = StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "memory")
    assert step_cost(L70, H100, 4, []) == zero
    assert step_cost(L70, H100, 4, [SeqWork(0, 500)]) == zero


def test_step_cost_rejects_bad_inputs():
    with pytest.raises(ValueError, match="tensor parallelism"):
        step_cost(L70, H100, 0, [SeqWork(1, 1)])
    with pytest.raises(ValueError, match=">= 0"):
        SeqWork(-1, 0)
    with pytest.raises(ValueError, match=">= 0"):
        SeqWork(1, -5)


# ---- KV capacity ----------------------------------------------------------------------------

def test_max_kv_tokens():
    # 4 x 80 GB x 0.9 = 288 GB, minus 141.1 GB of weights, over 320 KiB per token.
    assert max_kv_tokens(L70, H100, 4) == (288_000_000_000 - WEIGHTS_70B) // KV_70B == 448_280
    assert max_kv_tokens(L70, H100, 8, memory_utilization=0.5) == (320_000_000_000 - WEIGHTS_70B) // KV_70B


def test_max_kv_tokens_rejects():
    with pytest.raises(ValueError, match="do not fit"):
        max_kv_tokens(L70, H100, 1)          # 141 GB of weights on one 80 GB GPU
    with pytest.raises(ValueError, match="memory_utilization"):
        max_kv_tokens(L70, H100, 4, memory_utilization=0.0)
    with pytest.raises(ValueError, match="tensor parallelism"):
        max_kv_tokens(L70, H100, 0)
