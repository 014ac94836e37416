"""Position-keyed sampling.

The draw for output position i of a request is one uniform number derived
from (seed, i) alone; the token is found by inverse-CDF over the filtered,
sorted distribution.  Batch composition, the node and the moment do not
enter, so a request handed from RLD to MD keeps the same distribution and,
given the same logits, the same tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from pddgw.engines.types import SamplingParams


def position_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, position)."""
    h = hashlib.blake2b(struct.pack("<QQ", seed, position), digest_size=8, key=b"pddgw-sample")
    return (int.from_bytes(h.digest(), "little") >> 11) / float(1 << 53)


def sample_one(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """logits [vocab] -> token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)   # [V]
    probs, order = torch.sort(probs, descending=True, stable=True)
    if params.top_k:
        probs, order = probs[: params.top_k], order[: params.top_k]
    if params.top_p < 1.0:
        cum = torch.cumsum(probs, 0)
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = int(torch.searchsorted(cum, torch.tensor(params.top_p, dtype=cum.dtype))) + 1
        probs, order = probs[:keep], order[:keep]
    cdf = torch.cumsum(probs, 0)
    u = position_uniform(params.seed, position) * float(cdf[-1])
    idx = min(int(torch.searchsorted(cdf, torch.tensor(u, dtype=cdf.dtype), right=True)), len(order) - 1)
    return int(order[idx])


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """logits [S, vocab] for S sequences -> one token each."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy_rows:
        picks = torch.argmax(logits[greedy_rows], dim=-1).tolist()
        for i, t in zip(greedy_rows, picks):
            out[i] = t
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, positions[i])
    return out
