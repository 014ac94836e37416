"""Triton kernels against the torch reference.

Without CUDA these run in the Triton interpreter (conftest sets
TRITON_INTERPRET=1); shapes stay small (tens of programs x a few KV tiles).
Tolerances per dtype are in kernel_cases.TOL.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from .kernel_cases import TOL, assert_close, cu_lens, make_paged, make_q

from pddgw.engines.attention import AttnMetadata, paged_attention
from pddgw.kernels import reference as R
from pddgw.kernels import triton_ops as T

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GRID = list(itertools.product([1, 4, 8], [64, 128], [16, 32], DTYPES))


def _id(group, head_dim, block_size, dtype):
    return f"g{group}-d{head_dim}-bs{block_size}-{str(dtype)[6:]}"


GRID_IDS = [_id(*c) for c in GRID]


def _decode_case(group, head_dim, block_size, dtype, strided=False):
    seq_lens = [1, block_size - 1, block_size + 3, 3 * block_size + 5]
    p = make_paged(seq_lens, kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype,
                   device=DEV, strided_table=strided)
    q = make_q(len(seq_lens), 2 * group, head_dim, dtype, device=DEV)
    return p, q


def _extend_case(group, head_dim, block_size, dtype, pairs=None):
    # (cached prefix, new tokens): chunked prefill from scratch, a decode, an extend
    # of 7 on a prefix that is not a block multiple, an idle entry, an extend of 64.
    pairs = pairs or [(0, 9), (2 * block_size + 3, 1), (block_size + 1, 7), (5, 0),
                      (3 * block_size + 2, 64)]
    p = make_paged([a + k for a, k in pairs], kv_heads=2, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, device=DEV)
    cu = cu_lens([k for _, k in pairs], device=DEV)
    q = make_q(int(cu[-1].item()), 2 * group, head_dim, dtype, device=DEV)
    return p, cu, q


@pytest.mark.parametrize("group,head_dim,block_size,dtype", GRID, ids=GRID_IDS)
def test_decode_matches_reference(group, head_dim, block_size, dtype):
    p, q = _decode_case(group, head_dim, block_size, dtype, strided=block_size == 32)
    scale = head_dim ** -0.5
    out = T.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    want = R.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("group,head_dim,block_size,dtype", GRID, ids=GRID_IDS)
def test_extend_matches_reference(group, head_dim, block_size, dtype):
    p, cu, q = _extend_case(group, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    out = T.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    want = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, scale)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 8])
def test_decode_flash_decoding_splits(group, dtype):
    """Forced partitions of 32 keys, so sequences span 1..4 of them, merged by LSE."""
    p, q = _decode_case(group, 64, 16, dtype)
    want = R.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.125)
    for splits in (1, 2, 3):
        out, launches = T.attention_launches(q, p.k_cache, p.v_cache, p.block_tables,
                                             p.seq_lens, None, 0.125, num_sms=2,
                                             interpret=T._interpreting(), num_splits=splits,
                                             block_n=16)
        assert len(launches) == (1 if splits == 1 else 2)         # merge only when split
        for launch in launches:
            launch()
        assert_close(out, want, dtype)


@pytest.mark.parametrize("group,dtype", [(1, torch.float32), (8, torch.float16),
                                         (8, torch.bfloat16)], ids=str)
def test_extend_splits_and_small_tiles(group, dtype):
    """Several tiles per sequence (binary search over tile offsets) and KV partitions
    that start after some rows of a tile (those rows skip the partition)."""
    p, cu, q = _extend_case(group, 64, 16, dtype,
                            pairs=[(0, 9), (19, 1), (17, 7), (5, 0), (50, 12)])
    want = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.125)
    for splits, block_m in ((3, 16), (1, 16), (4, None)):
        out, launches = T.attention_launches(q, p.k_cache, p.v_cache, p.block_tables,
                                             p.seq_lens, cu, 0.125, num_sms=2,
                                             interpret=T._interpreting(), num_splits=splits,
                                             block_m=block_m, block_n=16)
        for launch in launches:
            launch()
        assert_close(out, want, dtype)


def test_tensor_core_path_in_float16():
    """dot_f32=False is the GPU path for 16-bit caches (q and probabilities rounded to
    the cache dtype before the dots); float16 is exact enough in the interpreter."""
    p, cu, q = _extend_case(4, 64, 16, torch.float16)
    want = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.125)
    out = T._attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, cu, 0.125,
                       dot_f32=False, num_splits=2)
    assert_close(out, want, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_h200_launch_plans(dtype):
    """The exact plans an H200 gets (132 SMs: 256+ key partitions, GPU tile sizes,
    tensor-core operand rounding for float16), run here in the interpreter."""
    scale = 64 ** -0.5
    p = make_paged([1000, 37], kv_heads=2, head_dim=64, block_size=16, dtype=dtype, device=DEV)
    q = make_q(2, 8, 64, dtype, device=DEV)
    out, launches = T.attention_launches(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                         None, scale, num_sms=132, interpret=False)
    assert launches[0].grid[2] > 1 and launches[0].constexprs["DOT_F32"] == (dtype != torch.float16)
    for launch in launches:
        launch()
    want = R.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale)
    assert_close(out, want, dtype)
    p, cu, q = _extend_case(4, 64, 16, dtype, pairs=[(600, 64), (300, 7), (0, 1)])
    out, launches = T.attention_launches(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                         cu, scale, num_sms=132, interpret=False)
    assert launches[0].grid[2] > 1
    for launch in launches:
        launch()
    want = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, scale)
    assert_close(out, want, dtype)


def test_odd_group_and_head_dim():
    """GQA group 3 (rows per tile not a multiple of it) and head_dim 80 (padded to 128)."""
    p = make_paged([1, 20, 45], kv_heads=2, head_dim=80, block_size=16, dtype=torch.float32,
                   device=DEV)
    q = make_q(3, 6, 80, torch.float32, device=DEV)
    want = R.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.1)
    out = T.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.1)
    assert_close(out, want, torch.float32)
    p, cu, q = _extend_case(3, 80, 16, torch.float32, pairs=[(4, 7), (0, 12), (33, 1)])
    want = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.1)
    out = T.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.1)
    assert_close(out, want, torch.float32)


def test_extend_of_single_tokens_equals_decode():
    p, q = _decode_case(4, 64, 16, torch.float32)
    cu = cu_lens([1] * q.shape[0], device=DEV)
    ext = T.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.125)
    dec = T.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.125)
    torch.testing.assert_close(ext, dec, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 3, 2, 64, generator=gen).to(dtype)      # [T, q|k|v, kvh, hd]
    k, v = qkv[:, 1].to(DEV), qkv[:, 2].to(DEV)                   # strided views
    slots = torch.tensor([0, 17, -1, 31, 5, -1], dtype=torch.int64, device=DEV)
    caches = [torch.zeros(2, 16, 2, 64, dtype=dtype, device=DEV) for _ in range(4)]
    T.store_kv(k, v, caches[0], caches[1], slots)
    R.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0][1, 1], k[1])                       # slot 17 = block 1, offset 1
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == 4         # the -1 slots wrote nothing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_store_kv_converts_to_cache_dtype(dtype):
    k = make_q(5, 2, 64, torch.float32, device=DEV)
    slots = torch.arange(5, dtype=torch.int64, device=DEV) * 3
    caches = [torch.zeros(1, 16, 2, 64, dtype=dtype, device=DEV) for _ in range(4)]
    T.store_kv(k, -k, caches[0], caches[1], slots)
    R.store_kv(k, -k, caches[2], caches[3], slots)
    if DEV == "cuda":
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    else:
        # The 3.9 interpreter truncates float32 -> bfloat16 where torch (and the GPU)
        # round to nearest: allow one unit in the last place.
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=ulp)
        torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=ulp)
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == 5


def test_empty_inputs():
    p, q = _decode_case(1, 64, 16, torch.float32)
    assert T.paged_decode_attention(q[:0], p.k_cache, p.v_cache, p.block_tables[:0],
                                    p.seq_lens[:0], 0.1).shape == (0, 2, 64)
    T.store_kv(q[:0, :2], q[:0, :2], p.k_cache, p.v_cache, torch.zeros(0, dtype=torch.int64))


def test_rejects_float64_caches():
    p, q = _decode_case(1, 64, 16, torch.float32)
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        T.paged_decode_attention(q.double(), p.k_cache.double(), p.v_cache.double(),
                                 p.block_tables, p.seq_lens, 0.1)


@pytest.mark.parametrize("is_decode", [True, False])
def test_through_engine_attention(is_decode):
    """store_kv then attend via pddgw.engines.attention, both backends agree."""
    block_size, kvh, hd, group = 16, 2, 64, 4
    prefix = [20, 3] if is_decode else [20, 0]
    new = [1, 1] if is_decode else [5, 9]
    p = make_paged([a + k for a, k in zip(prefix, new)], kv_heads=kvh, head_dim=hd,
                   block_size=block_size, dtype=torch.float32, device=DEV)
    slot = []
    for b, (a, k) in enumerate(zip(prefix, new)):
        for pos in range(a, a + k):
            slot.append(int(p.block_tables[b, pos // block_size]) * block_size + pos % block_size)
    t = sum(new)
    q = make_q(t, kvh * group, hd, torch.float32, device=DEV, seed=5)
    k = make_q(t, kvh, hd, torch.float32, device=DEV, seed=6)
    v = make_q(t, kvh, hd, torch.float32, device=DEV, seed=7)
    outs = []
    for ops in (R, T):
        kc, vc = p.k_cache.clone(), p.v_cache.clone()
        meta = AttnMetadata(slot_mapping=torch.tensor(slot, dtype=torch.int64, device=DEV),
                            block_tables=p.block_tables, cu_q_lens=cu_lens(new, device=DEV),
                            seq_lens=p.seq_lens, is_decode=is_decode, ops=ops)
        outs.append((paged_attention(q, k, v, kc, vc, meta, hd ** -0.5), kc))
    assert torch.equal(outs[0][1], outs[1][1])
    assert_close(outs[1][0], outs[0][0], torch.float32)


def test_tolerances_are_stated_for_every_dtype():
    assert set(DTYPES) <= set(TOL)
