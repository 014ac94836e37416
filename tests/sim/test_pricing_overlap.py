"""Expert-parallel all-to-all overlapped with compute, against hand-computed rooflines.

DeepSeek's inference system (two micro-batches in prefill, a 5-stage pipeline in decode),
SGLang's two-batch overlap and vLLM's dual-batch overlap hide the dispatch / combine bytes
behind the other micro-batch's compute: a step is max(compute, memory, all-to-all bytes) plus
what cannot overlap (the tensor-parallel all-reduces, each exchange's fixed latency, the step
overhead).  Model numbers are written out from the shipped config.json; hardware numbers are
read from the profiles, so a recalibration changes no expectation here.
"""

import dataclasses

import pytest

from pddgw.sim import profiles
from pddgw.sim.roofline import Parallel, SeqWork, decode_step_cost, distinct_experts, step_cost
from tests.sim.v3_shape import V3_EXPERT, V3_BPP, V3_ATTN_BYTES, V3_OTHER_BYTES, V3_KV_PER_TOKEN

V3 = profiles.model("deepseek-v3")
L70 = profiles.model("llama3-70b")
H100, H200 = profiles.hardware("H100-SXM"), profiles.hardware("H200-SXM")


def v3_decode_memory_s(hw, gpus, seqs, ctx):
    """Per GPU bytes of a DP-attention (tp 1) V3 decode step over HBM: every GPU reads all
    attention weights, a 1 / gpus share of the rest, of the visited experts and of the KV; the
    weights once per micro-batch (two of seqs / 2, seqs even)."""
    experts = 2 * 58 * distinct_experts(256, 8, seqs // 2) * V3_EXPERT * V3_BPP
    kv = seqs * (ctx + 1) * V3_KV_PER_TOKEN
    return ((2 * V3_ATTN_BYTES + (2 * V3_OTHER_BYTES + experts + kv) / gpus)
            / (hw.hbm_tb_s * 1e12 * hw.bandwidth_efficiency))


def test_decode_alltoall_hidden_behind_memory():
    # 8 x H200, DP8 EP8, 64 decodes per GPU at a 4K KV: the dispatch + combine (64 tokens x 8
    # experts x 7168 x (1 + 2) B, 7/8 of it to the node's 7 other GPUs) is far below the bytes
    # the step reads, so only its two fixed latencies per MoE layer remain.
    par = Parallel(tp=1, dp=8)
    c = step_cost(V3, H200, par, [SeqWork(1, 4096)] * 512)
    memory = v3_decode_memory_s(H200, 8, 512, 4096)
    wire = 58 * (64 * 8 * 7168 * 3 * 7 / 8) / (H200.interconnect_gb_s * 1e9)
    latencies = 58 * 2 * H200.allreduce_latency_us / 1e6
    assert c.memory_s == pytest.approx(memory, rel=1e-12)
    assert wire < c.compute_s < memory
    assert c.comm_s == pytest.approx(latencies, rel=1e-12)
    assert c.seconds == pytest.approx(memory + latencies + H200.step_overhead_ms / 1e3, rel=1e-12)
    assert decode_step_cost(V3, H200, par, [4097] * 512) == c


def test_decode_alltoall_longer_than_compute_sets_the_step():
    # SGLang's decode shape: 9 x 8 H100, DP72 EP72, 256 decodes per GPU at 2,000 tokens, on a
    # 100 Gb/s NIC per GPU (12.5 GB/s; H100's 50 GB/s one hides under compute at the MoE
    # decode efficiency).  Per MoE layer each GPU sends 256 x 8 x 7168 x 3 B, 64/72 of it to
    # other nodes over the NIC (low-latency mode: one copy per expert); that outlasts compute
    # and memory, so the step is the wire time plus the latencies and the overhead.
    hw = dataclasses.replace(H100, scaleout_gb_s=12.5)
    par = Parallel(tp=1, dp=72)
    c = step_cost(V3, hw, par, [SeqWork(1, 2000)] * (72 * 256))
    per_gpu = 256 * 8 * 7168 * 3
    wire = 58 * max(per_gpu * 7 / 72 / (hw.interconnect_gb_s * 1e9), per_gpu * 64 / 72 / (hw.scaleout_gb_s * 1e9))
    latencies = 58 * 2 * hw.allreduce_latency_us / 1e6
    memory = v3_decode_memory_s(hw, 72, 72 * 256, 2000)
    assert c.memory_s == pytest.approx(memory, rel=1e-12)
    assert max(c.compute_s, memory) < wire
    assert c.seconds == pytest.approx(wire + latencies + hw.step_overhead_ms / 1e3, rel=1e-12)
    # comm_s is what communication adds over max(compute, memory): the exposed wire + latencies.
    assert c.comm_s == pytest.approx(wire - max(c.compute_s, memory) + latencies, rel=1e-12)
    assert c.bound == "network"


def test_tensor_parallel_allreduce_stays_serial():
    # Llama-3-70B TP4, 32 decodes at 4K: no expert parallelism, nothing overlaps; 160
    # all-reduces of (32 x 8192 x 2 B) each, a latency plus a ring's 2 x 3/4 of the buffer.
    c = step_cost(L70, H100, 4, [SeqWork(1, 4096)] * 32)
    ar = 160 * (H100.allreduce_latency_us / 1e6 + 2 * 3 / 4 * 32 * 8192 * 2 / (H100.interconnect_gb_s * 1e9))
    assert c.comm_s == pytest.approx(ar, rel=1e-12)
    assert c.seconds == pytest.approx(max(c.compute_s, c.memory_s) + ar + H100.step_overhead_ms / 1e3, rel=1e-12)
