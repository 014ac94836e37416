"""MoE, latent (MLA) and DeepSeek-V4 compressed attention in the cost model, against hand computations.

Model-side numbers are written out from each shipped config.json (the values
quoted in the comments are the file's keys); hardware factors are read from
the profiles, so a recalibration changes no expectation here.
"""

import dataclasses
import json
import random

import pytest

from pddgw.config import ConfigError, CostModelConfig, EngineConfig
from pddgw.sim import profiles
from pddgw.sim.costmodel_engine import CostModelEngine
from pddgw.sim.hf_config import FP4_BYTES_PER_PARAM, ModelConfigError, load_profile
from pddgw.sim.roofline import Parallel, SeqWork, distinct_experts, max_kv_tokens, memory_fit, step_cost
from tests.sim.v3_shape import V3_PARAMS, V3_ACTIVE, V3_BPP, V3_EXPERT_BYTES, V3_DENSE_BYTES

V3 = profiles.model("deepseek-v3")
PRO = profiles.model("deepseek-v4-pro")
FLASH = profiles.model("deepseek-v4-flash")
H100, H200, A100 = (profiles.hardware(n) for n in ("H100-SXM", "H200-SXM", "A100-80G"))


def test_distinct_experts_formula():
    # One token visits exactly its k experts; none visit none; many visit them all.
    assert distinct_experts(256, 8, 1) == pytest.approx(8.0, rel=1e-12)
    assert distinct_experts(256, 8, 0) == 0.0
    assert distinct_experts(256, 8, 10_000) == pytest.approx(256.0, rel=1e-12)
    # E = 8, k = 2, T = 2: 8 * (1 - 0.75^2) = 3.5 (by inclusion-exclusion: 2 + 2 - 2 * 2/8 * ... = 3.5).
    assert distinct_experts(8, 2, 2) == pytest.approx(3.5, rel=1e-12)
    # Monotone and below both T * k and E.
    seq = [distinct_experts(384, 6, t) for t in (1, 2, 8, 64, 512)]
    assert seq == sorted(seq) and all(d <= min(384, t * 6) for d, t in zip(seq, (1, 2, 8, 64, 512)))


def test_deepseek_v3_parameters_and_weights():
    assert V3_PARAMS == 671_026_404_352            # DeepSeek reports 671B total ...
    assert V3.param_count == V3_PARAMS
    assert V3.active_params_per_token == V3_ACTIVE == 36_625_603_584     # ... and 37B activated
    assert V3.expert_bytes == pytest.approx(V3_EXPERT_BYTES, rel=1e-12) and V3_EXPERT_BYTES == 44_050_944
    assert V3.weight_bytes == round(V3_PARAMS * V3_BPP)
    assert V3.fp8_compute and V3.num_moe_layers == 58


@pytest.mark.parametrize("name, per_token", [
    ("deepseek-v3", 61 * (512 + 64) * 2),            # MLA latent + RoPE key, BF16: 70,272
    ("kimi-k2", 61 * (512 + 64) * 2),
    ("qwen3-235b-a22b", 94 * 2 * 4 * 128 * 2),       # GQA: 94 layers x K,V x 4 heads x 128, BF16: 192,512
    ("llama3.1-70b", 80 * 2 * 8 * 128 * 2),
])
def test_kv_bytes_per_request_linear_profiles(name, per_token):
    m = profiles.model(name)
    assert m.kv_bytes_per_token == per_token
    assert [m.kv_bytes(t) for t in (1, 1000, 65536)] == [per_token, 1000 * per_token, 65536 * per_token]
    # The engine's KV layout carries the same bytes per token (links charge by it).
    layers, heads, dim = m.wire_kv_layout
    assert layers * 2 * heads * dim * 2 == per_token


def test_mla_fp8_kv_is_flashmla_layout():
    fp8 = load_profile("deepseek-v3", kv_dtype="fp8")
    # 512 FP8 latent values + 4 float32 scales + 64 BF16 RoPE values = 656 bytes per layer.
    assert fp8.kv_entry_bytes == 656 and fp8.kv_bytes(100) == 100 * 61 * 656
    assert fp8.wire_kv_layout == (61, 1, 164)


