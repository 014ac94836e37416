"""The reference kernels' per-step memo (what every layer of a step derives from the same
metadata tensors is computed once): never stale when the tensors change in place."""

from __future__ import annotations

import torch
from .kernel_cases import assert_close, loop_decode, make_paged, make_q

from pddgw.kernels import reference as R


def test_store_kv_follows_slots_advanced_in_place():
    k_cache, v_cache = torch.zeros(4, 4, 1, 2), torch.zeros(4, 4, 1, 2)
    slots = torch.tensor([1, 6])
    k = torch.ones(2, 1, 2)
    R.store_kv(k, -k, k_cache, v_cache, slots)
    R.store_kv(2 * k, -2 * k, k_cache, v_cache, slots)          # same tensors: the memo's hit
    slots += 1                                                  # the incremental builder's way
    R.store_kv(3 * k, -3 * k, k_cache, v_cache, slots)
    slots[1] = -1                                               # a skip appears in place
    R.store_kv(4 * k, -4 * k, k_cache, v_cache, slots)
    assert k_cache[:, :, 0, 0].flatten().tolist() == [0, 2, 4, 0, 0, 0, 2, 3] + [0] * 8
    assert torch.equal(v_cache, -k_cache)


def test_decode_follows_seq_lens_and_tables_changed_in_place():
    lens = [3, 9, 14, 6]
    p = make_paged(lens, kv_heads=2, head_dim=8, block_size=4, dtype=torch.float64)
    q = make_q(len(lens), 4, 8, torch.float64)
    tables, seq_lens = p.block_tables.clone(), p.seq_lens.clone()
    for step in range(3):
        out = R.paged_decode_attention(q, p.k_cache, p.v_cache, tables, seq_lens, 0.4)
        again = R.paged_decode_attention(q, p.k_cache, p.v_cache, tables, seq_lens, 0.4)
        want = loop_decode(q, p.k_cache, p.v_cache, tables, seq_lens, 0.4)
        assert_close(out, want, torch.float64)
        assert torch.equal(again, out)
        seq_lens -= 1                                            # shorter: other keys, other mask
        if step == 1:
            tables[1:3, [0, 1]] = tables[1:3, [1, 0]].clone()    # pages swapped in place
