"""Torch reference implementations of the attention kernels.

These are the oracle the Triton kernels in `triton_ops` are tested against
(same names and signatures) and the engine's production path on CPU, so they
are batched but kept plain: gather each sequence's pages into a padded
[B, L, kv_heads, head_dim] view, mask by length and causality, one softmax.
GQA is a reshape of the query heads into [kv_heads, group], never a copy of K/V.
Accumulation is float32, or float64 when q or the caches are float64.

Shapes:
  caches        [num_blocks, block_size, kv_heads, head_dim]
  block_tables  [B, max_blocks] int32 (entries past a sequence's length are never read)
  seq_lens      [B] int32, tokens in cache for each sequence, new ones included (>= 1)
  cu_q_lens     [B+1] int32, row ranges of each sequence's new tokens in the packed q
"""

from __future__ import annotations

import torch

# Bound on the score matrix of one extend chunk (elements), so a long prefill
# does not materialize [heads, q_len, seq_len] at once.
_MAX_SCORE_ELEMS = 1 << 25


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [T, kv_heads, head_dim] into the caches at flat slots [T] (-1 = skip)."""
    keep = slot_mapping >= 0                                  # [T]
    slots = slot_mapping[keep].long()                         # [T']
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            length: int) -> torch.Tensor:
    """Pages of B sequences -> [B, length, kv_heads, head_dim], zero-page padded.

    Table entries past a sequence's last block are replaced by block 0 before
    indexing, so padding in the table (stale ids, -1) is never dereferenced.
    """
    block_size = cache.shape[1]
    nblk = -(-length // block_size)
    tables = block_tables[:, :nblk].long()                    # [B, nblk]
    used = -(-seq_lens.long() // block_size)                  # [B] blocks each sequence fills
    live = torch.arange(nblk, device=tables.device)[None, :] < used[:, None]
    # index_select over whole blocks: several times faster on CPU than
    # advanced indexing of the 4-d cache.
    pages = cache.view(cache.shape[0], -1).index_select(0, torch.where(live, tables, 0).flatten())
    return pages.view(tables.shape[0], nblk * block_size, *cache.shape[2:])[:, :length]   # [B, length, kvh, hd]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            scale: float, acc: torch.dtype) -> torch.Tensor:
    """Batched causal attention.

    q [B, Tq, H, D] at absolute positions q_pos [B, Tq]; k, v [B, L, KVH, D].
    Key j is visible to a query at p iff j <= p (every p is below its sequence's
    length, so padding past it is never visible).  -> [B, Tq, H, D] in `acc`.
    """
    b, tq, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    # Rows (query token, head in group) of each KV head: [B, KVH, Tq*G, D].
    qg = q.to(acc).view(b, tq, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(b, kvh, tq * g, d)
    scores = torch.matmul(qg, k.to(acc).permute(0, 2, 3, 1)) * scale   # [B, KVH, Tq*G, L]
    j = torch.arange(k.shape[1], device=q.device)
    hidden = j[None, None, :] > q_pos[:, :, None]                      # [B, Tq, L]
    scores = scores.view(b, kvh, tq, g, -1).masked_fill(hidden[:, None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, kvh, tq * g, -1)
    out = torch.matmul(probs, v.to(acc).permute(0, 2, 1, 3))          # [B, KVH, Tq*G, D]
    return out.view(b, kvh, tq, g, d).permute(0, 2, 1, 3, 4).reshape(b, tq, h, d)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query per sequence: q [B, q_heads, head_dim] -> out [B, q_heads, head_dim]."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    acc = _acc_dtype(q.dtype, k_cache.dtype)
    length = int(seq_lens.max())
    k = _gather(k_cache, block_tables, seq_lens, length)      # [B, L, KVH, D]
    v = _gather(v_cache, block_tables, seq_lens, length)
    pos = (seq_lens.long() - 1)[:, None]                      # [B, 1] the query is the last token
    out = _attend(q[:, None], k, v, pos, scale, acc)   # [B, 1, H, D]
    return out[:, 0].to(q.dtype)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Packed new tokens q [T, q_heads, head_dim] of B sequences (cu_q_lens [B+1]).

    Their K/V are already in the cache.  Query i of sequence b sits at absolute
    position seq_lens[b] - q_len_b + i and attends causally up to itself.

    Sequences with one new token (the decodes of a mixed batch) go through the
    batched decode path together; each longer extend is computed on its own,
    in query chunks that bound the score matrix.
    """
    out = torch.empty_like(q)
    cu = [int(x) for x in cu_q_lens.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    q_lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    singles = [b for b, n in enumerate(q_lens) if n == 1]
    if singles:
        idx = torch.tensor(singles, device=q.device)
        rows = cu_q_lens[:-1].long()[idx]                     # [B1] packed row of each
        out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, block_tables[idx],
                                           seq_lens[idx], scale)
    acc = _acc_dtype(q.dtype, k_cache.dtype)
    for b, n in enumerate(q_lens):
        if n <= 1:
            continue
        total = lens[b]
        k = _gather(k_cache, block_tables[b : b + 1], seq_lens[b : b + 1], total)   # [1, S, KVH, D]
        v = _gather(v_cache, block_tables[b : b + 1], seq_lens[b : b + 1], total)
        chunk = max(1, _MAX_SCORE_ELEMS // (q.shape[1] * total))
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            pos = torch.arange(total - n + c0, total - n + c1, device=q.device)[None]   # [1, c]
            rows = slice(cu[b] + c0, cu[b] + c1)
            out[rows] = _attend(q[None, rows], k, v, pos, scale, acc)[0].to(q.dtype)
    return out
