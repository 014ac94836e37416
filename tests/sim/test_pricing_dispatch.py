"""Expert-parallel dispatch in prefill sends a token once per destination node, against hand computations.

DeepEP's normal mode (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.2.2) sends a token
over InfiniBand once to each node holding one of its k experts, then NVLink forwards it to each
GPU there that hosts one; the combine comes back the same way.  Decode's low-latency mode sends
one copy per expert.  Model numbers are written out from the shipped config.json; hardware
numbers are read from the profiles.
"""

import dataclasses
import itertools
from fractions import Fraction
from math import comb

import pytest

from pddgw.sim import profiles
from pddgw.sim.roofline import Parallel, SeqWork, alltoall_wire_s, distinct_groups, step_cost
from tests.sim.v3_shape import V3_ACTIVE

V3 = profiles.model("deepseek-v3")
H100 = profiles.hardware("H100-SXM")


def test_distinct_groups_is_the_hypergeometric_expectation():
    # 8 experts in 2 groups of 4, top-2: a group is missed when both picks fall in the other
    # one, C(4, 2) / C(8, 2) = 6 / 28, so 2 x 22 / 28 = 11 / 7 groups.
    assert distinct_groups(8, 2, 2) == pytest.approx(11 / 7, rel=1e-15)
    # Enumerated: every top-3 of 16 experts in 4 groups of 4, equally likely.
    picks = list(itertools.combinations(range(16), 3))
    mean = Fraction(sum(len({e // 4 for e in p}) for p in picks), len(picks))
    assert distinct_groups(16, 3, 4) == pytest.approx(float(mean), rel=1e-15)
    # One group per expert: every expert its own group, k of them; one group: always it.
    assert distinct_groups(256, 8, 256) == pytest.approx(8.0, rel=1e-12)
    assert distinct_groups(256, 8, 1) == 1.0
    # More picks than experts outside a group: every group is hit.
    assert distinct_groups(8, 5, 2) == 2.0


def test_sglang_prefill_shape_sends_once_per_node():
    # 4 x 8 H100, DP32 EP32 (8 experts a GPU, 64 a node), 16,384 tokens a GPU per step.  A token
    # misses a node with probability C(192, 8) / C(256, 8) and a GPU with C(248, 8) / C(256, 8).
    par = Parallel(tp=1, dp=32)
    per_copy = 16384 * 7168 * (1 + 2)                               # FP8 dispatch + BF16 combine
    nodes_hit = 4 * (1 - comb(192, 8) / comb(256, 8))               # ~3.61 of 4
    gpus_hit = 32 * (1 - comb(248, 8) / comb(256, 8))               # ~7.17 of 32
    nic = per_copy * nodes_hit * 3 / 4 / (H100.scaleout_gb_s * 1e9)
    nvlink = per_copy * gpus_hit * 7 / 8 / (H100.interconnect_gb_s * 1e9)
    assert alltoall_wire_s(V3, H100, par, 128 * 4096, normal=True) == pytest.approx(max(nic, nvlink), rel=1e-12)
    assert nic > nvlink
    # Per expert (the low-latency mode) it would be 8 x 24/32 = 6 copies over the NIC, not ~2.71.
    low_latency = per_copy * 8 * 24 / 32 / (H100.scaleout_gb_s * 1e9)
    assert alltoall_wire_s(V3, H100, par, 128 * 4096) == pytest.approx(low_latency, rel=1e-12)
    assert nodes_hit * 3 / 4 == pytest.approx(2.711, abs=1e-3)
    # The prefill step: 58 MoE layers of that wire hide behind the step's compute.
    c = step_cost(V3, H100, par, [SeqWork(4096, 0)] * 128)
    attn = 128 * 61 * 2 * 128 * (128 + 64 + 128) * (4096 * 4097 // 2)     # at the BF16 peak
    # an expert-parallel MoE prefill: at the MoE prefill efficiency (pddgw/sim/profiles.py)
    compute = (2 * V3_ACTIVE * 128 * 4096 / 1979e12 + attn / 989.5e12) / 32 / H100.moe_prefill_efficiency
    assert c.compute_s == pytest.approx(compute, rel=1e-12)
    assert 58 * nic < compute and c.memory_s < compute
    latencies = 58 * 2 * H100.allreduce_latency_us / 1e6
    assert c.seconds == pytest.approx(compute + latencies + H100.step_overhead_ms / 1e3, rel=1e-12)


def test_a_step_with_a_chunk_dispatches_per_node_a_decode_step_per_expert():
    # A slow NIC (0.5 GB/s) makes the wire set the step, so its mode shows in the seconds.
    # 2 x 8 GPUs, DP16: per node 128 experts of 256; one 1,600-token chunk and 16 decodes (101
    # tokens a GPU), then the same 1,616 tokens as decodes alone.
    slow = dataclasses.replace(H100, scaleout_gb_s=0.5)
    par = Parallel(tp=1, dp=16)
    per_copy = 1616 / 16 * 7168 * 3
    latencies = 58 * 2 * H100.allreduce_latency_us / 1e6
    mixed = step_cost(V3, slow, par, [SeqWork(1600, 0)] + [SeqWork(1, 100)] * 16)
    nodes_hit = 2 * (1 - comb(128, 8) / comb(256, 8))
    wire = 58 * per_copy * nodes_hit * 1 / 2 / 0.5e9
    assert max(mixed.compute_s, mixed.memory_s) < wire
    assert mixed.seconds == pytest.approx(wire + latencies + H100.step_overhead_ms / 1e3, rel=1e-12)
    decodes = step_cost(V3, slow, par, [SeqWork(1, 100)] * 1616)
    wire = 58 * per_copy * 8 * 8 / 16 / 0.5e9
    assert max(decodes.compute_s, decodes.memory_s) < wire
    assert decodes.seconds == pytest.approx(wire + latencies + H100.step_overhead_ms / 1e3, rel=1e-12)
