"""The paged KV pool: preallocated K and V memory for every layer.

Blocks are owned by the BlockManager; this module only maps token positions
of a block table to pool memory and moves KV in and out of the pool in the
layout-independent form [layers, 2 (K, V), tokens, kv_heads, head_dim].

Two layouts, one interface (`caches[layer] = (k, v)`, each [num_blocks,
block_size, kv_heads, head_dim], contiguous in head_dim, which is all the
attention ops need):

* block-major (CPU): one tensor [num_blocks, layers, 2, block_size, kv_heads,
  head_dim]; `caches` are strided views of it.  One block of every layer is
  then one contiguous run laid out exactly as a chunk of that block's tokens
  on the wire, so a received chunk of one whole block lands in the pool with
  no copy (`block_array`).  A chunk of several blocks is not contiguous in
  any pool layout (its token axis is inside its layer axis): it is copied.
* layer-major (other devices): one contiguous K and V tensor per layer, the
  layout the GPU kernels were tuned on.  A socket cannot write into device
  memory, so a received chunk is staged in (pinned) host memory and copied
  to the device in one transfer whatever the layout.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device, block_major: bool | None = None):
        """block_major: the layout (module docstring); None = block-major on CPU only."""
        self.block_size = block_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_major = self.device.type == "cpu" if block_major is None else block_major
        if self.block_major:
            # data[block] = [layers, 2, block_size, kv_heads, head_dim], contiguous
            self.data: torch.Tensor | None = torch.zeros(
                (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
            # caches[layer] = (k, v), views [num_blocks, block_size, kv_heads, head_dim] (block stride
            # layers * 2 * block_size * kv_heads * head_dim)
            self.caches = [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(num_layers)]
        else:
            self.data = None
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            # caches[layer] = (k [num_blocks, block_size, kv_heads, head_dim], v [same]), contiguous
            self.caches = [(torch.zeros(shape, dtype=dtype, device=device),
                            torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]

    def _runs(self, block_ids: Sequence[int], start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Token positions [start, end) -> (block, first offset, last offset + 1, position) per block touched."""
        bs = self.block_size
        out = []
        pos = start
        while pos < end:
            off = pos % bs
            n = min(bs - off, end - pos)
            out.append((block_ids[pos // bs], off, off + n, pos))
            pos += n
        return out

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat slots of token positions [start, end) of a sequence -> [end - start] int64."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.int64)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def read(self, block_ids: Sequence[int], start: int, end: int, layer_start: int,
             layer_end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """KV of token positions [start, end) -> [layers, 2, n, kv_heads, head_dim], contiguous (a copy).

        `out`: a contiguous tensor of that shape and the pool's dtype, on any device, to copy into.
        """
        if self.data is not None:
            runs = self._runs(block_ids, start, end)
            if len(runs) == 1 and out is None:
                b, o0, o1, _ = runs[0]
                return self.data[b, layer_start:layer_end, :, o0:o1].clone(memory_format=torch.contiguous_format)
            if out is None:
                k0 = self.caches[0][0]
                out = torch.empty((layer_end - layer_start, 2, end - start, *k0.shape[2:]), dtype=self.dtype,
                                  device=self.device)
            for b, o0, o1, pos in runs:
                out[:, :, pos - start : pos - start + o1 - o0] = self.data[b, layer_start:layer_end, :, o0:o1]
            return out
        slots = self.slots(block_ids, start, end)
        out_layers = []
        for k, v in self.caches[layer_start:layer_end]:
            flat_k = k.view(-1, *k.shape[2:])                      # [num_blocks * bs, kvh, hd]
            flat_v = v.view(-1, *v.shape[2:])
            out_layers.append(torch.stack((flat_k[slots], flat_v[slots])))  # [2, n, kvh, hd]
        data = torch.stack(out_layers)
        return data if out is None else out.copy_(data)

    def write(self, block_ids: Sequence[int], start: int, data: torch.Tensor, layer_start: int) -> None:
        """data [layers, 2, n, kv_heads, head_dim] (any float dtype) -> positions [start, start + n)."""
        n = data.shape[2]
        layer_end = layer_start + data.shape[0]
        if self.data is not None:
            for b, o0, o1, pos in self._runs(block_ids, start, start + n):
                # [layers, 2, o1 - o0, kvh, hd]: one strided copy (with the dtype conversion) per block
                self.data[b, layer_start:layer_end, :, o0:o1] = data[:, :, pos - start : pos - start + o1 - o0]
            return
        data = data.to(self.device)
        slots = self.slots(block_ids, start, start + n)
        for i in range(data.shape[0]):
            k, v = self.caches[layer_start + i]
            k.view(-1, *k.shape[2:])[slots] = data[i, 0].to(self.dtype)
            v.view(-1, *v.shape[2:])[slots] = data[i, 1].to(self.dtype)

    def block_array(self, block: int) -> np.ndarray | None:
        """A new writable uint8 array over one block's KV of every layer, laid out as the wire
        chunk of its tokens ([layers, 2, block_size, kv_heads, head_dim]); None if the layout has
        no such run.  A fresh array object each call: its lifetime tells when a user is done."""
        if self.data is None:
            return None
        return self.data[block].view(torch.uint8).reshape(-1).numpy()

    def staging_array(self, nbytes: int) -> np.ndarray:
        """A new uint8 host buffer to receive KV into (not zero-filled; pinned for a device pool)."""
        pin = self.device.type == "cuda"
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).numpy()


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
