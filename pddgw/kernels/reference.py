"""Torch reference implementations of the attention kernels.

Clear, obviously-correct code: gather the pages of each sequence, masked
attention with float32 (or float64) accumulation.  The Triton kernels in
`triton_ops` have the same names and signatures and are tested against these.

Shapes:
  caches        [num_blocks, block_size, kv_heads, head_dim]
  block_tables  [B, max_blocks] int32 (entries past a sequence's length unused)
  seq_lens      [B] int32, tokens in cache for each sequence, new ones included
"""

from __future__ import annotations

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [T, kv_heads, head_dim] into the caches at flat slots [T] (-1 = skip)."""
    keep = slot_mapping >= 0                                  # [T]
    slots = slot_mapping[keep]                                # [T']
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def _gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """Pages of one sequence -> [n, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    nblk = (n + block_size - 1) // block_size
    pages = cache[table[:nblk].long()]                        # [nblk, bs, kvh, hd]
    return pages.reshape(-1, *cache.shape[2:])[:n]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [Tq, H, D] at absolute positions q_pos [Tq]; k, v [S, KVH, D] -> [Tq, H, D]."""
    acc = _acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    k = k.to(acc).repeat_interleave(group, dim=1)             # [S, H, D]
    v = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.to(acc), k) * scale   # [H, Tq, S]
    kv_pos = torch.arange(k.shape[0], device=q.device)
    mask = kv_pos[None, :] > q_pos[:, None]                   # [Tq, S]
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqs,shd->qhd", probs, v)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query per sequence: q [B, q_heads, head_dim] -> out [B, q_heads, head_dim]."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        k = _gather(k_cache, block_tables[b], n)
        v = _gather(v_cache, block_tables[b], n)
        pos = torch.tensor([n - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, pos, scale)[0].to(q.dtype)
    return out


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Packed new tokens q [T, q_heads, head_dim] of B sequences (cu_q_lens [B+1]).

    Their K/V are already in the cache.  Query i of sequence b sits at absolute
    position seq_lens[b] - q_len_b + i and attends causally up to itself.
    """
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        s, e = int(cu_q_lens[b]), int(cu_q_lens[b + 1])
        if e == s:
            continue
        n = int(seq_lens[b])
        k = _gather(k_cache, block_tables[b], n)
        v = _gather(v_cache, block_tables[b], n)
        pos = torch.arange(n - (e - s), n, device=q.device)
        out[s:e] = _attend(q[s:e], k, v, pos, scale).to(q.dtype)
    return out
