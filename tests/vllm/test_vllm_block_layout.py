"""BlockLayout learns any per-block packing from the backend's own cache-write op: here two
made-up backends, one with each block contiguous but K packed in dims-major order, one with K
and V in separate planes ([2, blocks, ...], as vLLM's CUDA FlashAttention keeps them), so a
block is not one contiguous run."""

from __future__ import annotations

import types

import pytest
import torch

from pddgw.engines.vllm_connector import BlockLayout

BLOCKS, BS, KVH, HD = 6, 8, 2, 4


def planes_cache():
    # Storage [2, blocks, bs, kvh, hd]; the engine sees [blocks, 2, bs, kvh, hd] (block first).
    return torch.zeros(2, BLOCKS, BS, KVH, HD).permute(1, 0, 2, 3, 4)


def planes_write(cache, key, value, slots):
    cache[slots // BS, 0, slots % BS] = key
    cache[slots // BS, 1, slots % BS] = value


def packed_cache():
    return torch.zeros(BLOCKS, KVH, 2, HD, BS)        # per head: K then V, dims-major (transposed)


def packed_write(cache, key, value, slots):
    for i, s in enumerate(slots.tolist()):
        cache[s // BS, :, 0, :, s % BS] = key[i]
        cache[s // BS, :, 1, :, s % BS] = value[i]


def layer_of(write):
    impl = types.SimpleNamespace(do_kv_cache_update=lambda layer, k, v, cache, slots: write(cache, k, v, slots))
    return types.SimpleNamespace(impl=impl)


@pytest.mark.parametrize("make,write", [(planes_cache, planes_write), (packed_cache, packed_write)],
                         ids=["K and V planes", "packed, dims-major"])
def test_written_tokens_land_where_the_backend_puts_them_and_read_back(make, write):
    layout = BlockLayout.learn(layer_of(write), make(), BS, KVH, HD, scratch_block=1)
    g = torch.Generator().manual_seed(0)
    data = torch.randn(2, 2, 13, KVH, HD, generator=g)          # 2 layers, tokens [5, 18)
    block_ids = [4, 2, 5]
    ours, theirs = [make(), make()], [make(), make()]
    layout.write(ours, block_ids, BS, 5, data)
    slots = torch.tensor([block_ids[p // BS] * BS + p % BS for p in range(5, 18)])
    for layer in range(2):
        write(theirs[layer], data[layer, 0], data[layer, 1], slots)
        assert torch.equal(ours[layer], theirs[layer])
    assert torch.equal(layout.read(ours, block_ids, BS, 5, 18, KVH, HD), data)
    assert torch.equal(layout.read(ours, block_ids, BS, 9, 12, KVH, HD), data[:, :, 4:7])
