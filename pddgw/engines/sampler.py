"""Position-keyed sampling, batched on the logits' device.

The draw for output position i of a request is one uniform number derived
from (seed, i) alone; the token is found by inverse-CDF over the filtered
distribution sorted by logit (vocabulary order when nothing is filtered).
Batch composition, the node and the moment do not enter, so a request
handed from RLD to MD keeps the same distribution and, given the same
logits, the same tokens.

The draw (`position_uniforms`, scalar `position_uniform`) is SplitMix64:
the draw for position i is output i + 1 of a SplitMix64 generator whose
state starts at mix64(seed),

    z = mix64((mix64(seed) + (i + 1) * 0x9E3779B97F4A7C15) mod 2**64)
    u = (z >> 11) / 2**53                      # 53 bits -> float64 in [0, 1)

with mix64 Stafford's variant 13 finalizer (the SplitMix64 output function).
On tensors it runs in int64 two's complement: + and * wrap mod 2**64 on the
CPU and on CUDA, and every right shift is masked to a logical shift, so the
tensor version is bit-identical to the Python-integer one on every device.
float64 and 53 bits because the CDF it is compared with is float64 (see
below): a 24-bit float32 draw would leave tokens of probability < 2**-24
unreachable and quantize the rest.

Each sequence's token is computed by row-local tensor ops (no per-row Python
loop, and no op whose result for a row depends on the other rows):

    1. p = softmax(logits / T) in float64 over the whole vocabulary (a
       per-row kernel: the row's result does not depend on the batch; a
       generic sum/logsumexp would not do: on the CPU a lone long row is
       split across threads, changing its rounding);
    2. candidates in order (logit descending, id ascending): torch.topk of
       distinct int64 keys (float bits, then ~id; no ties for topk to break)
       when top-k bounds the row, else a stable full sort;
    3. cdf = cumsum(p[candidates]) (prefix values do not depend on how many
       columns follow, so the top-k and the full-sort paths agree);
    4. each filter keeps a prefix of the candidates -- top-k the first k,
       top-p the shortest prefix whose mass (of the full distribution)
       reaches top_p, min-p those with p >= min_p * p_max -- and the kept
       set is the shortest of the three (at least one token);
    5. the token is the first candidate whose cdf exceeds u * cdf[kept - 1]
       (torch.searchsorted per row).

A row that filters nothing (top_k 0, top_p 1, min_p 0) skips steps 2-4: its
CDF runs in vocabulary order, so pure temperature sampling sorts nothing.
Greedy rows (temperature 0) take torch.argmax (the first maximum).  Only the
sampled ids cross to the host: one `.tolist()` of an int64 [S] tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pddgw.engines.types import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_TOPK_FRACTION = 4          # top-k path when k <= vocab / 4; above that a full sort is as cheap


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, position); see the module docstring."""
    z = _mix64((_mix64(seed & _MASK64) + (position + 1) * _GOLDEN) & _MASK64)
    return (z >> 11) / float(1 << 53)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_t(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _signed(_M1)
    z = (z ^ _srl(z, 27)) * _signed(_M2)
    return z ^ _srl(z, 31)


def position_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 [S] seeds and positions (>= 0) -> float64 [S] draws, bit-identical to `position_uniform`."""
    z = _mix64_t(_mix64_t(seeds) + (positions + 1) * _signed(_GOLDEN))
    return _srl(z, 11).to(torch.float64) * (1.0 / (1 << 53))


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] float32/16 -> int64 [R, V] keys, all distinct, ordered as (logit, then -id).

    The high 32 bits are the float32 bits made monotone as signed integers,
    the low 32 bits are ~id: torch.topk over them has no ties to break.
    """
    bits = x.to(torch.float32).view(torch.int32)                                         # [R, V]
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)                     # negative floats: flip, so monotone
    low = 0xFFFFFFFF - torch.arange(x.shape[1], dtype=torch.int64, device=x.device)     # [V] ~id
    return torch.add(low, bits, alpha=1 << 32)                    # [R, V] int64: bits * 2**32 + ~id, exact