def v4_kv(layers, csa, hca, tokens, entry=584, index=132, window=128):
    """Every layer's window, CSA: one entry + indexer key per 4 tokens, HCA: one entry per 128."""
    return layers * min(tokens, window) * entry + csa * (tokens // 4) * (entry + index) + hca * (tokens // 128) * entry


def test_deepseek_v4_kv_is_a_function_of_length():
    # Pro: 61 layers, compress_ratios (128, 128) + (4, 128) x 29 + (4,): 30 CSA, 31 HCA; window 128;
    # FP8 entries 448 + 2 x 64 + 8 = 584 bytes, indexer keys 128 + 4 = 132 bytes.
    assert sum(r == 4 for r in PRO.compress_ratios) == 30 and sum(r == 128 for r in PRO.compress_ratios) == 31
    assert (PRO.kv_entry_bytes, PRO.kv_window_bytes) == (584, 61 * 128 * 584)
    for t in (1, 100, 127, 128, 129, 4096, 65536):
        assert PRO.kv_bytes(t) == v4_kv(61, 30, 31, t)
    assert PRO.kv_bytes(65536) == 4_559_872 + 351_928_320 + 9_269_248 == 365_757_440
    # The 80 x 64K figure (often quoted as ~23 GB, docs/architecture.md): 29.26 GB with the indexer keys and windows.
    assert 80 * PRO.kv_bytes(65536) == 29_260_595_200
    # Without them (latent entries alone) it is the seed's number.
    assert 80 * 65536 * (30 * 584 / 4 + 31 * 584 / 128) == pytest.approx(23.7e9, rel=2e-3)
    assert PRO.kv_bytes_per_token == pytest.approx(30 * 716 / 4 + 31 * 584 / 128, rel=1e-12)   # 5511.4375
    # Flash: 43 layers, (0, 0) + (4, 128) x 20 + (4,): 2 window-only, 21 CSA, 20 HCA.
    assert FLASH.kv_bytes(65536) == v4_kv(43, 21, 20, 65536) == 255_544_320
    # BF16 KV: 1024-byte entries, 256-byte indexer keys.
    bf16 = load_profile("deepseek-v4-pro", kv_dtype="bf16")
    assert bf16.kv_bytes(4096) == v4_kv(61, 30, 31, 4096, entry=1024, index=256)


def test_v4_weights_fp4_experts_and_parameters():
    # Pro: 384 experts of 3 x 7168 x 3072 in each of 61 layers at MXFP4, the rest FP8 + UE8M0 block scales.
    expert = 3 * 7168 * 3072
    assert PRO.routed_expert_params == 61 * 384 * expert == 1_547_396_186_112
    assert PRO.expert_bytes == pytest.approx(expert * FP4_BYTES_PER_PARAM, rel=1e-12)
    assert FP4_BYTES_PER_PARAM == 0.53125
    rest = PRO.param_count - PRO.routed_expert_params
    assert PRO.weight_bytes == round(rest * (1 + 1 / 16384) + 61 * 384 * expert * 0.53125)
    # ~1.6T parameters, ~49B active (DeepSeek's figures); 847 GB of weights (the released
    # checkpoint's 893 GB adds the MTP layer, the compressors and BF16 tensors).
    assert 1.55e12 < PRO.param_count < 1.6e12 and 47e9 < PRO.active_params_per_token < 50e9
    assert 840e9 < PRO.weight_bytes < 893e9


def test_v4_attention_flops_hand_computed():
    # One decode at position 65536 (65535 cached): per layer the 128-token window, CSA top-1024 of
    # 16384 entries plus the indexer scoring all 16384 (64 heads x 128), HCA all 512 entries;
    # each entry costs 2 x 128 heads x (512 + 512).
    entries = 61 * 128 + 30 * 1024 + 31 * 512
    indexer = 30 * 16384 * 2 * 64 * 128
    assert PRO.attention_flops(65535, 1) == 262_144 * entries + indexer
    # A chunk sums per-query: 8 queries at positions 1..8 see 1..8 window tokens and
    # floor(q / 4) = 0,0,0,1,1,1,1,2 CSA entries (all selected), no HCA entry.
    csa = 0 + 0 + 0 + 1 + 1 + 1 + 1 + 2
    assert PRO.attention_flops(0, 8) == 262_144 * (61 * 36 + 30 * csa) + 30 * csa * 2 * 64 * 128
    # It equals the sum of its single-token steps (same FLOPs, any chunking).
    assert PRO.attention_flops(1000, 300) == sum(PRO.attention_flops(1000 + i, 1) for i in range(300))


def test_mla_decode_step_hand_roofline():
    # 32 decodes at 4K context, DeepSeek-V3 on 8 x H200 (TP 8, experts over all 8 GPUs).
    batch = [SeqWork(1, 4096)] * 32
    par = Parallel(tp=8)
    c = step_cost(V3, H200, par, batch)
    attn = 61 * 2 * 128 * (128 + 64 + 128) * 32 * (4096 + 1)          # MHA-form QK and PV
    flops = 2 * V3_ACTIVE * 32 + attn
    assert c.flops == pytest.approx(flops, rel=1e-12)
    # Expert-parallel: two micro-batches of 16, each reading the dense weights and its experts.
    distinct = 256 * (1 - (1 - 8 / 256) ** 16)                         # ~104.6 experts per layer each
    experts = 2 * 58 * distinct * V3_EXPERT_BYTES
    kv = 32 * 4097 * 70272                                             # the latent is replicated on all 8
    per_gpu = 2 * V3_DENSE_BYTES / 8 + experts / 8 + kv
    assert c.memory_s == pytest.approx(per_gpu / (4.8e12 * H200.bandwidth_efficiency), rel=1e-9)
    # FP8 weights use the FP8 tensor-core peak, the attention core the BF16 one, both at the MoE
    # decode efficiency.
    assert c.compute_s == pytest.approx(
        (2 * V3_ACTIVE * 32 / 1979e12 + attn / 989.5e12) / 8 / H200.moe_decode_efficiency, rel=1e-9)
    # TP all-reduce after attention in all 61 layers and after the MLP in the 3 dense ones; EP
    # all-to-all in the 58 MoE layers: 4 tokens a GPU x 8 experts x 7168 x (1 + 2) B, 7/8 leaving
    # it, hidden behind the step's bytes but for its two latencies (tests/sim/test_pricing_overlap.py).
    ar = H200.allreduce_latency_us / 1e6 + 2 * 7 / 8 * 32 * 7168 * 2 / 450e9
    a2a_wire = (4 * 8 * 7168 * 3 * 7 / 8) / 450e9
    assert 58 * a2a_wire < c.memory_s
    assert c.comm_s == pytest.approx(64 * ar + 58 * 2 * H200.allreduce_latency_us / 1e6, rel=1e-9)
    assert c.bound == "memory"
    assert c.seconds == pytest.approx(c.memory_s + c.comm_s + H200.step_overhead_ms / 1e3, rel=1e-12)


def test_v4_pro_across_two_nodes_dp_attention():
    # V4-Pro does not fit one 8 x H100 node at FP8 / FP4 (847 GB of weights > 8 x 72 GB) ...
    with pytest.raises(ValueError, match=r"deepseek-v4-pro weights \(846\.\d GB.*8 x H100-SXM.*72\.0 GB"):
        max_kv_tokens(PRO, H100, Parallel(tp=1, dp=8))
    # ... it fits two: DP-attention 16 ranks of 1 GPU (each holding all attention layers), the
    # embedding, LM head, shared experts and routed experts over all 16; the MTP layer's split
    # the same way (tests/sim/test_pricing_mtp.py).
    par = Parallel(tp=1, dp=16)
    fit = memory_fit(PRO, H100, par, 0.9, max_seqs=64)
    attn = PRO.attention_weight_bytes
    shared = PRO.dense_weight_bytes - attn
    mtp_attn = PRO.mtp_attention_weight_bytes
    weights = attn + mtp_attn + (shared + 61 * 384 * PRO.expert_bytes + PRO.mtp_weight_bytes - mtp_attn) / 16
    assert fit.weights_gb == pytest.approx(weights / 1e9, rel=1e-12)
    free = 72e9 - weights
    assert fit.kv_tokens == int((free - 4 * PRO.kv_window_bytes) // PRO.kv_bytes_per_token) * 16
    # A decode step of 64 sequences at 64K: the all-to-all crosses nodes, 8/16 of it over the NICs.
    batch = [SeqWork(1, 65535)] * 64
    c = step_cost(PRO, H100, par, batch)
    per_gpu = 64 / 16 * 6 * 7168 * 3
    a2a_wire = max(per_gpu * 7 / 16 / 450e9, per_gpu * 8 / 16 / 50e9)
    assert 61 * a2a_wire < c.memory_s                               # hidden but for the latencies
    assert c.comm_s == pytest.approx(61 * 2 * H100.allreduce_latency_us / 1e6, rel=1e-9)   # tp = 1: no all-reduce
    kv = 64 * (61 * 128 * 584 + 30 * (16384 * 132 + 1024 * 584) + 31 * 512 * 584)
    # Two micro-batches of 32, each reading the attention and shared weights and its experts.
    experts = 2 * 61 * distinct_experts(384, 6, 32) * PRO.expert_bytes
    assert c.memory_s == pytest.approx(
        (2 * attn + (2 * shared + experts + kv) / 16) / (3.35e12 * H100.bandwidth_efficiency), rel=1e-9)
    assert c.flops == pytest.approx(2 * PRO.active_params_per_token * 64 + 64 * PRO.attention_flops(65535, 1),
                                    rel=1e-12)


def test_fp8_weights_on_a100_run_at_the_bf16_peak():
    c = step_cost(V3, A100, Parallel(tp=8, dp=2), [SeqWork(4096, 0)] * 2)    # one chunk per rank
    assert c.compute_s == pytest.approx(c.flops / 16 / (312e12 * A100.compute_efficiency), rel=1e-9)
    assert A100.peak_flops(True) == A100.peak_flops(False) == 312e12
    assert H100.peak_flops(True) == 1979e12 and H100.peak_flops(False) == 989.5e12


def test_a_lone_chunk_waits_for_its_own_rank():
    """DP16: a sequence's attention side (projections + attention) runs on its rank alone, the
    experts and the rest over all 16 GPUs; chunks spread over the ranks price evenly.
    Expert-parallel: steps with a chunk at the MoE prefill efficiency, decodes at the decode one."""
    par = Parallel(tp=1, dp=16)
    rate = 1979e12 * H100.moe_prefill_efficiency

    def attn(ctx, new):
        """Attention FLOPs in FP8-peak FLOPs: the core at the BF16 peak (twice the time), the
        indexer (64 heads of 128 over the CSA entries of 30 layers) at the FP8 one."""
        index = 2 * 64 * 128 * 30 * sum(q // 4 for q in range(ctx + 1, ctx + new + 1))
        return (PRO.attention_flops(ctx, new) - index) * 1979 / 989.5 + index

    proj = 2 * 61 * PRO._attention_params                     # attention projection FLOPs a token
    lone = step_cost(PRO, H100, par, [SeqWork(8192, 4096)])
    own = proj * 8192 + attn(4096, 8192)
    rest = 2 * PRO.active_params_per_token * 8192 - proj * 8192
    assert lone.flops == pytest.approx(proj * 8192 + rest + PRO.attention_flops(4096, 8192), rel=1e-12)
    # The FP4 routed experts run W4A16 on Hopper: their FLOPs (6 of 66,060,288 parameters in 61
    # layers a token) at the BF16 peak, twice their FP8-peak time (tests/sim/test_hardware_fp4.py).
    routed = 2 * 61 * 6 * 66_060_288
    rest_t = rest + routed * 8192
    assert lone.compute_s == pytest.approx((own + rest_t / 16) / rate, rel=1e-9)
    # 16 equal chunks: each rank one, the even share; 4 of them: the busiest rank still holds one.
    even = step_cost(PRO, H100, par, [SeqWork(8192, 4096)] * 16)
    assert even.compute_s == pytest.approx(16 * (own + rest_t) / 16 / rate, rel=1e-9)
    four = step_cost(PRO, H100, par, [SeqWork(8192, 4096)] * 4)
    assert four.compute_s == pytest.approx((own + 4 * rest_t / 16) / rate, rel=1e-9)
    # Decode-only steps and dp = 1 are priced evenly, as before.
    dec = step_cost(PRO, H100, par, [SeqWork(1, 60000)] * 3)
    assert dec.compute_s == pytest.approx(3 * (2 * PRO.active_params_per_token + routed + attn(60000, 1)) / 16
                                          / (1979e12 * H100.moe_decode_efficiency), rel=1e-9)
    one = step_cost(PRO, H100, Parallel(tp=16), [SeqWork(8192, 4096)])
    assert one.compute_s == pytest.approx((own + rest_t) / 16 / rate, rel=1e-9)


def test_parallel_validates():
    with pytest.raises(ValueError, match="expert parallelism 3 must divide the instance's 16 GPUs"):
        Parallel(tp=8, dp=2, ep=3)
    assert Parallel(tp=8, dp=2).expert_parallel == 16 and Parallel(tp=8, dp=2).nodes == 2
    with pytest.raises(ValueError, match="attention data parallelism"):
        Parallel(tp=1, dp=0)
    # A cross-node expert group on hardware without a scale-out NIC is refused by name.
    nonic = dataclasses.replace(H100, scaleout_gb_s=0.0)
    with pytest.raises(ValueError, match="no scale-out bandwidth"):
        step_cost(PRO, nonic, Parallel(tp=1, dp=16), [SeqWork(1, 10)])


def test_dense_model_is_unchanged_by_the_new_shape():
    l70 = profiles.model("llama3-70b")
    batch = [SeqWork(1, 4096)] * 32
    assert step_cost(l70, H100, 4, batch) == step_cost(l70, H100, Parallel(tp=4), batch)


def test_engine_on_v4_pool_and_virtual_chunk_bytes():
    cfg = EngineConfig(implementation="costmodel", block_size=64, num_blocks=0, max_num_seqs=32,
                       max_num_batched_tokens=4096,
                       costmodel=CostModelConfig(hardware="H200-SXM", tensor_parallel=1, data_parallel=8))
    eng = CostModelEngine(PRO, H200, cfg)
    # 8 ranks of one GPU, max_num_seqs per rank as in vLLM: each keeps 32 sequences' windows,
    # the rest at 5511.4375 B a token.
    attn, mtp_attn = PRO.attention_weight_bytes, PRO.mtp_attention_weight_bytes
    weights = attn + mtp_attn + (PRO.dense_weight_bytes - attn + 61 * 384 * PRO.expert_bytes
                                 + PRO.mtp_weight_bytes - mtp_attn) / 8
    per_rank = 141e9 * 0.9 - weights - 32 * PRO.kv_window_bytes
    assert eng.blocks.num_blocks == int(per_rank // PRO.kv_bytes_per_token) * 8 // 64
    assert eng.parallel == Parallel(tp=1, dp=8)
    sched = eng.scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_chunk_tokens) == (256, 32768, 4096)
    # A virtual chunk of 100 tokens is charged 100 x 5512 bytes (the wire layout: 1 x 1378 BF16 pairs).
    from pddgw.engines.types import EngineRequest, SamplingParams
    eng.add_request(EngineRequest("r", tuple(range(100)), SamplingParams(max_tokens=1), retain_kv=True))
    while eng.has_work():
        eng.step()
    assert eng.export_kv("r", 0, 100).nbytes == 100 * 5512
    with pytest.raises(ConfigError, match="engine.costmodel: deepseek-v4-pro weights"):
        CostModelEngine(PRO, H100, dataclasses.replace(cfg, costmodel=CostModelConfig(
            hardware="H100-SXM", tensor_parallel=8)))


def test_user_config_json_path(tmp_path):
    # A user's own MoE: a Qwen3-MoE config.json with 16 experts of 64, top-2.
    cfg = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "num_experts": 16, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64, "vocab_size": 1000, "max_position_embeddings": 4096,
           "eos_token_id": 2, "bos_token_id": 1, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = profiles.model(str(tmp_path))
    attn = 32 * (32 + 2 * 16) + 32 * 32 + 2 * 8
    assert m.param_count == 2 * 1000 * 32 + 2 * (attn + 16 * 3 * 32 * 64 + 32 * 16 + 2 * 32) + 32
    assert m.kv_bytes(10) == 10 * 2 * 2 * 2 * 8 * 2
    (tmp_path / "bad.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(ModelConfigError, match="model_type 'mamba' unsupported"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(KeyError, match="deepseek-v4-pro"):
        profiles.model("no-such-model")


def test_v4_step_sums_the_profile_formulas():
    # The roofline's hoisted V4 path equals the profile's per-sequence formulas.
    batch = [SeqWork(1, 65535), SeqWork(8192, 0), SeqWork(300, 1000), SeqWork(5, 3), SeqWork(1, 127)]
    c = step_cost(PRO, H200, Parallel(tp=1, dp=8), batch)
    attn = sum(PRO.attention_flops(w.context_tokens, w.new_tokens) for w in batch)
    assert c.flops == pytest.approx(2 * PRO.active_params_per_token * 8499 + attn, rel=1e-12)
    kv = sum(PRO.kv_read_bytes(w.context_tokens, w.new_tokens) for w in batch)
    # Expert-parallel: two micro-batches of 4,250 and 4,249 tokens, each reading the weights.
    experts = 61 * (distinct_experts(384, 6, 4250) + distinct_experts(384, 6, 4249)) * PRO.expert_bytes
    nbytes = (2 * (PRO.attention_weight_bytes * 8 + PRO.dense_weight_bytes - PRO.attention_weight_bytes)
              + experts + kv)
    assert c.bytes == pytest.approx(nbytes, rel=1e-12)
    # One decode at 64K reads the window, the top-1024 CSA entries and every indexer key and HCA entry.
    assert PRO.kv_read_bytes(65535, 1) == 61 * 128 * 584 + 30 * (16384 * 132 + 1024 * 584) + 31 * 512 * 584


def test_v4_attention_of_a_decode_batch_equals_the_per_sequence_formulas_exactly():
    # The roofline sums decodes term by term (in C); integers throughout, so the totals are the
    # per-sequence formulas' to the bit, at every edge: the window, the top-k, the ratios.
    from pddgw.sim.model_shape import V4_CSA_RATIO, V4_HCA_RATIO
    from pddgw.sim.roofline import _attention

    w, k, c, h = PRO.sliding_window, PRO.index_topk, V4_CSA_RATIO, V4_HCA_RATIO
    edges = [0, 1, w - 2, w - 1, w, c - 1, c, c * k - 2, c * k - 1, c * k, h - 1, h, 65535, 1 << 20]
    rng = random.Random(7)
    for batch in ([SeqWork(1, x) for x in edges],
                  [SeqWork(1, rng.randrange(200_000)) for _ in range(97)],
                  [SeqWork(1, rng.randrange(c * k, 200_000)) for _ in range(97)],
                  [SeqWork(rng.choice((1, 1, 2, 64, 4096)), rng.randrange(70_000)) for _ in range(60)]):
        flops, kv, _ = _attention(PRO, batch)
        assert flops == float(sum(PRO.attention_flops(s.context_tokens, s.new_tokens) for s in batch))
        assert kv == float(sum(PRO.kv_read_bytes(s.context_tokens, s.new_tokens) for s in batch))


@pytest.mark.parametrize("name", ["llama3.1-70b", "deepseek-v3", "deepseek-v4-pro"])
def test_a_decode_step_costs_what_step_cost_says_to_the_bit(name):
    # GQA, MLA and V4 attention: the simulator's decode steps are priced without a SeqWork each,
    # and must cost exactly what the general path says, at the V4 edges and on every shape.
    from pddgw.sim.model_shape import V4_CSA_RATIO, V4_HCA_RATIO
    from pddgw.sim.roofline import decode_step_cost

    model = profiles.model(name)
    k = model.index_topk or 1
    edges = [0, 1, 126, 127, 128, V4_CSA_RATIO, V4_CSA_RATIO * k - 1, V4_CSA_RATIO * k, V4_HCA_RATIO - 1, 65535]
    rng = random.Random(11)
    for par in (Parallel(tp=8), Parallel(tp=1, dp=8), Parallel(tp=2, dp=8, ep=16)):
        top = max(128, V4_CSA_RATIO * k)       # (V4: every decode at or past it takes the constant terms)
        for contexts in (edges, [rng.randrange(140_000) for _ in range(333)], [5], [],
                         [rng.randrange(top, 140_000) for _ in range(200)], [top - 1, top, 70_000], [top - 2, 70_000]):
            want = step_cost(model, H200, par, [SeqWork(1, c) for c in contexts])
            assert decode_step_cost(model, H200, par, [c + 1 for c in contexts]) == want
