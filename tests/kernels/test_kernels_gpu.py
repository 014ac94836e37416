"""The Triton kernels on a real GPU at larger sizes (skipped without CUDA).

Same comparisons as test_kernels_triton.py, with contexts of thousands of
tokens so the launch heuristics pick real flash-decoding splits and full tiles.
"""

from __future__ import annotations

import pytest
import torch
from .kernel_cases import assert_close, cu_lens, make_paged, make_q

from pddgw.kernels import reference as R

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MODELS = [(4, 8, 128), (8, 4, 64), (1, 8, 128)]               # (group, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,kv_heads,head_dim", MODELS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_large(group, kv_heads, head_dim, block_size, dtype):
    from pddgw.kernels import triton_ops as T

    seq_lens = [1, 17, 511, 2048, 3001, 4096, 77, 1000]
    p = make_paged(seq_lens, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                   dtype=dtype, device="cuda", strided_table=block_size == 32)
    q = make_q(len(seq_lens), group * kv_heads, head_dim, dtype, device="cuda")
    scale = head_dim ** -0.5
    out = T.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale)
    want = R.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,kv_heads,head_dim", MODELS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_extend_large(group, kv_heads, head_dim, block_size, dtype):
    from pddgw.kernels import triton_ops as T

    pairs = [(4000, 1), (2500, 16), (0, 300), (1000, 64), (3000, 512), (7, 7), (100, 0)]
    p = make_paged([a + k for a, k in pairs], kv_heads=kv_heads, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, device="cuda")
    cu = cu_lens([k for _, k in pairs], device="cuda")
    q = make_q(int(cu[-1].item()), group * kv_heads, head_dim, dtype, device="cuda")
    scale = head_dim ** -0.5
    out = T.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, scale)
    want = R.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, scale)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_large(dtype):
    from pddgw.kernels import triton_ops as T

    k = make_q(4096, 8, 128, dtype, device="cuda")
    v = make_q(4096, 8, 128, dtype, device="cuda", seed=2)
    slots = torch.randperm(300 * 16, device="cuda")[:4096]
    slots[::5] = -1
    caches = [torch.zeros(300, 16, 8, 128, dtype=dtype, device="cuda") for _ in range(4)]
    T.store_kv(k, v, caches[0], caches[1], slots)
    R.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
