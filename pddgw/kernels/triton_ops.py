"""Triton paged-attention kernels (same names and signatures as `reference`).

Shapes:
  caches        [num_blocks, block_size, kv_heads, head_dim]   float32 / float16 / bfloat16
  block_tables  [B, max_blocks] int32 (entries past a sequence's length are never read)
  seq_lens      [B] int32, tokens in cache per sequence, new ones included (>= 1)
  cu_q_lens     [B+1] int32, row ranges of each sequence's new tokens in the packed q

One forward kernel serves decode and extend.  A program owns one tile of
query rows (token, GQA head) of one sequence and one KV head, so query heads
sharing a KV head read each K/V tile once; it walks its KV range through the
block table with an online softmax in float32.  Flash-decoding splits the KV
range into `num_splits` partitions (grid axis 2), merged by a second kernel.

Invariants: nothing syncs with the host (grids come from shapes alone, extends
find their sequence by a binary search on the device), so a plan depends on
shapes only (CUDA-graph replayable); a sequence's length is bounded by
block_tables' width x block_size.  float32 caches compute in IEEE float32;
float16/bfloat16 feed the tensor cores in the cache dtype and accumulate in
float32.  Under TRITON_INTERPRET=1 loads are upcast to float32 (the
interpreter's bfloat16 arithmetic is wrong).  Addresses are int64.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Split partials are float32 [T, H, splits, D]; cap their size (elements).
_MAX_PARTIAL_ELEMS = 1 << 26


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------- kernels


@triton.jit
def _store_kv_kernel(K, V, K_CACHE, V_CACHE, SLOTS,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch,
                     stride_vcb, stride_vcs, stride_vch,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     H_P2: tl.constexpr, D_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t)                                   # int64, -1 = skip
    keep = slot >= 0
    slot = tl.where(keep, slot, 0)
    page = slot // BLOCK_SIZE
    in_page = slot % BLOCK_SIZE
    # A skipped token masks every head; folded into a bound because the 3.9
    # interpreter mis-types `scalar bool & tensor bool`.
    heads = tl.where(keep, KV_HEADS, 0)
    h = tl.arange(0, H_P2)
    d = tl.arange(0, D_P2)
    mask = (h < heads)[:, None] & (d < HEAD_DIM)[None, :]   # [H_P2, D_P2]
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = K_CACHE + page * stride_kcb + in_page * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = V_CACHE + page * stride_vcb + in_page * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(kc, k.to(K_CACHE.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(V_CACHE.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(acc, l_i, m_i, q, K, V, bt_row, kv_start, kv_hi, pos, k_head, v_head,
                 stride_kb, stride_ks, stride_vb, stride_vs, stride_btn, qk_scale, offs_d,
                 HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    """One BLOCK_N tile of keys/values for all BLOCK_M rows; returns the updated
    (acc [BLOCK_M, D_P2], l_i [BLOCK_M], m_i [BLOCK_M]).  MASKED=False only for
    tiles every row may see whole (no bounds, no causal mask)."""
    kv = kv_start + tl.arange(0, BLOCK_N)                        # [BLOCK_N] key positions
    if MASKED:
        kv_ok = kv < kv_hi
        page = tl.load(bt_row + (kv // BLOCK_SIZE) * stride_btn, mask=kv_ok, other=0)
    else:
        page = tl.load(bt_row + (kv // BLOCK_SIZE) * stride_btn)
    page = page.to(tl.int64)
    in_page = (kv % BLOCK_SIZE).to(tl.int64)
    k_ptrs = K + k_head + page[:, None] * stride_kb + in_page[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V + v_head + page[:, None] * stride_vb + in_page[:, None] * stride_vs + offs_d[None, :]
    if MASKED:
        ld_mask = kv_ok[:, None]
        if D_P2 != HEAD_DIM:
            ld_mask = ld_mask & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=ld_mask, other=0.0)             # [BLOCK_N, D_P2]
        v = tl.load(v_ptrs, mask=ld_mask, other=0.0)
    elif D_P2 != HEAD_DIM:
        k = tl.load(k_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")      # [BLOCK_M, BLOCK_N]
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale
    if MASKED:
        qk = tl.where(kv_ok[None, :] & (kv[None, :] <= pos[:, None]), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(qk - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _find_seq(CUMS, x, num_seqs, LOG_B: tl.constexpr):
    """The last b in [0, num_seqs) with CUMS[b] <= x: the sequence whose range [CUMS[b],
    CUMS[b + 1]) of per-sequence offsets (tiles or packed rows; nondecreasing) holds x when
    x < CUMS[num_seqs].  A binary search of LOG_B steps, 2^LOG_B >= num_seqs."""
    lo = x * 0
    hi = lo + num_seqs
    for _ in tl.static_range(LOG_B):
        mid = (lo + hi) // 2
        right = tl.load(CUMS + mid) <= x
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


# Runtime ints that change from call to call are not specialized (no recompiles
# when the batch, the table width or the split changes).
@triton.jit(do_not_specialize=["stride_btb", "num_seqs", "num_splits", "part_size"])
def _attn_fwd_kernel(Q, K, V, BLOCK_TABLES, SEQ_LENS, CU_Q, CU_TILES, OUT, MID_O, MID_LSE,
                     stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_btb, stride_btn,
                     stride_ot, stride_oh,
                     num_seqs, num_splits, part_size, qk_scale,
                     GROUP: tl.constexpr, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     D_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, IS_DECODE: tl.constexpr, SPLIT: tl.constexpr,
                     DOT_F32: tl.constexpr, LOG_B: tl.constexpr):
    TOKS: tl.constexpr = BLOCK_M // GROUP                        # query tokens per tile
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if IS_DECODE:
        b = tile
        q_start = tile
        q_len = tile * 0 + 1
        q0 = tile * 0
        tile_ok = tile >= 0                                      # the decode grid is exact
    else:
        # Sequence b owns tiles [CU_TILES[b], CU_TILES[b+1]); programs past the
        # last tile (the grid is an upper bound) do nothing.
        b = _find_seq(CU_TILES, tile, num_seqs, LOG_B)
        tile_ok = tile < tl.load(CU_TILES + num_seqs)
        q_start = tl.load(CU_Q + b)
        # A program past the last tile gets no rows (q_len = 0) and no keys.
        q_len = tl.where(tile_ok, tl.load(CU_Q + b + 1) - q_start, 0)
        q0 = (tile - tl.load(CU_TILES + b)) * TOKS
    seq_len = tl.load(SEQ_LENS + b)
    prefix = seq_len - q_len                                     # cached tokens before the new ones

    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP                        # [BLOCK_M] query head of each row
    row_ok = (tok < TOKS) & (q0 + tok < q_len)
    pos = prefix + q0 + tok                                      # [BLOCK_M] absolute position
    t_idx = (q_start + q0 + tok).to(tl.int64)                    # [BLOCK_M] packed row in q / out
    offs_d = tl.arange(0, D_P2)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)   # [BLOCK_M, D_P2]
    if DOT_F32:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)

    # Keys [kv_lo, kv_hi) of this partition; every valid row sees all keys < full_hi.
    kv_end = tl.where(tile_ok, prefix + q0 + tl.minimum(q_len - q0, TOKS), 0)
    kv_lo = split * part_size
    kv_hi = tl.minimum(kv_lo + part_size, kv_end)
    full_hi = tl.minimum(kv_hi, prefix + q0 + 1)
    n_full = tl.maximum(full_hi - kv_lo, 0) // BLOCK_N
    mid_hi = kv_lo + n_full * BLOCK_N

    bt_row = BLOCK_TABLES + b.to(tl.int64) * stride_btb
    k_head = kv_head.to(tl.int64) * stride_kh
    v_head = kv_head.to(tl.int64) * stride_vh
    acc = tl.zeros([BLOCK_M, D_P2], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for start in range(kv_lo, mid_hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, bt_row, start, kv_hi, pos,
                                     k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                                     stride_btn, qk_scale, offs_d, HEAD_DIM, D_P2, BLOCK_N,
                                     BLOCK_SIZE, False, DOT_F32)
    for start in range(mid_hi, kv_hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, bt_row, start, kv_hi, pos,
                                     k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                                     stride_btn, qk_scale, offs_d, HEAD_DIM, D_P2, BLOCK_N,
                                     BLOCK_SIZE, True, DOT_F32)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        # Rows whose position precedes this partition are never merged: skip them.
        keep = row_ok & (kv_lo <= pos)
        part_row = (t_idx * NUM_Q_HEADS + head) * num_splits + split          # [BLOCK_M] int64
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(MID_LSE + part_row, lse, mask=keep)
        tl.store(MID_O + part_row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=keep[:, None] & d_ok[None, :])
    else:
        out_ptrs = OUT + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "part_size"])
def _merge_splits_kernel(MID_O, MID_LSE, OUT, SEQ_LENS, CU_Q, stride_ot, stride_oh,
                         num_seqs, num_splits, part_size,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                         HEADS_PER_PROG: tl.constexpr, IS_DECODE: tl.constexpr,
                         LOG_B: tl.constexpr):
    """out[t, heads] = log-sum-exp weighted mean of the partitions row t needs."""
    t = tl.program_id(0)
    h = tl.program_id(1) * HEADS_PER_PROG + tl.arange(0, HEADS_PER_PROG)   # [HB]
    if IS_DECODE:
        pos = tl.load(SEQ_LENS + t) - 1
    else:
        b = _find_seq(CU_Q, t, num_seqs, LOG_B)
        q_end = tl.load(CU_Q + b + 1)
        pos = tl.load(SEQ_LENS + b) - (q_end - t)
    n = tl.minimum(pos // part_size + 1, num_splits)
    offs_d = tl.arange(0, D_P2)
    mask = (h < NUM_Q_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]   # [HB, D_P2]
    base = (t.to(tl.int64) * NUM_Q_HEADS + h) * num_splits               # [HB] int64
    acc = tl.zeros([HEADS_PER_PROG, D_P2], dtype=tl.float32)
    l_sum = tl.zeros([HEADS_PER_PROG], dtype=tl.float32)
    m = tl.full([HEADS_PER_PROG], float("-inf"), dtype=tl.float32)
    for s in range(0, n):
        lse = tl.load(MID_LSE + base + s, mask=h < NUM_Q_HEADS, other=0.0)          # [HB]
        o = tl.load(MID_O + (base + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask,
                    other=0.0)                                                     # [HB, D_P2]
        m_new = tl.maximum(m, lse)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * o
        l_sum = l_sum * alpha + w
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(OUT + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launch plans


@dataclass(frozen=True, slots=True)
class AttnPlan:
    """Every launch choice of one attention call, a pure function of shapes."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dot_f32: bool
    num_tiles: int          # grid axis 0 (an upper bound for extends)
    num_splits: int         # grid axis 2
    part_size: int          # keys per partition (>= every sequence when num_splits == 1)
    log_b: int              # binary-search steps over B sequences
    merge_heads: int        # query heads per program of the split merge


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _num_sms(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    # Interpreter: a tiny "machine" so that small test shapes still split.
    return 2


def plan_attention(*, num_tokens: int, num_seqs: int, q_heads: int, kv_heads: int, head_dim: int,
                   block_size: int, max_blocks: int, dtype: torch.dtype, is_decode: bool,
                   num_sms: int, interpret: bool, num_splits: int | None = None,
                   block_m: int | None = None, block_n: int | None = None,
                   dot_f32: bool | None = None) -> AttnPlan:
    """Choose tiles and the flash-decoding split; overrides are for tests."""
    group = q_heads // kv_heads
    d_p2 = max(16, _pow2(head_dim))
    if dot_f32 is None:
        dot_f32 = interpret or dtype == torch.float32
    wide = 4 if dot_f32 else 2                                   # bytes per K/V element in smem
    if block_n is None:
        # K and V tiles of BLOCK_N x D, double-buffered, stay well inside shared memory.
        block_n = 64 if d_p2 * wide <= 256 else 32
    if block_m is None:
        if is_decode:
            block_m = max(16, _pow2(group))
        else:
            rows = _cdiv(num_tokens, max(1, num_seqs)) * group   # average query rows per sequence
            cap = 128 if d_p2 * wide <= 256 else 64
            block_m = min(max(16, _pow2(rows)), cap)
            block_m = max(block_m, _pow2(group))
    toks = block_m // group
    if toks < 1:
        raise ValueError(f"block_m {block_m} < GQA group {group}")
    if is_decode:
        num_tiles = num_seqs
    else:
        num_tiles = min(num_tokens, _cdiv(num_tokens + num_seqs * (toks - 1), toks))
    ctx = max(1, max_blocks * block_size)                       # bound on any sequence's length
    if num_splits is None:
        min_part = block_n if interpret else 256
        want = _cdiv(4 * num_sms, max(1, num_tiles * kv_heads))
        cap = max(1, _MAX_PARTIAL_ELEMS // max(1, num_tokens * q_heads * head_dim))
        num_splits = max(1, min(want, ctx // min_part, cap))
    num_splits = min(num_splits, 65535)                           # grid axis 2 limit
    if num_splits > 1:
        part_size = _cdiv(_cdiv(ctx, num_splits), block_n) * block_n
        num_splits = _cdiv(ctx, part_size)
    if num_splits <= 1:
        num_splits, part_size = 1, 1 << 30
    num_warps = 4 if block_m <= 64 else 8
    return AttnPlan(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=2,
                    dot_f32=dot_f32, num_tiles=num_tiles, num_splits=num_splits,
                    part_size=part_size,
                    log_b=0 if is_decode else max(0, num_seqs - 1).bit_length(),
                    merge_heads=1 << 30 if interpret else 8)


# --------------------------------------------------------------------------- entry points


@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch, fully decided: what `__call__` runs and what the offline
    sm_90 compile check (tests/kernels/sm90_compile.py) compiles."""

    kernel: object                 # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple                    # runtime arguments, in the kernel's order
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps,
                               num_stages=self.num_stages)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dtype not in _DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"triton attention takes float32/float16/bfloat16 caches of one dtype, "
                        f"got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"caches must both be [num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous in head_dim")


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv_launch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> Launch | None:
    _check_cache(k_cache, v_cache)
    num_tokens, kv_heads, head_dim = k.shape
    if (kv_heads, head_dim) != tuple(k_cache.shape[2:]) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit caches "
                         f"{tuple(k_cache.shape)}")
    if num_tokens == 0:
        return None
    k, v = _last_contiguous(k), _last_contiguous(v)
    slots = slot_mapping.to(torch.int64)
    return Launch(
        _store_kv_kernel, (num_tokens,),
        (k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)),
        dict(KV_HEADS=kv_heads, HEAD_DIM=head_dim, H_P2=_pow2(kv_heads), D_P2=_pow2(head_dim),
             BLOCK_SIZE=k_cache.shape[1]),
        num_warps=4, num_stages=1)


def attention_launches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       cu_q_lens: torch.Tensor | None, scale: float, *, num_sms: int,
                       interpret: bool, **overrides) -> tuple[torch.Tensor, list[Launch]]:
    """Allocate out [T, q_heads, head_dim] and decide the launches that fill it.

    cu_q_lens None = decode (one query per sequence).  `overrides` go to
    `plan_attention` (tests force splits and tile sizes with them).
    """
    _check_cache(k_cache, v_cache)
    num_tokens, q_heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or q_heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    num_seqs = seq_lens.shape[0]
    is_decode = cu_q_lens is None
    out = torch.empty((num_tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out, []
    q = _last_contiguous(q)
    seq_lens = seq_lens.to(torch.int32)
    plan = plan_attention(num_tokens=num_tokens, num_seqs=num_seqs, q_heads=q_heads,
                          kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                          max_blocks=block_tables.shape[1], dtype=k_cache.dtype,
                          is_decode=is_decode, num_sms=num_sms, interpret=interpret,
                          **overrides)
    group = q_heads // kv_heads
    if is_decode:
        cu_q = cu_tiles = seq_lens                               # unused by the decode kernel
    else:
        cu_q = cu_q_lens.to(torch.int32)
        toks = plan.block_m // group
        tiles = (cu_q[1:] - cu_q[:-1] + (toks - 1)) // toks      # [B] tiles per sequence
        cu_tiles = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
        cu_tiles[1:] = torch.cumsum(tiles, 0)
    split = plan.num_splits > 1
    if split:
        mid_o = torch.empty((num_tokens, q_heads, plan.num_splits, head_dim),
                            dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_tokens, q_heads, plan.num_splits),
                              dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out                                    # unused without a split
    launches = [Launch(
        _attn_fwd_kernel, (plan.num_tiles, kv_heads, plan.num_splits),
        (q, k_cache, v_cache, block_tables, seq_lens, cu_q, cu_tiles, out, mid_o, mid_lse,
         q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
         block_tables.stride(0), block_tables.stride(1), out.stride(0), out.stride(1),
         num_seqs, plan.num_splits, plan.part_size, scale * _LOG2E),
        dict(GROUP=group, NUM_Q_HEADS=q_heads, HEAD_DIM=head_dim, D_P2=max(16, _pow2(head_dim)),
             BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_SIZE=block_size,
             IS_DECODE=is_decode, SPLIT=split, DOT_F32=plan.dot_f32, LOG_B=plan.log_b),
        num_warps=plan.num_warps, num_stages=plan.num_stages)]
    if split:
        heads_per_prog = min(_pow2(q_heads), plan.merge_heads)
        launches.append(Launch(
            _merge_splits_kernel, (num_tokens, _cdiv(q_heads, heads_per_prog)),
            (mid_o, mid_lse, out, seq_lens, cu_q, out.stride(0), out.stride(1),
             num_seqs, plan.num_splits, plan.part_size),
            dict(NUM_Q_HEADS=q_heads, HEAD_DIM=head_dim, D_P2=_pow2(head_dim),
                 HEADS_PER_PROG=heads_per_prog, IS_DECODE=is_decode, LOG_B=plan.log_b),
            num_warps=4, num_stages=1))
    return out, launches


def _attention(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
               **overrides) -> torch.Tensor:
    out, launches = attention_launches(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens,
                                       scale, num_sms=_num_sms(str(q.device)),
                                       interpret=_interpreting(), **overrides)
    for launch in launches:
        launch()
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [T, kv_heads, head_dim] into the caches at flat slots [T] (-1 = skip)."""
    launch = store_kv_launch(k, v, k_cache, v_cache, slot_mapping)
    if launch is not None:
        launch()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query per sequence: q [B, q_heads, head_dim] -> out [B, q_heads, head_dim]."""
    return _attention(q, k_cache, v_cache, block_tables, seq_lens, None, scale)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, generated: torch.Tensor | None = None,
                     new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Packed new tokens q [T, q_heads, head_dim] of B sequences (cu_q_lens [B+1]).

    Their K/V are already in the cache.  Query i of sequence b sits at absolute
    position seq_lens[b] - q_len_b + i and attends causally up to itself.
    `generated` (how many new tokens are generated ones) is not used: every row takes this kernel;
    nor is `new_kv` (the kernel reads the pages in place).
    """
    return _attention(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale)
