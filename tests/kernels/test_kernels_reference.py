"""The batched torch reference (also the engine's CPU path) against per-sequence
loop oracles and closed forms."""

from __future__ import annotations

import pytest
import torch
from .kernel_cases import assert_close, cu_lens, loop_decode, loop_extend, make_paged, make_q

from pddgw.kernels import reference as R

DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_matches_loop(dtype, group, block_size):
    seq_lens = [1, block_size - 1, block_size, 2 * block_size + 3, 5]
    p = make_paged(seq_lens, kv_heads=2, head_dim=16, block_size=block_size, dtype=dtype,
                   strided_table=block_size == 4)
    q = make_q(len(seq_lens), 2 * group, 16, dtype)
    out = R.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    want = loop_decode(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.3)
    assert_close(out, want, torch.float32 if dtype == torch.float32 else dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_extend_matches_loop(dtype, group):
    # (prefix, new tokens): chunked prefill from scratch, decodes mixed in, an empty
    # entry, token-ID extends of 7 and 64 on cached prefixes.
    pairs = [(0, 9), (10, 1), (3, 0), (21, 7), (40, 64), (0, 1)]
    seq_lens = [a + k for a, k in pairs]
    p = make_paged(seq_lens, kv_heads=2, head_dim=16, block_size=8, dtype=dtype)
    cu = cu_lens([k for _, k in pairs])
    q = make_q(int(cu[-1]), 2 * group, 16, dtype)
    out = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.25)
    want = loop_extend(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.25)
    assert_close(out, want, torch.float32 if dtype == torch.float32 else dtype)


def test_extend_chunking_is_invisible(monkeypatch):
    pairs = [(5, 30), (0, 17)]
    p = make_paged([a + k for a, k in pairs], kv_heads=1, head_dim=8, block_size=4,
                   dtype=torch.float64)
    cu = cu_lens([k for _, k in pairs])
    q = make_q(int(cu[-1]), 2, 8, torch.float64)
    whole = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.5)
    monkeypatch.setattr(R, "_MAX_SCORE_ELEMS", 2 * 35 * 3)      # 3 query rows per chunk
    chunked = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.5)
    torch.testing.assert_close(chunked, whole, atol=1e-13, rtol=0)


def test_extend_equals_successive_decodes():
    """k tokens in one extend == k single-token decodes (the token-ID handoff)."""
    prefix, k, bs = 13, 6, 4
    p = make_paged([prefix + k], kv_heads=2, head_dim=8, block_size=bs, dtype=torch.float64)
    q = make_q(k, 4, 8, torch.float64)
    ext = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu_lens([k]),
                             p.seq_lens, 0.4)
    for i in range(k):
        lens = torch.tensor([prefix + i + 1], dtype=torch.int32)
        dec = R.paged_decode_attention(q[i : i + 1], p.k_cache, p.v_cache, p.block_tables,
                                       lens, 0.4)
        torch.testing.assert_close(dec[0], ext[i], atol=1e-13, rtol=0)


def test_zero_query_attends_uniformly():
    """q = 0 gives equal weights: out = mean of the visible values, exactly."""
    seq_lens = [1, 6, 11]
    p = make_paged(seq_lens, kv_heads=2, head_dim=4, block_size=4, dtype=torch.float64)
    q = torch.zeros(3, 4, 4, dtype=torch.float64)
    out = R.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 1.0)
    for b, n in enumerate(seq_lens):
        pages = p.block_tables[b, : -(-n // 4)].long()
        v = p.v_cache[pages].reshape(-1, 2, 4)[:n]               # [n, kvh, hd]
        want = v.mean(0).repeat_interleave(2, dim=0)             # [H, hd], group 2
        torch.testing.assert_close(out[b], want, atol=1e-14, rtol=0)


def test_store_kv_scatters_into_slots_and_skips_minus_one():
    k_cache = torch.zeros(3, 4, 2, 2)
    v_cache = torch.zeros(3, 4, 2, 2)
    k = torch.arange(16, dtype=torch.float64).view(4, 2, 2) + 1
    v = -k
    slots = torch.tensor([5, -1, 0, 11])
    R.store_kv(k, v, k_cache, v_cache, slots)
    assert k_cache.dtype == torch.float32
    assert torch.equal(k_cache[1, 1], k[0].float())             # slot 5 = block 1, offset 1
    assert torch.equal(k_cache[0, 0], k[2].float())
    assert torch.equal(k_cache[2, 3], k[3].float())
    assert torch.equal(v_cache[2, 3], v[3].float())
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3        # token 1 went nowhere
