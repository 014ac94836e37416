"""One engine step's time on modeled GPUs: a roofline of FLOPs and HBM bytes, plus TP all-reduces.

A step computes a mixed batch: prefill chunks, extends (k tokens appended to
a cached prefix) and decodes (1 token).  Each sequence in it is a `SeqWork`:
`new` tokens computed now on top of `ctx` tokens whose KV already exists.
For a model with L layers, H query heads of size d, hidden size D and P
active parameters per token (`ModelProfile.active_params_per_token`: no
embedding lookup, LM head included), on tp GPUs:

  FLOPs (whole instance)
    linear     2 * P * sum(new)
               The LM head is charged for every new token, although only
               the last one of a prefill chunk needs logits: simpler, and
               it overstates a long chunk by vocab/params (~1.5 % for 70B).
    attention  sum over sequences of 4 * L * H * d * new * (ctx + (new + 1) / 2)
               QK^T and PV (2 FLOPs per multiply-add each); every new token
               sees the ctx cached tokens and, causally, on average
               (new + 1) / 2 of the chunk.
  bytes (HBM reads + writes, whole instance)
    weights    weight_bytes, read once per step whatever the batch
    KV         sum over sequences of (ctx + new) * kv_bytes_per_token:
               the cached KV is read, the new tokens' KV is written
               (the chunk's own KV is consumed on chip, not re-read)
    Activations are ignored: for a 70B model they are ~1 % of the weight
    bytes in a 32-token decode batch and a few % up to the ~150 batched
    tokens where a step turns compute-bound; beyond that bytes do not decide.
    MoE weights are charged in full (every expert read), right for batches
    large enough to visit them all.

  per GPU (tensor parallelism splits weights, heads and KV evenly)
    compute_s = FLOPs / tp / (peak_tflops_bf16 * 1e12 * compute_efficiency)
    memory_s  = bytes / tp / (hbm_tb_s * 1e12 * bandwidth_efficiency)
    comm_s    = 2 * L all-reduces (after attention and after the MLP), each
                allreduce_latency_us plus, for a ring, 2 * (tp - 1) / tp of
                its sum(new) * D * 2-byte buffer (bf16 activations) per GPU
                over interconnect_gb_s; 0 for tp = 1.  The latency dominates
                decode (KBs per call), the bandwidth prefill (MBs per call).
  seconds = max(compute_s, memory_s) + comm_s + step_overhead_ms / 1e3

Communication is not overlapped with compute (engines without
compute/communication overlap, the common case).  A step with no new tokens
does no work and costs nothing, overhead included.
"""

from __future__ import annotations

import functools

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pddgw.sim.profiles import HardwareProfile, ModelProfile

ACTIVATION_BYTES = 2   # bf16 hidden states in the TP all-reduces


@dataclass(frozen=True, slots=True)
class SeqWork:
    new_tokens: int        # tokens computed in this step for this sequence (1 = decode)
    context_tokens: int    # tokens whose KV exists before this step (cached prefix + earlier chunks)

    def __post_init__(self) -> None:
        if self.new_tokens < 0 or self.context_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got new={self.new_tokens} "
                             f"context={self.context_tokens}")


@dataclass(frozen=True, slots=True)
class StepCost:
    seconds: float
    flops: float           # total over the instance
    bytes: float           # HBM bytes read+written, total over the instance
    compute_s: float
    memory_s: float
    comm_s: float
    bound: Literal["compute", "memory"]


_IDLE = StepCost(seconds=0.0, flops=0.0, bytes=0.0, compute_s=0.0, memory_s=0.0, comm_s=0.0, bound="memory")


@functools.lru_cache(maxsize=64)
def _per_model(model: ModelProfile) -> tuple[float, float, int]:
    """(linear FLOPs per token, weight bytes, attention FLOPs per (token, context token)):
    profile properties recomputed per step would cost more than the step's arithmetic."""
    return (2.0 * model.active_params_per_token, float(model.weight_bytes),
            4 * model.num_layers * model.num_heads * model.head_dim)


def step_cost(model: ModelProfile, hw: HardwareProfile, tp: int, batch: Sequence[SeqWork]) -> StepCost:
    """The modeled duration of one forward step of `batch` on `tp` GPUs of `hw` (formulas: module doc)."""
    if tp < 1:
        raise ValueError(f"tensor parallelism must be >= 1, got {tp}")
    work = [w for w in batch if w.new_tokens > 0]
    if not work:
        return _IDLE
    new = sum(w.new_tokens for w in work)
    linear_per_token, weight_bytes, attn_per_token_ctx = _per_model(model)
    flops = (linear_per_token * new
             + sum(attn_per_token_ctx * w.new_tokens * (w.context_tokens + (w.new_tokens + 1) / 2) for w in work))
    kv_tokens = sum(w.context_tokens + w.new_tokens for w in work)
    nbytes = weight_bytes + kv_tokens * model.kv_bytes_per_token

    compute_s = flops / tp / (hw.peak_tflops_bf16 * 1e12 * hw.compute_efficiency)
    memory_s = nbytes / tp / (hw.hbm_tb_s * 1e12 * hw.bandwidth_efficiency)
    comm_s = 0.0
    if tp > 1:
        buffer = new * model.hidden_size * ACTIVATION_BYTES
        per_call = hw.allreduce_latency_us / 1e6 + (2 * (tp - 1) / tp) * buffer / (hw.interconnect_gb_s * 1e9)
        comm_s = 2 * model.num_layers * per_call
    return StepCost(
        seconds=max(compute_s, memory_s) + comm_s + hw.step_overhead_ms / 1e3,
        flops=flops,
        bytes=nbytes,
        compute_s=compute_s,
        memory_s=memory_s,
        comm_s=comm_s,
        bound="compute" if compute_s > memory_s else "memory",
    )


def max_kv_tokens(model: ModelProfile, hw: HardwareProfile, tp: int, memory_utilization: float = 0.9) -> int:
    """KV tokens that fit in `tp` GPUs after the weights: (tp * hbm * util - weight_bytes) // kv_bytes_per_token.

    Assumes KV heads split evenly over the GPUs (no replication when tp >
    num_kv_heads) and no room kept for activations beyond (1 - util).
    """
    if tp < 1:
        raise ValueError(f"tensor parallelism must be >= 1, got {tp}")
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    free = tp * hw.hbm_gb * 1e9 * memory_utilization - model.weight_bytes
    if free <= 0:
        raise ValueError(f"{model.name} weights ({model.weight_bytes / 1e9:.1f} GB) do not fit in "
                         f"{tp} x {hw.name} at {memory_utilization:.0%} of {hw.hbm_gb:g} GB")
    return int(free // model.kv_bytes_per_token)
