"""A decoder's shape without weights: what FLOPs, bytes and KV the cost model charges it.

`ModelProfile` is a decoder's shape as its Hugging Face `config.json` states it: enough for
FLOPs, bytes and KV size, and for the paged engine's `ModelSpec` (`to_spec`).  Attention:

  gqa  K and V of num_kv_heads x head_dim per token per layer (Llama, Qwen3).
  mla  one latent of kv_lora_rank + a RoPE key of qk_rope_head_dim per token per layer.
  v4   DeepSeek-V4: a `sliding_window` of latent entries per layer, CSA layers (1 entry per
       4 tokens + an indexer key, top-k attended), HCA layers (1 per 128, all attended).
       `kv_bytes(tokens)` is exact, `kv_bytes_per_token` the marginal rate.

MoE layers: `experts_per_token` of `num_experts` routed plus `num_shared_experts`, after
`first_k_dense` dense layers; routed experts may have their own `expert_bytes_per_param`.
`num_mtp_layers` multi-token-prediction layers (DeepSeek-V3 / V4) are held in memory, not run
per step (`mtp_weight_bytes`).

V4-Pro's KV is 5,511.4 B per token at the margin plus 4.56 MB of windows per request; the
often-quoted ~4.4 KB per token leaves out the indexer keys and windows, which a server holds
and a transfer moves too.

Units: FLOP/s and bytes are decimal (1 TB = 1e12 B), as on NVIDIA datasheets; KV sizes are
exact byte counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pddgw.core.errors import check as _check
from pddgw.engines.model_spec import ModelSpec, RopeScaling


# KV entry formats (bytes of one cached entry of one layer), per attention family and KV
# element size (2 = BF16, 1 = FP8):
#   mla FP8: FlashMLA's FP8 KV layout (deepseek-ai/FlashMLA README, "FP8 KV cache"):
#            512 FP8 latent values + 4 float32 scales (one per 128) + 64 BF16 RoPE values
#            = 656 bytes; BF16: (512 + 64) x 2 = 1152.
#   v4  FP8: SGLang's packed DeepSeek-V4 pool (sglang test_dsv4 pool configurator: "Packed
#            FP8 ... 584 bytes"): 448 FP8 no-RoPE values + 64 BF16 RoPE values + 7 UE8M0
#            scales (one per 64) + 1 pad = 584; the indexer's FP8 key 128 + a float32
#            scale = 132.  BF16: 512 x 2 = 1024 and 128 x 2 = 256.
V4_CSA_RATIO = 4       # compressed sparse attention: 1 entry per 4 tokens, top-k by the indexer
V4_HCA_RATIO = 128     # heavily compressed attention: 1 entry per 128 tokens, all attended


def sum_floor(n: int, r: int) -> int:
    """sum over q = 1..n of floor(q / r) (compressed entries seen by queries 1..n)."""
    if n <= 0:
        return 0
    m, rem = divmod(n, r)
    return r * m * (m - 1) // 2 + m * (rem + 1)


def sum_floor_capped(n: int, r: int, cap: int) -> int:
    """sum over q = 1..n of min(floor(q / r), cap): a top-k never selects more than cap entries."""
    edge = r * cap - 1                  # the last q with floor(q / r) < cap
    if n <= edge:
        return sum_floor(n, r)
    return sum_floor(edge, r) + cap * (n - edge)


def sum_min(n: int, w: int) -> int:
    """sum over q = 1..n of min(q, w) (window entries seen by queries 1..n)."""
    if n <= w:
        return n * (n + 1) // 2
    return w * (w + 1) // 2 + w * (n - w)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int         # dense MLP (every layer of a dense model, the first_k_dense of a MoE)
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    arch: Literal["llama", "qwen3"]     # llama: plain; qwen3: per-head RMSNorm on q and k
    rope_theta: float
    rms_norm_eps: float
    num_experts: int = 0           # MoE: routed experts (0 = dense)
    experts_per_token: int = 0     # MoE: active routed experts per token
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0    # MoE: experts every token visits (moe_intermediate_size each)
    first_k_dense: int = 0         # MoE: the first k layers have a dense MLP (first_k_dense_replace)
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    weight_bytes_per_param: float = 2.0   # bf16; FP8 = 1
    # Routed experts' bytes per parameter when they differ (FP4 = 0.5 + one UE8M0 scale per
    # 32 = 0.53125); 0 = weight_bytes_per_param.
    expert_bytes_per_param: float = 0.0
    kv_bytes_per_value: int = 2       # bf16 KV cache; 1 = FP8
    attention: Literal["gqa", "mla", "v4"] = "gqa"
    # mla / v4 projections
    q_lora_rank: int = 0
    kv_lora_rank: int = 0          # mla latent width
    qk_nope_head_dim: int = 0      # mla
    qk_rope_head_dim: int = 0      # mla and v4 (the RoPE part of a key)
    v_head_dim: int = 0            # mla
    # v4: per layer 0 (window only), 4 (CSA) or 128 (HCA); window, indexer, grouped output
    compress_ratios: tuple[int, ...] = ()
    sliding_window: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    o_lora_rank: int = 0
    o_groups: int = 0
    # Multi-token-prediction layers (config.json num_nextn_predict_layers): weights every serving
    # recipe loads for its draft, not counted in weight_bytes (the main model's).
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        _check(bool(self.name), "name must not be empty")
        _check(self.arch in ("llama", "qwen3"), f"arch must be 'llama' or 'qwen3', got {self.arch!r}")
        _check(self.attention in ("gqa", "mla", "v4"), f"attention must be gqa, mla or v4, got {self.attention!r}")
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                  "max_position_embeddings", "weight_bytes_per_param"):
            _check(getattr(self, f) > 0, f"{f} must be > 0")
        _check(self.kv_bytes_per_value in (1, 2), f"kv_bytes_per_value must be 1 (FP8) or 2 (BF16), "
                                                  f"got {self.kv_bytes_per_value}")
        _check(self.expert_bytes_per_param >= 0, "expert_bytes_per_param must be >= 0")
        _check(self.num_mtp_layers >= 0, "num_mtp_layers must be >= 0")
        _check(self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        if self.num_experts:
            _check(0 < self.experts_per_token <= self.num_experts,
                   "experts_per_token must be in [1, num_experts]")
            _check(self.moe_intermediate_size > 0, "moe_intermediate_size must be > 0 for a MoE model")
            _check(0 <= self.first_k_dense < self.num_layers, "first_k_dense must be in [0, num_layers)")
            _check(self.num_shared_experts >= 0, "num_shared_experts must be >= 0")
            _check(not self.first_k_dense or self.intermediate_size > 0,
                   "first_k_dense layers need intermediate_size > 0")
        else:
            _check(self.experts_per_token == 0 and self.moe_intermediate_size == 0
                   and self.num_shared_experts == 0 and self.first_k_dense == 0,
                   "experts_per_token, moe_intermediate_size, num_shared_experts and first_k_dense "
                   "need num_experts > 0")
            _check(self.intermediate_size > 0, "intermediate_size must be > 0")
        if self.attention == "mla":
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                _check(getattr(self, f) > 0, f"{f} must be > 0 for MLA")
        if self.attention == "v4":
            _check(len(self.compress_ratios) == self.num_layers,
                   f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_layers} layers")
            bad = sorted(set(self.compress_ratios) - {0, V4_CSA_RATIO, V4_HCA_RATIO})
            _check(not bad, f"compress_ratios: unsupported ratios {bad} (supported: 0, 4, 128)")
            for f in ("sliding_window", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups"):
                _check(getattr(self, f) > 0, f"{f} must be > 0 for DeepSeek-V4 attention")
            _check(self.qk_rope_head_dim < self.head_dim, "qk_rope_head_dim must be < head_dim")
            if V4_CSA_RATIO in self.compress_ratios:
                for f in ("index_n_heads", "index_head_dim", "index_topk"):
                    _check(getattr(self, f) > 0, f"{f} must be > 0 for CSA layers")

    # ---- parameters (every MLP is SwiGLU: gate, up, down) ------------------------------
    @property
    def _attention_params(self) -> int:
        """Attention projections (no bias) and their norms, per layer (v4: the mean over layers
        of q, kv, grouped output and, on CSA layers, the indexer's query and weight projections;
        the compressors' and hyper-connection mixers' small matrices are left out)."""
        d = self.hidden_size
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * qk
                 if self.q_lora_rank else d * self.num_heads * qk)
            kv = (d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
            return q + kv + self.num_heads * self.v_head_dim * d
        if self.attention == "v4":
            csa = sum(r == V4_CSA_RATIO for r in self.compress_ratios)
            indexer = self.q_lora_rank * self.index_n_heads * self.index_head_dim + d * self.index_n_heads
            return self._v4_window_attention_params + (csa * indexer) // self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        norms = 2 * self.head_dim if self.arch == "qwen3" else 0
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size + norms

    @property
    def _v4_window_attention_params(self) -> int:
        """A DeepSeek-V4 layer's q, kv and grouped output projections, without the CSA indexer."""
        d, hd = self.hidden_size, self.head_dim
        q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * hd
        kv = d * hd + hd
        return q + kv + self.num_heads * hd * self.o_lora_rank + self.o_groups * self.o_lora_rank * d

    @property
    def _expert_params(self) -> int:
        """One routed (or shared) expert's SwiGLU MLP."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.num_experts else 0

    @property
    def _dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def _moe_layer_fixed_params(self) -> int:
        """Per MoE layer: the shared experts and the router."""
        return self.num_shared_experts * self._expert_params + self.hidden_size * self.num_experts

    @property
    def _embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every MoE layer."""
        return self.num_moe_layers * self.num_experts * self._expert_params

    @property
    def param_count(self) -> int:
        """All parameters: embedding, layers (2 RMSNorms each), final norm, LM head unless tied."""
        mlps = ((self.num_layers - self.num_moe_layers) * self._dense_mlp_params
                + self.num_moe_layers * self._moe_layer_fixed_params + self.routed_expert_params)
        layers = self.num_layers * (self._attention_params + 2 * self.hidden_size) + mlps
        head = 0 if self.tie_word_embeddings else self._embedding_params
        return self._embedding_params + layers + self.hidden_size + head

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token multiplies with: everything but the embedding table (a
        lookup) and the routed experts it does not visit; the LM head counts (tied or not)."""
        inactive = self.num_moe_layers * (self.num_experts - self.experts_per_token) * self._expert_params
        lookup = 0 if self.tie_word_embeddings else self._embedding_params
        return self.param_count - lookup - inactive

    @property
    def expert_bytes(self) -> float:
        """Bytes of one routed expert's weights."""
        return self._expert_params * (self.expert_bytes_per_param or self.weight_bytes_per_param)

    @property
    def weight_bytes(self) -> int:
        """All weights: routed experts at their precision, the rest at weight_bytes_per_param."""
        rest = (self.param_count - self.routed_expert_params) * self.weight_bytes_per_param
        return round(rest + self.num_moe_layers * self.num_experts * self.expert_bytes)

    @property
    def dense_weight_bytes(self) -> float:
        """Weights every step reads whatever its tokens: all but the routed experts."""
        return self.weight_bytes - self.num_moe_layers * self.num_experts * self.expert_bytes

    @property
    def attention_weight_bytes(self) -> float:
        """Every layer's attention projections and norms: what DP-attention replicates on each
        attention rank (embeddings, dense MLPs and experts are split over all the GPUs)."""
        return self.num_layers * (self._attention_params + 2 * self.hidden_size) * self.weight_bytes_per_param

    @property
    def mtp_attention_weight_bytes(self) -> float:
        """The MTP layers' attention projections and their two norms (a V4 MTP layer is
        window-only: no indexer), replicated on each attention rank as the main layers'."""
        attn = self._v4_window_attention_params if self.attention == "v4" else self._attention_params
        return self.num_mtp_layers * (attn + 2 * self.hidden_size) * self.weight_bytes_per_param

    @property
    def mtp_weight_bytes(self) -> float:
        """Every MTP layer's weights: DeepSeek-V3 technical report (arXiv 2412.19437, sec. 2.2),
        a transformer block (attention and a MoE layer like the main ones, routed experts at their
        precision), the projection of [hidden; embedding] (2 hidden x hidden) and three RMSNorms;
        the embedding and output head are the main model's (shared), so not counted again (the
        checkpoint's ~14B MTP parameters of V3 include copies of them)."""
        if not self.num_mtp_layers:
            return 0.0
        d = self.hidden_size
        mlp = self._moe_layer_fixed_params if self.num_experts else self._dense_mlp_params
        rest = (2 * d * d + 3 * d + mlp) * self.weight_bytes_per_param + self.num_experts * self.expert_bytes
        return self.mtp_attention_weight_bytes + self.num_mtp_layers * rest

    @property
    def fp8_compute(self) -> bool:
        """Whether the GEMMs run on FP8 tensor cores: the checkpoint ships FP8 (or FP4) weights."""
        return self.weight_bytes_per_param < 1.5      # FP8 (with its block scales) or FP4

    # ---- KV ------------------------------------------------------------------------------
    @property
    def _v4_entry_bytes(self) -> int:
        if self.kv_bytes_per_value == 1:
            nope = self.head_dim - self.qk_rope_head_dim
            return nope + 2 * self.qk_rope_head_dim + nope // 64 + 1
        return 2 * self.head_dim

    @property
    def _v4_index_bytes(self) -> int:
        return self.index_head_dim + 4 if self.kv_bytes_per_value == 1 else 2 * self.index_head_dim

    @property
    def kv_entry_bytes(self) -> int:
        """One cached entry of one layer: a token's K and V (gqa), its latent (mla), or one
        window / compressed entry (v4)."""
        if self.attention == "mla":
            if self.kv_bytes_per_value == 1:
                return self.kv_lora_rank + 4 * (self.kv_lora_rank // 128) + 2 * self.qk_rope_head_dim
            return 2 * (self.kv_lora_rank + self.qk_rope_head_dim)
        if self.attention == "v4":
            return self._v4_entry_bytes
        return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value

    @property
    def kv_bytes_per_token(self) -> float:
        """Marginal KV bytes of one more token over all layers: exact for gqa and mla (an int);
        for v4 the compressed entries' and indexer keys' share per token (the window is a
        fixed amount per request, `kv_window_bytes`)."""
        if self.attention != "v4":
            return self.num_layers * self.kv_entry_bytes
        e, i = self._v4_entry_bytes, self._v4_index_bytes
        csa, hca = self._v4_layers
        return csa * (e + i) / V4_CSA_RATIO + hca * e / V4_HCA_RATIO

    @property
    def _v4_layers(self) -> tuple[int, int]:
        """(CSA layers, HCA layers); counted in C, the sim asks every step."""
        return self.compress_ratios.count(V4_CSA_RATIO), self.compress_ratios.count(V4_HCA_RATIO)

    @property
    def kv_window_bytes(self) -> int:
        """v4: every layer's full sliding window (0 for gqa and mla)."""
        return self.num_layers * self.sliding_window * self._v4_entry_bytes if self.attention == "v4" else 0

    def kv_bytes(self, tokens: int) -> int:
        """Exact KV bytes of one sequence of `tokens` tokens."""
        if self.attention != "v4":
            return tokens * self.num_layers * self.kv_entry_bytes
        e, i = self._v4_entry_bytes, self._v4_index_bytes
        csa, hca = self._v4_layers
        return (self.num_layers * min(tokens, self.sliding_window) * e
                + csa * (tokens // V4_CSA_RATIO) * (e + i) + hca * (tokens // V4_HCA_RATIO) * e)

    def kv_read_bytes(self, context: int, new: int) -> int:
        """KV bytes one step reads and writes for a sequence computing `new` tokens after
        `context` cached ones.  gqa / mla: all of its KV (kv_bytes(context + new)).  v4: the
        window it sees, every compressed HCA entry and CSA indexer key, but of the CSA
        entries only the top-k each new token selects (at most all of them)."""
        total = context + new
        if self.attention != "v4":
            return self.kv_bytes(total)
        e, i = self._v4_entry_bytes, self._v4_index_bytes
        csa, hca = self._v4_layers
        entries = total // V4_CSA_RATIO
        return (self.num_layers * min(total, self.sliding_window + new - 1) * e
                + csa * (entries * i + min(entries, self.index_topk * new) * e)
                + hca * (total // V4_HCA_RATIO) * e)

    # ---- attention FLOPs -------------------------------------------------------------------
    def attention_flops(self, context: int, new: int) -> float:
        """QK^T and PV FLOPs (2 per multiply-add) of `new` tokens on top of `context` cached
        ones, over all layers; query q (1-based position context + 1 .. context + new) sees
        q tokens causally.
          gqa  4 * L * H * d per (query, key) pair
          mla  2 * L * H * (qk_nope + qk_rope + v_head) per pair (the MHA form prefill runs)
          v4   2 * H * 2 * head_dim per attended entry (K and V are the one 512-wide latent):
               every layer min(q, window) window entries; CSA min(q // 4, index_topk) selected
               entries plus the indexer scoring all q // 4 with index_n_heads x index_head_dim
               (2 FLOPs per multiply-add); HCA all q // 128 entries."""
        if new <= 0:
            return 0.0
        lo, hi = context, context + new
        if self.attention != "v4":
            pairs = new * context + new * (new + 1) / 2
            if self.attention == "mla":
                per_pair = 2 * self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
            else:
                per_pair = 4 * self.num_heads * self.head_dim
            return float(self.num_layers * per_pair * pairs)
        per_entry = 4 * self.num_heads * self.head_dim
        window = sum_min(hi, self.sliding_window) - sum_min(lo, self.sliding_window)
        csa, hca = self._v4_layers
        c, h, k = V4_CSA_RATIO, V4_HCA_RATIO, self.index_topk
        seen = sum_floor(hi, c) - sum_floor(lo, c)                  # CSA entries the indexer scores
        entries = (self.num_layers * window
                   + csa * (sum_floor_capped(hi, c, k) - sum_floor_capped(lo, c, k))
                   + hca * (sum_floor(hi, h) - sum_floor(lo, h)))
        return float(per_entry * entries + 2 * self.index_n_heads * self.index_head_dim * csa * seen)

    # ---- the paged engine's view -------------------------------------------------------------
    @property
    def wire_kv_layout(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of a BF16 KV layout whose bytes per token equal this
        model's: the real one for gqa at BF16; for the rest one KV "head" whose width carries
        the bytes (mla: per layer, exact; v4: one layer of the marginal rate, rounded to 8
        bytes).  Links charge a virtual chunk by it, the router estimates missing KV by it."""
        if self.attention == "gqa":
            if self.kv_bytes_per_value == 2:
                return self.num_layers, self.num_kv_heads, self.head_dim
            return self.num_layers, self.num_kv_heads, self.head_dim // 2
        if self.attention == "mla":
            _check(self.kv_entry_bytes % 4 == 0, f"{self.name}: MLA entry of {self.kv_entry_bytes} B "
                                                 "is not a whole BF16 K/V pair")
            return self.num_layers, 1, self.kv_entry_bytes // 4
        return 1, 1, 2 * max(1, round(self.kv_bytes_per_token / 8))

    def to_spec(self) -> ModelSpec:
        """The paged engine's view of this model.  A dense BF16-KV gqa model's spec is its
        own; otherwise the spec carries `wire_kv_layout` (the cost-model engine needs block
        sizes, token ids and KV bytes, not the layers' math) and a MoE's MLP width is its
        expert's."""
        layers, kv_heads, head_dim = self.wire_kv_layout
        own = (layers, kv_heads, head_dim) == (self.num_layers, self.num_kv_heads, self.head_dim)
        return ModelSpec(
            arch=self.arch,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size or self.moe_intermediate_size,
            num_layers=layers,
            num_heads=self.num_heads if own else kv_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=False,
            qk_norm=self.arch == "qwen3",
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_ids=self.eos_token_ids,
        )
