"""The paged KV pool: one preallocated K and V tensor per layer.

Blocks are owned by the BlockManager; this module only maps token positions
of a block table to flat slots and moves KV in and out of the pool in the
layout-independent form [layers, 2 (K, V), tokens, kv_heads, head_dim].
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device):
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # caches[layer] = (k [num_blocks, block_size, kv_heads, head_dim], v [same])
        self.caches = [(torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat slots of token positions [start, end) of a sequence -> [end - start] int64."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.int64)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def gather(self, slots: torch.Tensor, layer_start: int, layer_end: int) -> torch.Tensor:
        """KV at slots -> [layers, 2, n, kv_heads, head_dim], contiguous."""
        out = []
        for k, v in self.caches[layer_start:layer_end]:
            flat_k = k.view(-1, *k.shape[2:])                      # [num_blocks * bs, kvh, hd]
            flat_v = v.view(-1, *v.shape[2:])
            out.append(torch.stack((flat_k[slots], flat_v[slots])))  # [2, n, kvh, hd]
        return torch.stack(out)

    def scatter(self, slots: torch.Tensor, data: torch.Tensor, layer_start: int) -> None:
        """data [layers, 2, n, kv_heads, head_dim] -> pool at slots (any float dtype)."""
        for i in range(data.shape[0]):
            k, v = self.caches[layer_start + i]
            k.view(-1, *k.shape[2:])[slots] = data[i, 0].to(self.dtype)
            v.view(-1, *v.shape[2:])[slots] = data[i, 1].to(self.dtype)


def tensor_to_buffer(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    t = t.contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def buffer_to_tensor(buf: memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """View a received byte buffer as a tensor without copying."""
    with warnings.catch_warnings():
        # A read-only buffer is fine: the view is only read.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(DTYPES[dtype]).reshape(tuple(shape))
