"""bfloat16 prompt rows on the CPU backend's AMX prompt kernel (pddgw/kernels/cpu_prompt_attention.c,
reached through `cpu_ops.extend_attention`): whole prompts and chunks against the loop oracle, a
row's bits independent of its batch, the thread count, later keys and how its prompt was chunked,
generated rows still the decode kernel's, and what it does not take left to the torch reference."""

from __future__ import annotations

import pytest
import torch
from .kernel_cases import assert_close, cu_lens, loop_extend, make_paged, make_q

from pddgw.kernels import cpu_ops, reference

needs_amx = pytest.mark.skipif(cpu_ops._load_prompt() is None, reason="no AMX-BF16 (or no C compiler) here")


def _step(lens: list[int], q_lens: list[int], q_heads: int, kv_heads: int, head_dim: int,
          dtype: torch.dtype = torch.bfloat16, block_size: int = 16):
    """Caches holding `lens` tokens per sequence (scattered pages) and the queries of each one's
    last q_lens[b] tokens, as the model hands them over: a view of a wider fused tensor."""
    p = make_paged(lens, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    t = sum(q_lens)
    fused = torch.zeros(t, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = fused[:, : q_heads * head_dim].view(t, q_heads, head_dim)
    q.copy_(make_q(t, q_heads, head_dim, dtype))
    return p, q, cu_lens(q_lens)


def _attend(p, q, cu, seq_lens=None, tables=None, scale=0.125, **kw):
    return cpu_ops.extend_attention(q, p.k_cache, p.v_cache, p.block_tables if tables is None else tables, cu,
                                    p.seq_lens if seq_lens is None else seq_lens, scale, **kw)


def _oracle(p, q, cu, scale=0.125):
    return loop_extend(q.double(), p.k_cache.double(), p.v_cache.double(), p.block_tables, cu, p.seq_lens, scale)


def _count_reference(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = reference.extend_attention
    monkeypatch.setattr(reference, "extend_attention",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    return calls


@needs_amx
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 2, 32), (6, 1, 96), (4, 2, 16),
                                                       (3, 3, 48)])
def test_prompts_and_chunks_match_the_loop_oracle(q_heads, kv_heads, head_dim, monkeypatch):
    # Whole prompts (37, 2, 130 tokens), a chunk after a cached prefix, a prompt's one-token chunk.
    lens, q_lens = [37, 2, 90, 130, 45], [37, 2, 61, 130, 1]
    p, q, cu = _step(lens, q_lens, q_heads, kv_heads, head_dim)
    calls = _count_reference(monkeypatch)
    out = _attend(p, q, cu)
    assert calls == []                                  # every row on the kernel
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert_close(out, _oracle(p, q, cu), torch.bfloat16)


@needs_amx
def test_a_row_s_bits_do_not_depend_on_its_batch_the_threads_later_keys_or_the_chunks():
    lens = [70, 33, 129]
    p, q, cu = _step(lens, lens, 6, 2, 64, block_size=8)
    whole = _attend(p, q, cu)
    # Sequence 1 alone.
    s = slice(70, 103)
    assert torch.equal(_attend(p, q[s], cu_lens([33]), p.seq_lens[1:2], p.block_tables[1:2]), whole[s])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_attend(p, q, cu), whole)
    finally:
        torch.set_num_threads(threads)
    # Sequence 2 in chunks of 50, 1, 17 and 61 tokens, each step with its prefix in the pages.
    rows = torch.arange(103, 232)
    done = 0
    for n in (50, 1, 17, 61):
        chunk = _attend(p, q[rows[done : done + n]], cu_lens([n]), torch.tensor([done + n], dtype=torch.int32),
                        p.block_tables[2:3])
        assert torch.equal(chunk, whole[rows[done : done + n]]), (done, n)
        done += n
    # A later key changes nothing before it: sequence 2's last token rewritten in its page.
    bs = p.k_cache.shape[1]
    block, slot = int(p.block_tables[2, 128 // bs]), 128 % bs
    p.k_cache[block, slot] *= -1
    p.v_cache[block, slot] *= 3
    changed = _attend(p, q, cu)
    assert torch.equal(changed[:-1], whole[:-1]) and not torch.equal(changed[-1], whole[-1])


@needs_amx
def test_generated_rows_stay_with_the_decode_kernel(monkeypatch):
    """A step with a prompt chunk and a handoff's catch-up (3 prompt tokens, then 2 relayed)."""
    lens, q_lens = [40, 64], [8, 5]
    p, q, cu = _step(lens, q_lens, 4, 2, 64)
    gen = torch.tensor([0, 2], dtype=torch.int32)
    calls = _count_reference(monkeypatch)
    out = _attend(p, q, cu, generated=gen)
    assert calls == []
    for row, length in ((11, 63), (12, 64)):             # the relayed tokens, each decoded alone
        alone = cpu_ops.paged_decode_attention(q[row : row + 1], p.k_cache, p.v_cache, p.block_tables[1:2],
                                               torch.tensor([length], dtype=torch.int32), 0.125)
        assert torch.equal(out[row], alone[0])
    prompt = _attend(p, q[8:11], cu_lens([3]), torch.tensor([62], dtype=torch.int32), p.block_tables[1:2])
    assert torch.equal(out[8:11], prompt)
    assert_close(out, _oracle(p, q, cu), torch.bfloat16)


@needs_amx
def test_a_length_or_block_outside_the_table_is_refused():
    p, q, cu = _step([20, 33], [20, 33], 4, 2, 64)
    with pytest.raises(ValueError, match="outside the table"):
        _attend(p, q, cu, seq_lens=torch.tensor([20, 64], dtype=torch.int32))      # 4 blocks, 3 in the table
    tables = p.block_tables.clone()
    tables[1, 0] = p.k_cache.shape[0]
    with pytest.raises(ValueError, match="the pool"):
        _attend(p, q, cu, tables=tables)


@needs_amx
def test_sequences_beyond_one_call_s_packed_keys_go_in_several(monkeypatch):
    lens = [40, 70, 33]
    p, q, cu = _step(lens, lens, 4, 2, 64)
    want = _attend(p, q, cu)
    monkeypatch.setattr(cpu_ops, "_PACK_BYTES", 96 * 4 * 2 * 64)             # 96 keys: one sequence a call
    calls = []
    real = cpu_ops._load_prompt()
    monkeypatch.setattr(cpu_ops, "_load_prompt", lambda: lambda *a: calls.append(a[13]) or real(*a))
    assert torch.equal(_attend(p, q, cu), want)
    assert calls == [1, 1, 1]


@pytest.mark.parametrize("case", ["float16", "head_dim 40", "float32 caches"])
def test_what_the_kernel_does_not_take_is_the_reference_s(case):
    dtype = torch.float16 if case == "float16" else torch.bfloat16
    p, q, cu = _step([20, 33], [20, 9], 4, 2, 40 if case == "head_dim 40" else 64, dtype=dtype)
    if case == "float32 caches":
        p = type(p)(p.k_cache.float(), p.v_cache.float(), p.block_tables, p.seq_lens)
    want = reference.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.125)
    assert torch.equal(_attend(p, q, cu), want)
