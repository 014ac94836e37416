"""Paged attention as the model layers see it.

The scheduler packs one step's tokens of B sequences into T rows; `AttnMetadata`
tells every attention layer where those rows live in the paged KV pool.  The
layer stores the new K/V (`store_kv`) and then attends with the decode kernel
when every sequence decodes (its one new token a generated one), else with the
extend kernel (which also covers chunked prefill and token-ID extends).  The
extend is told how many of each sequence's new tokens are generated ones (a
decode in a mixed step, tokens relayed before a handoff): a backend whose decode
kernel rounds differently from its extend computes those rows as decodes, so
that a generated token's attention is the same bits whatever path computed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True, slots=True)
class AttnMetadata:
    slot_mapping: torch.Tensor   # [T] int64 flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor   # [B, max_blocks] int32
    cu_q_lens: torch.Tensor      # [B+1] int32, row ranges of each sequence in the packed batch
    seq_lens: torch.Tensor       # [B] int32, tokens in cache after this step (new ones included)
    is_decode: bool              # every sequence decodes: one new token, a generated one
    ops: ModuleType              # kernel backend: pddgw.kernels.reference, cpu_ops or triton_ops
    generated: torch.Tensor | None = None  # [B] int32 host: of each q_len, the last rows that are
                                           # generated tokens (None: none, or is_decode)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttnMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] of the new tokens -> out [T, H, D]."""
    meta.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_decode:
        return meta.ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                               meta.seq_lens, scale)
    return meta.ops.extend_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_q_lens,
                                     meta.seq_lens, scale, generated=meta.generated, new_kv=(k, v))
