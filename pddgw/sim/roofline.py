"""One engine step's time on modeled GPUs: a roofline of FLOPs and HBM bytes, plus communication.

A step is a mixed batch of `SeqWork`s (`new` tokens computed on top of `ctx` tokens whose KV
exists); an instance is `Parallel(tp, dp, ep)`, gpus = tp * dp.  Per GPU:

    seconds = max(compute_s, memory_s, a2a_wire_s) + serial_comm_s + step_overhead_ms / 1e3

compute_s, memory_s and the communication terms are defined where they are computed
(`_priced`, `_StepConsts.by_new`, `alltoall_s`, `step_cost`).  An expert-parallel step's
all-to-all bytes (a2a_wire_s) overlap its compute, as the engines that serve these models run
it (DeepSeek's inference system: two micro-batches in prefill, a 5-stage pipeline in decode;
SGLang's two-batch overlap; vLLM's dual-batch overlap); the tensor-parallel all-reduces and
every exchange's fixed latency stay serial (serial_comm_s).  Such a step runs as
EP_MICRO_BATCHES micro-batches, each reading the weights it uses, and computes at the part's
fitted MoE prefill or decode efficiency (`HardwareProfile.moe_efficiency`).  Activations are ignored (a few %
of a decode step's bytes).  A step with no new tokens costs nothing, overhead included.
Model and assumptions: docs/simulator.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import floordiv
from typing import Literal, TypeVar

from pddgw.sim.model_shape import (V4_CSA_RATIO, V4_HCA_RATIO, ModelProfile, sum_floor, sum_floor_capped,
                                   sum_min)
from pddgw.sim.profiles import HardwareProfile

_V = TypeVar("_V")

ACTIVATION_BYTES = 2          # bf16 hidden states in the TP all-reduces and the EP combine
DISPATCH_BYTES = 1            # FP8 hidden states in the EP dispatch (DeepEP's low-latency and normal modes)
GPUS_PER_NODE = 8             # HGX / DGX H100, H200, A100 nodes
# Micro-batches an expert-parallel MoE step runs as, so that one's all-to-all overlaps the
# other's compute: DeepSeek's inference system (two in prefill and decode; DeepSeek-V3 technical
# report, arXiv 2412.19437, sec. 3.4; github.com/deepseek-ai/profile-data README), SGLang's
# two-batch overlap, vLLM's dual-batch overlap.  Each micro-batch runs every layer's kernels
# on its own tokens, so each reads the weights it uses: a step reads its weights twice.
EP_MICRO_BATCHES = 2


@dataclass(frozen=True, slots=True)
class Parallel:
    """How one instance's GPUs split the model: tp x dp GPUs, experts over ep of them."""

    tp: int = 1                    # tensor parallelism inside each attention rank
    dp: int = 1                    # attention data-parallel ranks (DP-attention)
    ep: int = 0                    # expert parallelism; 0 = every GPU of the instance
    gpus_per_node: int = GPUS_PER_NODE

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tensor parallelism must be >= 1, got {self.tp}")
        if self.dp < 1:
            raise ValueError(f"attention data parallelism must be >= 1, got {self.dp}")
        if self.ep < 0 or (self.ep and self.gpus % self.ep):
            raise ValueError(f"expert parallelism {self.ep} must divide the instance's {self.gpus} GPUs "
                             f"(tp {self.tp} x dp {self.dp}), or be 0 (all of them)")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def expert_parallel(self) -> int:
        return self.ep or self.gpus

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)


def as_parallel(tp: int | Parallel) -> Parallel:
    return tp if isinstance(tp, Parallel) else Parallel(tp=tp)


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
    comm_s: float          # what communication adds to max(compute_s, memory_s): not hidden behind them
    bound: Literal["compute", "memory", "network"]   # what sets the step: the largest of the three


_IDLE = StepCost(seconds=0.0, flops=0.0, bytes=0.0, compute_s=0.0, memory_s=0.0, comm_s=0.0, bound="memory")


