"""Whole bfloat16 prompts on the CPU backend's AMX prompt kernel (pddgw/kernels/cpu_prompt_attention.c,
reached through `cpu_ops.extend_attention`): against the loop oracle, causal to the bit, the same
bits whatever the batch or the thread count, and everything else left to the torch reference."""

from __future__ import annotations

import pytest
import torch
from .kernel_cases import assert_close, cu_lens, loop_extend, make_paged, make_q

from pddgw.kernels import cpu_ops, reference

needs_amx = pytest.mark.skipif(cpu_ops._load_prompt() is None, reason="no AMX-BF16 (or no C compiler) here")


def _prompts(lens: list[int], q_heads: int, kv_heads: int, head_dim: int, q_lens: list[int] | None = None,
             dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """Caches holding `lens` tokens, and the step's rows as the model hands them over: q, k and v
    views of one fused [T, q + 2 kv] tensor (tokens strided, heads packed); k / v equal the last
    q_lens[b] rows of each sequence's pages."""
    q_lens = q_lens or lens
    p = make_paged(lens, kv_heads=kv_heads, head_dim=head_dim, block_size=16, dtype=dtype, seed=seed)
    bs = p.k_cache.shape[1]

    def rows(cache):
        return torch.cat([torch.stack([cache[p.block_tables[b, i // bs], i % bs] for i in range(n - m, n)])
                          for b, (n, m) in enumerate(zip(lens, q_lens))])

    t = sum(q_lens)
    fused = torch.empty(t, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = fused[:, : q_heads * head_dim].view(t, q_heads, head_dim)
    k = fused[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = fused[:, (q_heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim)
    q.copy_(make_q(t, q_heads, head_dim, dtype, seed=seed + 1))
    k.copy_(rows(p.k_cache))
    v.copy_(rows(p.v_cache))
    return p, q, (k, v), cu_lens(q_lens)


def _attend(p, q, new_kv, cu, scale=0.125, **kw):
    return cpu_ops.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, scale,
                                    new_kv=new_kv, **kw)


def _count_reference(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = reference.extend_attention
    monkeypatch.setattr(reference, "extend_attention",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    return calls


@needs_amx
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 2, 32), (6, 1, 96)])
def test_whole_prompts_match_the_loop_oracle(q_heads, kv_heads, head_dim, monkeypatch):
    lens = [37, 2, 90, 130]
    p, q, new_kv, cu = _prompts(lens, q_heads, kv_heads, head_dim)
    calls = _count_reference(monkeypatch)
    out = _attend(p, q, new_kv, cu)
    assert calls == []                                  # every sequence on the kernel
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert_close(out, loop_extend(q.double(), p.k_cache.double(), p.v_cache.double(), p.block_tables, cu,
                                  p.seq_lens, 0.125), torch.bfloat16)


@needs_amx
def test_a_prompt_s_rows_do_not_depend_on_its_batch_the_threads_or_later_keys():
    lens = [70, 33, 129]
    p, q, (k, v), cu = _prompts(lens, 6, 2, 64)
    batch = _attend(p, q, (k, v), cu)
    alone = _prompts([33], 6, 2, 64)
    # Sequence 1 alone: the same rows, its own caches (the kernel reads the step's rows only).
    s = slice(70, 103)
    q1, k1, v1 = (x[s].clone() for x in (q, k, v))
    assert torch.equal(_attend(alone[0], q1, (k1, v1), cu_lens([33])), batch[s])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_attend(p, q, (k, v), cu), batch)
    finally:
        torch.set_num_threads(threads)
    # A later key changes nothing before it: the last token of sequence 2 rewritten.
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = -k2[-1], v2[-1] * 3
    changed = _attend(p, q, (k2, v2), cu)
    assert torch.equal(changed[:-1], batch[:-1]) and not torch.equal(changed[-1], batch[-1])


@needs_amx
def test_in_a_mixed_step_only_whole_prompts_take_the_kernel(monkeypatch):
    """Sequence 0 extends a cached prefix, 1 is a one-token prompt, 2 and 3 are whole prompts;
    sequence 3 also ends with a generated row (the decode kernel's)."""
    lens, q_lens = [40, 1, 50, 64], [8, 1, 50, 64]
    p, q, new_kv, cu = _prompts(lens, 4, 2, 64, q_lens)
    gen = torch.tensor([0, 0, 0, 1], dtype=torch.int32)
    calls = _count_reference(monkeypatch)
    out = _attend(p, q, new_kv, cu, generated=gen)
    assert calls == [9]                                 # sequences 0 and 1: 8 + 1 rows
    monkeypatch.undo()
    want = reference.extend_attention(q[:9], p.k_cache, p.v_cache, p.block_tables[:2], cu[:3], p.seq_lens[:2],
                                      0.125, new_kv=(new_kv[0][:9], new_kv[1][:9]))
    assert torch.equal(out[:9], want)
    assert_close(out, loop_extend(q.double(), p.k_cache.double(), p.v_cache.double(), p.block_tables, cu,
                                  p.seq_lens, 0.125), torch.bfloat16)
    # The whole prompt 2 has the bits it has alone.
    alone = _prompts([50], 4, 2, 64)
    s = slice(9, 59)
    assert torch.equal(out[s], _attend(alone[0], q[s].clone(), (new_kv[0][s].clone(), new_kv[1][s].clone()),
                                       cu_lens([50])))


@pytest.mark.parametrize("case", ["float16", "head_dim 48", "keys in float32", "no new rows"])
def test_what_the_kernel_does_not_take_is_the_reference_s(case):
    dtype = torch.float16 if case == "float16" else torch.bfloat16
    head_dim = 48 if case == "head_dim 48" else 64
    p, q, new_kv, cu = _prompts([20, 33], 4, 2, head_dim, dtype=dtype)
    if case == "keys in float32":
        new_kv = (new_kv[0].float(), new_kv[1].float())
    kv = None if case == "no new rows" else new_kv
    want = reference.extend_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, p.seq_lens, 0.125, new_kv=kv)
    assert torch.equal(_attend(p, q, kv, cu), want)
