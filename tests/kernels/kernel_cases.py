"""Shared builders for the kernel tests: paged caches, scattered block tables,
ragged batches, per-dtype tolerances, and the per-sequence loop oracles that the
batched torch reference is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (atol, rtol) per cache dtype.  float16/bfloat16 round q, the probabilities
# (tensor-core operands on GPU) and the output to 10 / 7 mantissa bits.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass(frozen=True)
class Paged:
    k_cache: torch.Tensor          # [num_blocks, block_size, kvh, hd]
    v_cache: torch.Tensor
    block_tables: torch.Tensor     # [B, max_blocks] int32, scattered pages, -1 padded
    seq_lens: torch.Tensor         # [B] int32


def make_paged(seq_lens: list[int], *, kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, device: str = "cpu", seed: int = 0, spare_blocks: int = 3,
               strided_table: bool = False, extra_width: int = 1) -> Paged:
    """Random caches; each sequence's pages are a random, non-contiguous set of blocks.

    The table is one column wider than needed (padded with -1, never read);
    strided_table gives a view with stride(1) == 2.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need) + extra_width
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
        i += n
    if strided_table:
        wide = torch.full((len(seq_lens), 2 * width), -7, dtype=torch.int32)
        wide[:, ::2] = table
        table = wide.to(device)[:, ::2]
        assert table.stride(1) == 2
    else:
        table = table.to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return Paged(k_cache, v_cache, table, lens)


def make_q(num_tokens: int, q_heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu",
           seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, q_heads, head_dim, generator=gen).to(dtype).to(device)


def cu_lens(q_lens: list[int], device: str = "cpu") -> torch.Tensor:
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------- loop oracles
# Written for obviousness: one sequence at a time, K/V repeated per query head.


def _loop_gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    block_size = cache.shape[1]
    rows = [cache[int(table[j // block_size]), j % block_size] for j in range(n)]
    return torch.stack(rows)                                    # [n, kvh, hd]


def _loop_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int],
                 scale: float) -> torch.Tensor:
    acc = torch.float64
    group = q.shape[1] // k.shape[1]
    k = k.to(acc).repeat_interleave(group, dim=1)               # [S, H, D]
    v = v.to(acc).repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=acc)
    for i, p in enumerate(q_pos):
        scores = torch.einsum("hd,shd->hs", q[i].to(acc), k[: p + 1]) * scale   # [H, p+1]
        out[i] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), v[: p + 1])
    return out


def loop_decode(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        k = _loop_gather(k_cache, block_tables[b], n)
        v = _loop_gather(v_cache, block_tables[b], n)
        out[b] = _loop_attend(q[b : b + 1], k, v, [n - 1], scale)[0]
    return out


def loop_extend(q, k_cache, v_cache, block_tables, cu_q_lens, seq_lens, scale) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(seq_lens.shape[0]):
        s, e = int(cu_q_lens[b]), int(cu_q_lens[b + 1])
        if e == s:
            continue
        n = int(seq_lens[b])
        k = _loop_gather(k_cache, block_tables[b], n)
        v = _loop_gather(v_cache, block_tables[b], n)
        out[s:e] = _loop_attend(q[s:e], k, v, list(range(n - (e - s), n)), scale)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol,
                               rtol=rtol)