def distinct_experts(num_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens visit when each picks k of num_experts
    uniformly: E * (1 - (1 - k/E)^T) (each expert is missed by a token with probability 1 - k/E)."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - k / num_experts) ** tokens)


def distinct_groups(num_experts: int, k: int, groups: float) -> float:
    """Expected groups (GPUs, nodes) of num_experts / groups experts each that one token's k
    distinct experts land in, routing uniform: groups * (1 - C(E - m, k) / C(E, k)), m = E /
    groups (a group is missed when all k experts fall among the E - m outside it)."""
    if num_experts <= 0 or k <= 0 or groups <= 0:
        return 0.0
    outside = num_experts - num_experts / groups
    missed = 1.0
    for i in range(k):
        if outside - i <= 0:
            return float(groups)
        missed *= (outside - i) / (num_experts - i)
    return groups * (1.0 - missed)


def _per_profile(fn: Callable[[ModelProfile], _V]) -> Callable[[ModelProfile], _V]:
    """Memoize `fn` per profile object: `lru_cache` would hash the whole frozen profile (every
    field, twice a step), an identity check is one dict look-up.  Entries hold their profile,
    so an id is never reused while cached."""
    cache: dict[int, tuple[ModelProfile, _V]] = {}

    @functools.wraps(fn)
    def get(model: ModelProfile) -> _V:
        hit = cache.get(id(model))
        if hit is not None and hit[0] is model:
            return hit[1]
        value = fn(model)
        if len(cache) >= 64:
            cache.clear()
        cache[id(model)] = (model, value)
        return value

    return get


@_per_profile
def _per_model(model: ModelProfile) -> tuple[float, float, float, float, bool]:
    """(linear FLOPs per token, attention weight bytes, other dense weight bytes, bytes of one
    routed expert, KV has heads to split): profile properties recomputed per step would cost
    more than the arithmetic."""
    attn = float(model.attention_weight_bytes)
    return (2.0 * model.active_params_per_token, attn, float(model.dense_weight_bytes) - attn,
            float(model.expert_bytes), model.attention == "gqa")


@_per_profile
def _attention_linear(model: ModelProfile) -> float:
    """Attention projection FLOPs per token (every layer): the rank-local linear part."""
    return 2.0 * model.num_layers * model._attention_params


@_per_profile
def _v4_consts(model: ModelProfile) -> tuple[int, ...]:
    """DeepSeek-V4's per-step constants: (layers, window, entry bytes, index bytes, CSA layers,
    HCA layers, top-k, FLOPs per attended entry, indexer FLOPs per scored entry)."""
    csa, hca = model._v4_layers
    return (model.num_layers, model.sliding_window, model._v4_entry_bytes, model._v4_index_bytes, csa, hca,
            model.index_topk, 4 * model.num_heads * model.head_dim, 2 * model.index_n_heads * model.index_head_dim)


def _v4_attention(model: ModelProfile, his: list[int], chunks: Sequence[SeqWork]) -> tuple[float, float, float]:
    """(attention FLOPs, KV bytes, the indexer's share of the FLOPs) of a step:
    `ModelProfile.attention_flops` and `kv_read_bytes` summed over the sequences, with the
    constants hoisted (the sim prices every step; tests pin the two paths equal).  `his`: each
    decode's length with its new token (context + 1), `chunks`: the sequences of more than one
    new token."""
    layers, window, e, i, csa, hca, k, per_entry, per_index = _v4_consts(model)
    c, h = V4_CSA_RATIO, V4_HCA_RATIO
    # Decodes (the common case) summed per term in C (map over builtins): every term is an
    # integer sum, so regrouping it is exact.
    n = len(his)
    if n and min(his) >= max(window, c * k):
        # Every one past the window and the top-k (a long context, the paper's): those terms are
        # constants, two sums left.
        win, sel = window * n, k * n
        scored = sum(map(floordiv, his, repeat(c, n)))
    else:
        comps = list(map(floordiv, his, repeat(c, n)))
        win = sum(map(min, his, repeat(window, n)))
        sel = sum(map(min, comps, repeat(k, n)))
        scored = sum(comps)
    hcas = sum(map(floordiv, his, repeat(h, n)))
    entries = layers * win + csa * sel + hca * hcas
    nbytes = layers * win * e + csa * (scored * i + sel * e) + hca * hcas * e
    for w in chunks:
        new = w.new_tokens
        lo = w.context_tokens
        hi = lo + new
        comp = hi // c
        entries += (layers * (sum_min(hi, window) - sum_min(lo, window))
                    + csa * (sum_floor_capped(hi, c, k) - sum_floor_capped(lo, c, k))
                    + hca * (sum_floor(hi, h) - sum_floor(lo, h)))
        scored += sum_floor(hi, c) - sum_floor(lo, c)
        nbytes += (layers * min(hi, window + new - 1) * e + csa * (comp * i + min(comp, k * new) * e)
                   + hca * (hi // h) * e)
    return float(per_entry * entries + per_index * csa * scored), float(nbytes), float(per_index * csa * scored)


def _attention(model: ModelProfile, work: Sequence[SeqWork]) -> tuple[float, float, float]:
    """(attention FLOPs, KV bytes read and written, FLOPs of them run at the GEMM peak) of a
    step's sequences.  The core (QK^T, softmax, PV) runs in BF16 whatever the weights
    (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.3.1: attention operators kept at
    BF16 / FP32; FlashMLA computes in BF16, an FP8 KV cache dequantized to it); DeepSeek-V4's
    indexer scores its FP8 keys in FP8 (DeepSeek-V3.2's lightning indexer), at the GEMMs' peak."""
    if model.attention == "v4":
        return _v4_attention(model, [w.context_tokens + 1 for w in work if w.new_tokens == 1],
                             [w for w in work if w.new_tokens != 1])
    # gqa / mla: one per-pair constant and a linear KV; summed inline (the sim calls this every step).
    per_pair = model.attention_flops(0, 1)
    flops = per_pair * sum(w.new_tokens * (w.context_tokens + (w.new_tokens + 1) / 2) for w in work)
    return flops, float(sum(w.context_tokens + w.new_tokens for w in work)) * model.kv_bytes_per_token, 0.0


def _decode_attention(model: ModelProfile, lengths: list[int]) -> tuple[float, float, float]:
    """`_attention` of decodes whose sequences are `lengths` tokens long with the new one: the
    same sums term for term.  A decode's GQA / MLA term is 1 * (context + 2 / 2) = its length
    as a float, and a float sum of integers below 2^53 is exact, so summing the integers first
    gives the same bits."""
    if model.attention == "v4":
        return _v4_attention(model, lengths, ())
    total = float(sum(lengths))
    return model.attention_flops(0, 1) * total, total * model.kv_bytes_per_token, 0.0


def alltoall_s(model: ModelProfile, hw: HardwareProfile, par: Parallel, tokens: int, normal: bool = False) -> float:
    """One MoE layer's dispatch + combine on the slowest GPU: its wire time
    (`alltoall_wire_s`) plus 2 * allreduce_latency_us (one launch and handshake each way)."""
    if par.expert_parallel <= 1 or not model.num_experts or tokens <= 0:
        return 0.0
    return 2 * hw.allreduce_latency_us / 1e6 + alltoall_wire_s(model, hw, par, tokens, normal)


def alltoall_wire_s(model: ModelProfile, hw: HardwareProfile, par: Parallel, tokens: int,
                    normal: bool = False) -> float:
    """The bytes of one MoE layer's dispatch (FP8) + combine (BF16) on the slowest GPU, each GPU
    sending its T / gpus tokens over NVLink inside its node and over scaleout_gb_s to the
    others, the slower deciding.  Copies of a token, with N = ep / gpn nodes of gpn GPUs:

      low-latency mode (decode): one per expert, k (gpn - 1) / ep over NVLink, k (N - 1) / N
          over the NIC.
      normal mode (a step with a prefill chunk): DeepEP's, per the DeepSeek-V3 technical report
          (arXiv 2412.19437, sec. 3.2.2): one per distinct remote node over the NIC,
          `distinct_groups`(E, k, N) (N - 1) / N, then forwarded over NVLink to each distinct GPU
          of that node hosting one of its experts, as inside its own node: `distinct_groups`(E,
          k, ep) (gpn - 1) / gpn (every node: the expected GPUs hit but the one it lands on);
          the combine returns the same way, reduced in the node first.
    """
    ep = par.expert_parallel
    if ep <= 1 or not model.num_experts or tokens <= 0:
        return 0.0
    per_copy = tokens / par.gpus * model.hidden_size * (DISPATCH_BYTES + ACTIVATION_BYTES)
    gpn = min(par.gpus_per_node, ep)
    k = model.experts_per_token
    if normal:
        nodes = ep / gpn
        local = per_copy * distinct_groups(model.num_experts, k, ep) * (gpn - 1) / gpn
        remote = per_copy * distinct_groups(model.num_experts, k, nodes) * (nodes - 1) / nodes
    else:
        local = per_copy * k * (gpn - 1) / ep
        remote = per_copy * k * (ep - gpn) / ep
    if remote and not hw.scaleout_gb_s:
        raise ValueError(f"{hw.name} has no scale-out bandwidth for an expert-parallel group of {ep} GPUs "
                         f"across {par.nodes} nodes")
    return max(local / (hw.interconnect_gb_s * 1e9), remote / (hw.scaleout_gb_s * 1e9) if remote else 0.0)


class _StepConsts:
    """What `step_cost` computes from the instance alone, and per step size T (decode batches
    repeat it).  Each value is the very expression `step_cost` evaluates, same operands and
    order, so the costs are the same to the last bit.
    """

    __slots__ = ("model", "hw", "par", "linear_per_token", "linear_time_per_token", "gpus", "kv_copies",
                 "attn_per_tp", "compute_rate", "rates", "micro_batches",
                 "attn_scale", "memory_rate", "overhead_s", "_by_new", "_attn_dp", "_shared_bytes", "_expert_bytes")

    def __init__(self, model: ModelProfile, hw: HardwareProfile, par: Parallel) -> None:
        self.model, self.hw, self.par = model, hw, par
        self.linear_per_token, attn_bytes, self._shared_bytes, self._expert_bytes, kv_split = _per_model(model)
        self.gpus = par.gpus
        self.kv_copies = 1 if kv_split else par.tp          # one latent: every GPU of a rank holds it all
        self._attn_dp = attn_bytes * par.dp
        self.attn_per_tp = attn_bytes / par.tp
        peak = hw.peak_flops(model.fp8_compute)
        self.compute_rate = peak * hw.compute_efficiency
        # An expert-parallel MoE step runs as EP_MICRO_BATCHES micro-batches, at the part's MoE
        # efficiencies (`HardwareProfile.moe_efficiency`); anything else at compute_efficiency.
        # rates[0]: decode-only steps, [1]: steps with a chunk.
        moe_ep = bool(model.num_experts) and par.expert_parallel > 1
        self.micro_batches = EP_MICRO_BATCHES if moe_ep else 1
        self.rates = ((peak * hw.moe_efficiency(False), peak * hw.moe_efficiency(True)) if moe_ep
                      else (self.compute_rate, self.compute_rate))
        # Routed experts' GEMMs run at their weights' own peak (`HardwareProfile.gemm_peak_flops`:
        # FP4 at the FP4 peak where native, W4A16 at the BF16 one): compute time counts their
        # FLOPs x peak / their peak (the same FLOPs when the peaks agree).
        self.linear_time_per_token = self.linear_per_token
        expert_peak = hw.gemm_peak_flops(model.expert_bytes_per_param or model.weight_bytes_per_param)
        if model.num_experts and expert_peak != peak:
            routed = 2.0 * model.num_moe_layers * model.experts_per_token * model._expert_params
            self.linear_time_per_token += routed * (peak / expert_peak - 1.0)
        # Attention core FLOPs in GEMM-peak FLOPs: it runs at the BF16 peak (`_attention`);
        # exactly 1.0 when the GEMMs do too.
        self.attn_scale = self.compute_rate / (hw.peak_flops(False) * hw.compute_efficiency)
        self.memory_rate = hw.hbm_tb_s * 1e12 * hw.bandwidth_efficiency
        self.overhead_s = hw.step_overhead_ms / 1e3
        # by_new's values, [0] for decode-only steps, [1] for steps with a chunk (normal mode).
        self._by_new: tuple[dict[int, tuple[float, float, float, float, float]], ...] = ({}, {})

    def by_new(self, new: int, normal: bool) -> tuple[float, float, float, float, float]:
        """(dense + attention + expert bytes, shared + expert bytes, serial communication seconds,
        overlapped communication seconds, attention weight bytes per GPU) of a step of `new`
        tokens.  Routed experts: num_moe_layers * distinct_experts * expert_bytes.  Weights are
        read once per micro-batch: m = min(micro_batches, new) micro-batches of new // m or
        new // m + 1 tokens each, each reading the attention and dense weights and the distinct
        experts of its own tokens (1 micro-batch: the step's).  Serial: with tp > 1 one all-reduce per
        layer after attention and one per dense-MLP layer (and per MoE layer when ep = 1), each
        allreduce_latency_us + 2 (tp - 1) / tp * buffer / interconnect, buffer (T / dp) * hidden
        * 2 bytes; with ep > 1 the all-to-alls' 2 * allreduce_latency_us per MoE layer.
        Overlapped: the all-to-alls' wire time per MoE layer (`alltoall_wire_s`).

        The all-reduce stays serial because none of these engines overlaps it: SGLang's two-batch
        and vLLM's dual-batch overlap hide the expert-parallel dispatch and combine only, and
        DeepSeek serves attention data-parallel (no all-reduce).  The fixed latencies stay serial
        because what overlaps is bytes moving while the other micro-batch computes, not the
        launch and handshake each exchange starts with.
        """
        cache = self._by_new[normal]
        got = cache.get(new)
        if got is not None:
            return got
        model, hw, par = self.model, self.hw, self.par
        m = min(self.micro_batches, new)
        size, extra = divmod(new, m)
        visited = sum(distinct_experts(model.num_experts, model.experts_per_token, size + (i < extra))
                      for i in range(m))
        experts = model.num_moe_layers * visited * self._expert_bytes
        serial_s = 0.0
        if par.tp > 1:
            buffer = new / par.dp * model.hidden_size * ACTIVATION_BYTES
            per_call = (hw.allreduce_latency_us / 1e6
                        + (2 * (par.tp - 1) / par.tp) * buffer / (hw.interconnect_gb_s * 1e9))
            ep_layers = model.num_moe_layers if par.expert_parallel > 1 else 0
            serial_s = (2 * model.num_layers - ep_layers) * per_call
        wire_s = 0.0
        if par.expert_parallel > 1 and model.num_experts:
            serial_s += model.num_moe_layers * 2 * hw.allreduce_latency_us / 1e6
            wire_s = model.num_moe_layers * alltoall_wire_s(model, hw, par, new, normal)
        got = (m * (self._attn_dp + self._shared_bytes) + experts, m * self._shared_bytes + experts,
               serial_s, wire_s, m * self.attn_per_tp)
        if len(cache) >= 4096:
            cache.clear()
        cache[new] = got
        return got


_STEP_CONSTS: dict[tuple[int, int, int], _StepConsts] = {}


def _step_consts(model: ModelProfile, hw: HardwareProfile, par: Parallel) -> _StepConsts:
    """Per (model, hardware, shape) object, by identity (as `_per_profile`; entries hold them)."""
    key = (id(model), id(hw), id(par))
    c = _STEP_CONSTS.get(key)
    if c is not None and c.model is model and c.hw is hw and c.par is par:
        return c
    c = _StepConsts(model, hw, par)
    if len(_STEP_CONSTS) >= 64:
        _STEP_CONSTS.clear()
    _STEP_CONSTS[key] = c
    return c


def _new_tokens(w: SeqWork) -> int:
    return w.new_tokens


def step_cost(model: ModelProfile, hw: HardwareProfile, tp: int | Parallel, batch: Sequence[SeqWork]) -> StepCost:
    """The modeled duration of one forward step of `batch` on one instance of `hw` GPUs split as
    `tp` (a TP degree or a `Parallel`).  With dp > 1 the step waits for its busiest attention
    rank: when the largest chunk's attention (projections + attention) exceeds an even 1 / dp
    share, the excess is added over that rank's tp GPUs.
    """
    par = tp if type(tp) is Parallel else as_parallel(tp)
    work = [w for w in batch if w.new_tokens > 0]
    if not work:
        return _IDLE
    new = sum([w.new_tokens for w in work]) if len(work) > 1 else work[0].new_tokens
    c = _step_consts(model, hw, par)
    attn_flops, kv, fast = _attention(model, work)
    attn_time = (attn_flops - fast) * c.attn_scale + fast
    extra_s = 0.0
    if par.dp > 1 and new > len(work):            # a chunk of more than one token: busiest rank
        big = max(work, key=_new_tokens)
        attn_linear = _attention_linear(model)
        big_flops, _, big_fast = _attention(model, (big,))
        own = attn_linear * big.new_tokens + ((big_flops - big_fast) * c.attn_scale + big_fast)
        share = (attn_linear * new + attn_time) / par.dp
        if own > share:
            extra_s = (own - share) / par.tp / c.rates[1]
    return _priced(c, new, attn_flops, attn_time, kv, extra_s, new > len(work))


def decode_step_cost(model: ModelProfile, hw: HardwareProfile, par: Parallel, lengths: list[int]) -> StepCost:
    """`step_cost` of one decode (one new token) of each sequence, `lengths` their lengths with
    it (context + 1): the same StepCost to the last bit (tests pin it), without a SeqWork per
    sequence - the simulator's steady decode steps, most of its steps."""
    if not lengths:
        return _IDLE
    attn_flops, kv, fast = _decode_attention(model, lengths)
    c = _step_consts(model, hw, par)
    attn_time = (attn_flops - fast) * c.attn_scale + fast
    return _priced(c, len(lengths), attn_flops, attn_time, kv, 0.0, False)


def _priced(c: _StepConsts, new: int, attn_flops: float, attn_time: float, kv: float, extra_s: float,
            normal: bool) -> StepCost:
    """The StepCost of a step of `new` tokens whose attention is (attn_flops, kv bytes), attn_time
    its FLOPs counted at the GEMMs' peak (the core at the BF16 one: `_attention`).

    FLOPs = 2 * active_params_per_token * T + attention (LM head charged for every new token);
    compute_s = (linear FLOPs + attn_time) / gpus / (peak * efficiency) + `extra_s` (busiest DP
    rank), efficiency compute_efficiency, or for an expert-parallel MoE step the part's MoE
    prefill (a step with a chunk) or decode efficiency;
    memory_s = per-GPU bytes / (hbm_tb_s * 1e12 * bandwidth_efficiency), attention weights read
    per rank (/ tp), other dense weights and routed experts split over all GPUs, KV split over
    dp and over tp only when it has heads (GQA; MLA and V4 latents are replicated per tp GPU);
    an expert-parallel MoE step's weights once per micro-batch (`_StepConsts.by_new`).
    seconds = max(compute_s, memory_s, overlapped comm) + serial comm + step overhead
    (`_StepConsts.by_new` says which communication is which); comm_s is what the two add to
    max(compute_s, memory_s).
    """
    flops = c.linear_per_token * new + attn_flops
    base_bytes, other_bytes, serial_s, wire_s, attn_per_gpu = c.by_new(new, normal)
    nbytes = base_bytes + kv * c.kv_copies
    per_gpu_bytes = attn_per_gpu + (other_bytes + kv * c.kv_copies) / c.gpus
    compute_s = (c.linear_time_per_token * new + attn_time) / c.gpus / c.rates[normal]
    if extra_s:
        compute_s += extra_s
    memory_s = per_gpu_bytes / c.memory_rate
    busy_s = compute_s if compute_s > memory_s else memory_s
    comm_s = serial_s + (wire_s - busy_s if wire_s > busy_s else 0.0)
    return StepCost(
        seconds=busy_s + comm_s + c.overhead_s,
        flops=flops,
        bytes=nbytes,
        compute_s=compute_s,
        memory_s=memory_s,
        comm_s=comm_s,
        bound="network" if wire_s > busy_s else "compute" if compute_s > memory_s else "memory",
    )


@dataclass(frozen=True, slots=True)
class Fit:
    """How one instance's memory divides: per GPU, GB (1e9 B)."""

    weights_gb: float          # weights one GPU holds
    usable_gb: float           # hbm_gb * memory_utilization
    kv_gb: float               # what is left for KV (< 0: the weights do not fit)
    kv_tokens: int             # KV tokens the instance holds (0 when nothing is left)


def memory_fit(model: ModelProfile, hw: HardwareProfile, tp: int | Parallel, memory_utilization: float = 0.9,
               max_seqs: int = 0) -> Fit:
    """Per GPU: attention weights / tp (each attention rank holds a copy) + the other dense
    weights and the routed experts / gpus, the MTP layers' (`ModelProfile.mtp_weight_bytes`;
    every serving recipe of DeepSeek-V3 / V4 loads them for its draft) split the same way;
    what is left holds KV: GQA split over the tp GPUs of a rank, a single latent (MLA, V4)
    replicated on each; V4 first keeps every one of a rank's max_seqs / dp sequences a full
    sliding window (`kv_window_bytes`), then counts tokens at the marginal rate."""
    par = as_parallel(tp)
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    _, attn_bytes, shared_bytes, expert_bytes, kv_split = _per_model(model)
    mtp_attn = model.mtp_attention_weight_bytes
    mtp_rest = model.mtp_weight_bytes - mtp_attn
    weights = ((attn_bytes + mtp_attn) / par.tp
               + (shared_bytes + model.num_moe_layers * model.num_experts * expert_bytes + mtp_rest) / par.gpus)
    usable = hw.hbm_gb * 1e9 * memory_utilization
    free = usable - weights
    tokens = 0
    if free > 0:
        per_rank = free * par.tp if kv_split else free
        per_rank -= -(-max_seqs // par.dp) * model.kv_window_bytes
        tokens = max(0, int(per_rank // model.kv_bytes_per_token)) * par.dp
    return Fit(weights / 1e9, usable / 1e9, free / 1e9, tokens)


def max_kv_tokens(model: ModelProfile, hw: HardwareProfile, tp: int | Parallel, memory_utilization: float = 0.9,
                  max_seqs: int = 0) -> int:
    """KV tokens that fit in one instance after the weights (`memory_fit`); ValueError naming
    the numbers when the weights alone do not fit.  For a dense GQA model on tp GPUs:
    (tp * hbm * util - weight_bytes) // kv_bytes_per_token."""
    par = as_parallel(tp)
    fit = memory_fit(model, hw, par, memory_utilization, max_seqs)
    if fit.kv_gb <= 0:
        mtp = f" + {model.mtp_weight_bytes / 1e9:.1f} GB of MTP layers" if model.num_mtp_layers else ""
        raise ValueError(f"{model.name} weights ({model.weight_bytes / 1e9:.1f} GB{mtp}, "
                         f"{fit.weights_gb:.1f} GB per GPU) "
                         f"do not fit in {par.gpus} x {hw.name} (tp {par.tp} x dp {par.dp}) at "
                         f"{memory_utilization:.0%} of {hw.hbm_gb:g} GB = {fit.usable_gb:.1f} GB per GPU")
    return fit.kv_tokens