def _sample_rows(x: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                 k_bound: int) -> torch.Tensor:
    """x [R, V] logits of non-greedy rows -> int64 [R] token ids (on x's device).

    k_bound > 0: every row has 0 < top_k <= k_bound: the top k_bound
    candidates, by torch.topk over `_order_keys` (then sorted; no ties, so
    the same prefix for any bound); 0: a stable sort of the whole vocabulary;
    -1: no row filters anything, the CDF runs in vocabulary order (no sort).
    """
    dev, vocab = x.device, x.shape[1]
    f64 = dict(dtype=torch.float64, device=dev)
    temp = torch.tensor([p.temperature for p in params], **f64)                          # [R]
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], **f64)     # [R]
    min_p = torch.tensor([p.min_p for p in params], **f64)                               # [R]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         dtype=torch.int64, device=dev)                                  # [R]
    seeds = torch.tensor([p.seed for p in params], dtype=torch.int64, device=dev)        # [R]
    pos = torch.tensor(list(positions), dtype=torch.int64, device=dev)                   # [R]
    u = position_uniforms(seeds, pos)[:, None]                                           # [R, 1]

    probs = torch.softmax(x / temp[:, None], dim=-1)             # [R, V] float64 (x promoted exactly)
    if k_bound < 0:
        cdf = probs.cumsum(dim=-1)                                                       # [R, V]
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)            # first cdf > target
        return idx.clamp_max(vocab - 1)
    if k_bound and x.dtype != torch.float64:    # (float64 has no room for the id in a key: full sort)
        cand = torch.topk(_order_keys(x), k_bound, dim=-1).indices                       # [R, K] distinct keys
    else:
        cand = x.sort(dim=-1, descending=True, stable=True).indices                      # [R, V]
    k = cand.shape[1]
    p = probs.gather(1, cand)                                                            # [R, K] non-increasing
    cdf = p.cumsum(dim=-1)                                                               # [R, K] non-decreasing
    keep = top_k.clamp(1, k)                                                             # [R]
    if any(q.top_p < 1.0 for q in params):     # (a filter that keeps everything is skipped: same result)
        keep = torch.minimum(keep, torch.searchsorted(cdf, top_p[:, None]).squeeze(1) + 1)  # first cdf >= top_p
    if any(q.min_p > 0.0 for q in params):
        keep = torch.minimum(keep, (p >= min_p[:, None] * p[:, :1]).sum(dim=-1))         # p non-increasing
    keep = keep.clamp(1, k)                                                              # [R]
    target = u * cdf.gather(1, (keep - 1)[:, None])                                      # [R, 1]
    idx = torch.minimum(torch.searchsorted(cdf, target, right=True).squeeze(1), keep - 1)  # first cdf > target
    return cand.gather(1, idx[:, None]).squeeze(1)                                       # [R]


def _group(p: SamplingParams, vocab: int) -> int:
    """Which `_sample_rows` mode serves a row: -2 greedy, -1 unfiltered, 0 full sort, 1 top-k."""
    if p.greedy:
        return -2
    if 0 < p.top_k * _TOPK_FRACTION <= vocab:
        return 1
    if p.top_p >= 1.0 and p.min_p == 0.0 and not 0 < p.top_k < vocab:
        return -1
    return 0


def sample_ids(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> torch.Tensor:
    """logits [S, vocab] -> int64 [S] token ids on the logits' device (nothing crosses to the host).

    Rows are grouped by mode (greedy, unfiltered, full sort, top-k); a row's
    token does not depend on its group's other rows nor on the top-k bound.
    """
    n, vocab = logits.shape
    dev = logits.device
    groups = [_group(p, vocab) for p in params]
    out = torch.zeros(n, dtype=torch.int64, device=dev)                                  # [S]
    for mode in (-2, -1, 0, 1):
        rows = [i for i, g in enumerate(groups) if g == mode]
        if not rows:
            continue
        index = None if len(rows) == n else torch.tensor(rows, dtype=torch.int64, device=dev)
        x = logits if index is None else logits.index_select(0, index)                   # [R, V]
        if mode == -2:
            ids = torch.argmax(x, dim=-1)                                                # the first maximum
        else:
            k_bound = max(params[i].top_k for i in rows) if mode == 1 else mode
            ids = _sample_rows(x, [params[i] for i in rows], [positions[i] for i in rows], k_bound)
        if index is None:
            return ids
        out.index_copy_(0, index, ids)
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """logits [S, vocab] for S sequences -> one token each; only the S int64 ids cross to the host."""
    return sample_ids(logits, params, positions).tolist()


def sample_one(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """logits [vocab] -> token id (the same as that row inside any batch)."""
    return sample(logits[None], [params], [position])[0]


def logprobs(logits: torch.Tensor, ids: torch.Tensor,
             top_n: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities on the logits' device, as small tensors (not yet wired to the API).

    logits [S, vocab], ids int64 [S] on the same device (the sampled tokens, from `sample_ids`) ->
    (float32 [S] log p(ids), int64 [S, top_n] the top_n ids by probability,
    float32 [S, top_n] their log p).  The distribution is the model's (log-softmax of
    the raw logits, before temperature and filters), as OpenAI and vLLM report it.
    """
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)                             # [S, V]
    chosen = lp.gather(1, ids[:, None]).squeeze(1)                                      # [S]
    top = torch.topk(lp, min(top_n, lp.shape[1]), dim=-1)                                # [S, n]
    return chosen, top.indices, top.values
