"""Llama-family decoder in plain torch (Llama, Qwen2, Qwen3, Mistral, tiny).

One decoder layer: RMSNorm -> fused qkv projection (+bias) -> optional per-head
q/k RMSNorm (Qwen3) -> RoPE -> attention -> o_proj -> residual; RMSNorm ->
fused gate_up projection -> SiLU(gate) * up -> down -> residual.

Numerics follow `transformers` so logits match it: RMSNorm in float32
(float64 for a float64 model) cast back before the weight multiply; RoPE in
the "rotate half" pairing, cos/sin computed in float64, stored in the model dtype.

`forward` runs a packed batch against the paged KV cache (the engine);
`forward_dense` recomputes one sequence with dense causal attention and no
cache (the naive reference in `naive.py`).  Weights live in fused tensors;
`hf_tensors` exposes them as views under their Hugging Face names, the only
naming map.  `prepack` keeps oneDNN copies of the GEMM weights on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pddgw.engines.attention import AttnMetadata, paged_attention
from pddgw.engines.model_spec import ModelSpec, RopeScaling
from pddgw.kernels import cpu_linear, cpu_pointwise
from pddgw.kernels.cpu_linear import Packed


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / logits dtype for a model dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] normalized over the last dim in float32 (HF order: cast back, then scale)."""
    if x.dtype in (torch.float32, torch.float64) and weight.dtype == x.dtype:
        # No casts to place: torch's rms_norm computes the same products (bit-equal on
        # CPU) in fewer dispatches.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if (fused := cpu_pointwise.rms_norm(x, weight, eps)) is not None:     # bfloat16 on the CPU, same bits
        return fused
    xf = x.to(acc_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> SiLU(gate) * up [T, I]; one pass in C for bfloat16 on the CPU
    (`cpu_pointwise.silu_mul`, the same bits)."""
    if (fused := cpu_pointwise.silu_mul(gate_up)) is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float64, with Llama-3 scaling if given."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    # Long wavelengths (beyond the pretraining context) are stretched by
    # `factor`, short ones kept, the band between blended linearly.
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated at the positions whose cos/sin [T, D/2] are given."""
    return rope_rotate(x, *rope_tables(cos, sin))


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D/2] -> the full-width factors [T, 1, D] of `rope_rotate`: [c, c], [-s, s]."""
    return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]


def rope_rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> rotate-half RoPE: [x1 c - x2 s, x2 c + x1 s] (halves x1, x2 of D).

    Written as x * [c, c] + roll(x) * [-s, s], which rounds exactly like the halves
    (negation is exact, a + (-b) == a - b): four ops instead of eight; one pass in C for
    bfloat16 on the CPU (`cpu_pointwise.rope`, the same bits)."""
    if (fused := cpu_pointwise.rope(x, cos2, sin2)) is not None:
        return fused
    return x * cos2 + x.roll(x.shape[-1] // 2, -1) * sin2


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [L, H, D], k/v [L, KVH, D] of one whole sequence -> [L, H, D].

    Accumulates like the reference paged kernels (float32, float64 for float64)."""
    acc = acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    kf = k.to(acc).repeat_interleave(group, dim=1)             # [L, H, D]
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), kf) * scale   # [H, L, L]
    n = q.shape[0]
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)   # [L, L]
    scores = scores.masked_fill(future[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
           packed: Packed | torch.Tensor | None, add: torch.Tensor | None = None) -> torch.Tensor:
    """add [T, N] + x [T, K] @ w [N, K]^T (+ b [N]) -> [T, N] (add None: no residual).

    With `packed` (`pack_weight`): bfloat16 on AMX tiles (`cpu_linear`, the residual added in
    the same pass with the same two roundings as a separate add), else through oneDNN; in
    float32 oneDNN fuses the residual into the GEMM, which rounds exactly as the separate add
    does.  (In bfloat16 oneDNN's fused add would skip the rounding of the product to bfloat16
    that transformers does, so it stays separate there.)"""
    if isinstance(packed, cpu_linear.Packed):
        if x.dtype == torch.bfloat16:
            return cpu_linear.linear(x if x.stride(-1) == 1 else x.contiguous(), packed, b, add)
        y = F.linear(x, w, b)
    elif packed is None:
        y = F.linear(x, w, b)
    elif add is not None and x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise.binary(x, add, packed, b, "add")
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    return y if add is None else add + y


def pack_weight(w: torch.Tensor) -> Packed | torch.Tensor | None:
    """w [N, K] -> a copy packed for any number of rows: for AMX tiles (`cpu_linear.pack`: bfloat16
    on a CPU with AMX-BF16), else oneDNN's; None where there is none (not CPU, no oneDNN, a dtype
    it has no GEMM for on this CPU)."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    if (tiles := cpu_linear.pack(w)) is not None:
        return tiles
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        with torch.no_grad():
            return torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
    except RuntimeError:           # e.g. bfloat16 without AVX512-BF16 / AMX support
        return None


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place write counter (None for inference tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _param(*shape: int, dtype: torch.dtype, device: torch.device, fill: float | None = None
           ) -> nn.Parameter:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if fill is not None:
        t.fill_(fill)
    return nn.Parameter(t, requires_grad=False)


class DecoderLayer(nn.Module):
    """Weights of one layer, in the fused layout the forward uses."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        p = dict(dtype=dtype, device=device)
        h, qkv = spec.hidden_size, spec.q_size + 2 * spec.kv_size
        self.input_norm = _param(h, fill=1.0, **p)
        self.qkv_w = _param(qkv, h, **p)                        # rows: q | k | v
        self.qkv_b = _param(qkv, **p) if spec.attention_bias else None
        self.q_norm = _param(spec.head_dim, fill=1.0, **p) if spec.qk_norm else None
        self.k_norm = _param(spec.head_dim, fill=1.0, **p) if spec.qk_norm else None
        self.o_w = _param(h, spec.q_size, **p)
        self.o_b = _param(h, **p) if spec.o_proj_bias else None
        self.post_norm = _param(h, fill=1.0, **p)
        self.gate_up_w = _param(2 * spec.intermediate_size, h, **p)   # rows: gate | up
        self.down_w = _param(h, spec.intermediate_size, **p)
        # Packed copies (`LlamaModel.prepack`), plain attributes: not in the state.
        self.qkv_pk = self.o_pk = self.gate_up_pk = self.down_pk = None


# attend(layer_index, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LlamaModel(nn.Module):
    """A Llama-family decoder whose weights are filled by `weights.py`.

    The constructor allocates uninitialised weights (norms are ones); use
    `weights.load_model` / `weights.build_tiny` to get a usable model.
    Positions must be < `spec.max_position_embeddings` (the RoPE table size);
    the engine caps context length accordingly.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise ValueError(f"unsupported model dtype {dtype}")
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        p = dict(dtype=dtype, device=self.device)
        self.embed = _param(spec.vocab_size, spec.hidden_size, **p)
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype, self.device)
                                    for _ in range(spec.num_layers))
        self.norm = _param(spec.hidden_size, fill=1.0, **p)
        self.lm_head_w = None if spec.tie_word_embeddings else _param(
            spec.vocab_size, spec.hidden_size, **p)
        self.lm_head_pk: Packed | torch.Tensor | None = None   # packed lm_head (`prepack`)
        self._packed_versions: dict[str, int] = {}    # weight name -> its _version when packed
        self.scale = spec.head_dim ** -0.5
        inv = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)   # [D/2]
        ang = torch.arange(spec.max_position_embeddings, dtype=torch.float64)[:, None] * inv
        # [P, D/2]; stored in the model dtype, as HF casts cos/sin to the activations' dtype.
        self.register_buffer("rope_cos", ang.cos().to(device=self.device, dtype=dtype),
                             persistent=False)
        self.register_buffer("rope_sin", ang.sin().to(device=self.device, dtype=dtype),
                             persistent=False)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.embed if self.lm_head_w is None else self.lm_head_w

    # ---- prepacked weights -------------------------------------------------------------
    def _packable(self) -> list[tuple[object, str, torch.Tensor]]:
        """(owner, packed attribute, weight) of every GEMM weight."""
        out: list[tuple[object, str, torch.Tensor]] = []
        for L in self.layers:
            out += [(L, "qkv_pk", L.qkv_w), (L, "o_pk", L.o_w), (L, "gate_up_pk", L.gate_up_w),
                    (L, "down_pk", L.down_w)]
        out.append((self, "lm_head_pk", self.lm_head))
        return out

    def prepack(self) -> bool:
        """Prepack every GEMM weight (`pack_weight`: AMX tiles or oneDNN) where it can be (CPU,
        float32 / bfloat16); repacks only weights written since they were packed.  -> whether the forward now
        uses packed weights (False: nothing packable, `F.linear` throughout).

        Why: at decode sizes MKL's sgemm (plain `F.linear`) reads a row-major weight
        1.5-2.5x slower than oneDNN from its blocked layout (measured at M = 8..32).  The
        packed copies double the GEMM weights' host memory; results agree with `F.linear`
        to float rounding, not bit for bit.  Weights written later need another `prepack`.
        """
        packed = False
        for i, (owner, attr, w) in enumerate(self._packable()):
            key, version = f"{i}.{attr}", _version(w)
            if (getattr(owner, attr) is not None and version is not None
                    and self._packed_versions.get(key) == version):
                packed = True
                continue
            pk = pack_weight(w)
            setattr(owner, attr, pk)
            if pk is None:
                self._packed_versions.pop(key, None)
            else:
                self._packed_versions[key] = version
                packed = True
        return packed

    @property
    def is_prepacked(self) -> bool:
        return self.lm_head_pk is not None or any(L.qkv_pk is not None for L in self.layers)

    def unpack(self) -> None:
        """Drop the packed copies: `F.linear` on the plain weights again."""
        for owner, attr, _w in self._packable():
            setattr(owner, attr, None)
        self._packed_versions.clear()

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Views of every weight under its Hugging Face name (copy into them to load)."""
        s = self.spec
        q, kv, inter = s.q_size, s.kv_size, s.intermediate_size
        out = {"model.embed_tokens.weight": self.embed}
        for i, L in enumerate(self.layers):
            pre = f"model.layers.{i}."
            out[pre + "input_layernorm.weight"] = L.input_norm
            out[pre + "self_attn.q_proj.weight"] = L.qkv_w[:q]
            out[pre + "self_attn.k_proj.weight"] = L.qkv_w[q:q + kv]
            out[pre + "self_attn.v_proj.weight"] = L.qkv_w[q + kv:]
            if L.qkv_b is not None:
                out[pre + "self_attn.q_proj.bias"] = L.qkv_b[:q]
                out[pre + "self_attn.k_proj.bias"] = L.qkv_b[q:q + kv]
                out[pre + "self_attn.v_proj.bias"] = L.qkv_b[q + kv:]
            if L.q_norm is not None:
                out[pre + "self_attn.q_norm.weight"] = L.q_norm
                out[pre + "self_attn.k_norm.weight"] = L.k_norm
            out[pre + "self_attn.o_proj.weight"] = L.o_w
            if L.o_b is not None:
                out[pre + "self_attn.o_proj.bias"] = L.o_b
            out[pre + "post_attention_layernorm.weight"] = L.post_norm
            out[pre + "mlp.gate_proj.weight"] = L.gate_up_w[:inter]
            out[pre + "mlp.up_proj.weight"] = L.gate_up_w[inter:]
            out[pre + "mlp.down_proj.weight"] = L.down_w
        out["model.norm.weight"] = self.norm
        if self.lm_head_w is not None:
            out["lm_head.weight"] = self.lm_head_w
        return out

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """h [T, hidden] embeddings at positions [T] -> final hidden states [T, hidden]."""
        s = self.spec
        T = h.shape[0]
        cos2, sin2 = rope_tables(self.rope_cos[positions], self.rope_sin[positions])   # [T, 1, D]
        heads = s.num_heads + s.num_kv_heads
        for i, L in enumerate(self.layers):
            x = rms_norm(h, L.input_norm, s.rms_norm_eps)
            qkv = linear(x, L.qkv_w, L.qkv_b, L.qkv_pk)          # [T, q + 2 kv]
            v = qkv[:, s.q_size + s.kv_size:].view(T, s.num_kv_heads, s.head_dim)   # [T, KVH, D]
            if L.q_norm is None:
                # q | k rotated together: one pass over [T, H + KVH, D], then views.
                qk = rope_rotate(qkv[:, : s.q_size + s.kv_size].view(T, heads, s.head_dim), cos2, sin2)
                q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]     # [T, H, D], [T, KVH, D]
            else:
                q = qkv[:, : s.q_size].view(T, s.num_heads, s.head_dim)                   # [T, H, D]
                k = qkv[:, s.q_size : s.q_size + s.kv_size].view(T, s.num_kv_heads, s.head_dim)
                q = rope_rotate(rms_norm(q, L.q_norm, s.rms_norm_eps), cos2, sin2)
                k = rope_rotate(rms_norm(k, L.k_norm, s.rms_norm_eps), cos2, sin2)
            o = attend(i, q, k, v)                               # [T, H, D]
            h = linear(o.reshape(T, s.q_size), L.o_w, L.o_b, L.o_pk, add=h)     # residual
            x = rms_norm(h, L.post_norm, s.rms_norm_eps)
            act = silu_mul(linear(x, L.gate_up_w, None, L.gate_up_pk))    # [T, 2I] -> [T, I]
            h = linear(act, L.down_w, None, L.down_pk, add=h)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [S, hidden] -> logits [S, vocab] in float32 (float64 for a float64 model)."""
        x = rms_norm(h, self.norm, self.spec.rms_norm_eps)
        return linear(x, self.lm_head, None, self.lm_head_pk).to(acc_dtype(self.dtype))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """One engine step over a packed batch.

        input_ids [T] int64, positions [T] int64 (absolute), meta describes where
        the T rows live in the paged cache, kv_caches[layer] = (k, v) each
        [num_blocks, block_size, KVH, D]; returns logits [S, vocab] of the rows
        logits_indices [S].
        """
        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = kv_caches[i]
            return paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)

        h = self._layers(self.embed[input_ids], positions, attend)   # [T, hidden]
        return self._logits(h[logits_indices])                       # [S, vocab]

    @torch.no_grad()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [L] of one sequence from position 0 -> logits [L, vocab]; no cache."""
        n = input_ids.shape[0]
        if n > self.spec.max_position_embeddings:
            raise ValueError(f"sequence of {n} tokens exceeds max_position_embeddings "
                             f"{self.spec.max_position_embeddings}")
        positions = torch.arange(n, device=self.device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return dense_causal_attention(q, k, v, self.scale)

        return self._logits(self._layers(self.embed[input_ids], positions, attend))
