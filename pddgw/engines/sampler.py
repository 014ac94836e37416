"""Position-keyed sampling, batched on the logits' device.

Invariant: the draw for output position i of a request is one uniform number
derived from (seed, i) alone, so batch composition, the node and the moment
do not enter: a request handed from RLD to MD keeps the same distribution
and, given the same logits, the same tokens.

The draw (`position_uniform` on the host, `position_uniforms` on tensors) is
output i + 1 of a SplitMix64 generator seeded with mix64(seed), as a 53-bit
float64 (a 24-bit float32 draw would leave tokens of probability < 2**-24
unreachable).  The tensor version wraps in int64 and masks every right shift,
so it is bit-identical to the Python-integer one on every device.

Per row, with row-local ops only (no result depends on other rows):
  1. p = softmax(logits / T) in float64 (a per-row kernel);
  2. candidates ordered (logit desc, id asc): topk of distinct int64 keys
     when top-k bounds the row, else a stable full sort;
  3. cdf = cumsum(p[candidates]);
  4. top-k, top-p and min-p each keep a prefix; the shortest one is kept;
  5. the token is the first candidate whose cdf exceeds u * cdf[kept - 1].
A row that filters nothing skips 2-4 (vocabulary order); greedy rows take
`first_argmax`.  `penalties.adjust_logits` applies logit_bias, min_tokens, penalties
(vLLM's order and formulas) and the grammar mask first; logprobs stay those
of the raw logits.  Only the sampled ids cross to the host.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pddgw.core.sampling import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_TOPK_FRACTION = 4          # top-k path when k <= vocab / 4; above that a full sort is as cheap
_SPECULATIVE_CAP = 1024     # the longest speculative prefix (columns); longer rows take the full sort
_BUCKETS = 4096             # quarter-octave buckets of a float64 p in [0, 1]: its 12 bits after the sign
_BLOCK_BYTES = 1 << 22      # rows per pass of the speculative path's softmax: ~4 MB of float64
_TOP_BUCKETS = 256          # buckets searched for the top-p cut: p >= 2**-63
_NEAR_BUCKETS = 64          # quarter-octave buckets below p_max that `_tighter_cut` tells apart
_QUARTER_OCTAVE = math.log(2.0) / 4   # a quarter octave of p, in logits at temperature 1
_MASS_SLACK = 1e-9          # bucket masses sum in another order than the cdf: aim a little past top_p
_SCRATCH_MAX_BYTES = 64 << 20  # reused buffers kept per thread up to this size
_WINDOW = 2.0 ** -12        # first floor: p_max / 4096 (tokens within ~8.3 T of the top logit)
_CUT_MARGIN = 1e-6          # relative margin on the logit cut, far above the rounding of p vs the cut
_ARGMAX_CHUNK = 128         # columns per chunk of `first_argmax`'s two-level search


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, position); see the module docstring."""
    z = (_mix64(seed & _MASK64) + (position + 1) * _GOLDEN) & _MASK64
    return (_mix64(z) >> 11) / 9007199254740992.0      # 2 ** 53


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


class _Rows(NamedTuple):
    """The per-row sampling parameters of R rows, as tensors on the logits' device."""

    temp: torch.Tensor      # float64 [R]
    top_p: torch.Tensor     # float64 [R]; 2.0 where top_p is 1 (no cdf reaches it: keeps everything)
    min_p: torch.Tensor     # float64 [R]
    top_k: torch.Tensor     # int64 [R, 1] in [1, vocab]; vocab where top_k is 0 or >= vocab
    u: torch.Tensor         # float64 [R, 1] the position-keyed draws
    drop: torch.Tensor      # float64 [R] the speculative level 1's cut below x_max (`_drop`)
    width: torch.Tensor     # float64 [R] a quarter octave of p in logits, T ln(2) / 4 (`_tighter_cut`)
    mass: torch.Tensor      # float64 [R, 1] top_p + 1e-9, the mass the speculative levels' floors aim at

    @staticmethod
    def of(params: Sequence[SamplingParams], positions: Sequence[int], vocab: int, dev: torch.device) -> _Rows:
        # The floats in one host -> device copy, the draws among them (`position_uniform` on the
        # host: 0.7 us a row, against ~20 tensor ops for `position_uniforms`).
        temp = [p.temperature for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        temp, top_p, min_p, u, drop, width, mass = torch.tensor(
            [temp, top_p, [p.min_p for p in params], [position_uniform(p.seed, i) for p, i in zip(params, positions)],
             [_drop(p) for p in params], [t * _QUARTER_OCTAVE for t in temp], [q + _MASS_SLACK for q in top_p]],
            dtype=torch.float64, device=dev)                                             # [R] each
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.int64,
                             device=dev)
        return _Rows(temp, top_p, min_p, top_k[:, None], u[:, None], drop, width, mass[:, None])

    def take(self, index: torch.Tensor) -> _Rows:
        return _Rows(*(t.index_select(0, index) for t in self))


def _probs(x: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """x [R, V] logits -> float64 [R, V] softmax(x / T) (x promoted exactly; a per-row kernel)."""
    return torch.softmax(x / rows.temp[:, None], dim=-1)


def _keep(cand_p: torch.Tensor, cdf: torch.Tensor, counted: torch.Tensor, rows: _Rows, top_p: bool,
          min_p: bool) -> torch.Tensor:
    """How many candidates the filters keep (int64 [R, 1], >= 1), before clamping to the columns.

    cand_p [R, K] the candidates' probabilities (non-increasing), cdf [R, K] their cumsum,
    counted [R, *] the probabilities min-p counts (the top-k candidates, or the whole row).
    top_p / min_p False: that filter keeps everything in this
    batch (skipped: same result).  Where the top-p prefix does not end within the K
    columns its count is K + 1.
    """
    keep = rows.top_k                                                                    # [R, 1]
    if top_p:
        keep = torch.minimum(keep, torch.searchsorted(cdf, rows.top_p[:, None]).add_(1))  # first cdf >= top_p
    if min_p:
        keep = torch.minimum(keep, (counted >= rows.min_p[:, None] * cand_p[:, :1]).sum(dim=-1, keepdim=True))
    return keep.clamp_min(1)


def _draw(cand: torch.Tensor, cdf: torch.Tensor, keep: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """The first candidate whose cdf exceeds u * cdf[keep - 1]; keep int64 [R, 1] in [1, K] -> int64 [R]."""
    last = keep - 1                                                                      # [R, 1]
    idx = torch.searchsorted(cdf, rows.u * cdf.gather(1, last), right=True)             # [R, 1] first cdf > target
    return cand.gather(1, torch.minimum(idx, last)).squeeze(1)                           # [R]


def _sorted_rows(x: torch.Tensor, probs: torch.Tensor, rows: _Rows, k_bound: int, top_p: bool,
                 min_p: bool) -> torch.Tensor:
    """Candidates by topk of `_order_keys` (k_bound > 0) or a stable full sort (0) -> int64 [R]."""
    if k_bound and x.dtype != torch.float64:    # (float64 has no room for the id in a key: full sort)
        cand = torch.topk(_order_keys(x), k_bound, dim=-1).indices                       # [R, K] distinct keys
    else:
        cand = x.sort(dim=-1, descending=True, stable=True).indices                      # [R, V]
    p = probs.gather(1, cand)                                                            # [R, K] non-increasing
    cdf = p.cumsum(dim=-1)                                                               # [R, K] non-decreasing
    keep = _keep(p, cdf, p, rows, top_p, min_p).clamp_max(cand.shape[1])                 # [R, 1]
    return _draw(cand, cdf, keep, rows)


def _sample_rows(x: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                 k_bound: int) -> torch.Tensor:
    """x [R, V] logits of non-greedy rows -> int64 [R] token ids (on x's device).

    k_bound > 0: every row has 0 < top_k <= k_bound: the top k_bound
    candidates, by torch.topk over `_order_keys` (then sorted; no ties, so
    the same prefix for any bound); 0: a stable sort of the whole vocabulary;
    -1: no row filters anything, the CDF runs in vocabulary order (no sort).
    """
    rows = _Rows.of(params, positions, x.shape[1], x.device)
    # On the CPU the blocked, in-place softmax (the same bits; 1.2 vs 4.4 ms at [16, 49152]).
    probs = _blocked_probs(x, rows)[0] if x.device.type == "cpu" else _probs(x, rows)   # [R, V] float64
    if k_bound < 0:
        cdf = probs.cumsum_(dim=-1)                                                      # [R, V] in place
        idx = torch.searchsorted(cdf, rows.u * cdf[:, -1:], right=True).squeeze(1)       # first cdf > target
        return idx.clamp_max(x.shape[1] - 1)
    return _sorted_rows(x, probs, rows, k_bound, any(q.top_p < 1.0 for q in params),
                        any(q.min_p > 0.0 for q in params))


def _drop(p: SamplingParams) -> float:
    """Level 1's cut below x_max, in logits: T log(ratio) for the floor ratio * p_max it keeps
    (1 / 4096 with top-p, at least min_p), less a relative 1e-6 margin; -inf: every token."""
    ratio = max(_WINDOW if p.top_p < 1.0 else 0.0, p.min_p)
    if ratio == 0.0:
        return -math.inf
    d = p.temperature * math.log(ratio)
    return d - _CUT_MARGIN * (1.0 + abs(d))


def _cut_base(xmax: torch.Tensor) -> torch.Tensor:
    """float64 [R] largest logits -> x_max less a relative 1e-6 margin, the start of every cut
    (`_drop`, `_tighter_cut`, level 2); NaN where x_max is not finite (its softmax is NaN:
    no token is cut).

    p_j >= ratio * p_max means x_j >= x_max + T log(ratio) up to a few ulps, which the margins
    cover many times over.  A cut too high only sends its row to the next level.
    """
    return torch.add(xmax, xmax.abs(), alpha=-_CUT_MARGIN).add_(xmax - xmax)


def _mark(xs: torch.Tensor, cut: torch.Tensor, mask: torch.Tensor, hit: torch.Tensor) -> None:
    """mask [R, V] bool = xs [R, V] >= cut [R, 1], through hit [R, V] (xs's dtype).

    The comparison writes 1.0 / 0.0 in xs's dtype, then bytes: torch's comparison kernels
    take a scalar loop when they write bool, a vector one otherwise (0.6 ms against 0.25 ms
    with the copy, for [32, 32000] float32 on two cores).
    """
    torch.ge(xs, cut, out=hit)                                                           # (NaN: 0.0, as ge)
    mask.copy_(hit)


def _marks(total: int, device: torch.device) -> torch.Tensor:
    """This thread's bool mask for `total` marks, padded with False to whole 8-byte words."""
    mask = _scratch.get("mask", -(-total // 8) * 8, torch.bool, device)                 # [8W]
    if total % 8:
        mask[total:] = False
    return mask


def _marked(mask: torch.Tensor) -> torch.Tensor:
    """Flat indices (ascending) of a `_marks` mask's True entries: int64 [M], M a few % of it.

    nonzero over the mask's 8-byte words first, then over the hit words' bytes: a sparse
    mask is read a word, not a byte, at a time (several times faster).
    """
    words = mask.view(torch.int64).nonzero().squeeze(1)                                  # [W'] words with a hit
    hits = mask.view(-1, 8).index_select(0, words).view(-1).nonzero().squeeze(1)        # [M] in those words' bytes
    return torch.add(hits & 7, words.index_select(0, hits >> 3), alpha=8)                 # [M]


def _at_least(xs: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """Flat indices (ascending) of xs [R, V] >= cut [R, 1]: int64 [M]."""
    mask = _marks(xs.numel(), xs.device)
    hit = _scratch.get("hit", xs.numel(), xs.dtype, xs.device).view(xs.shape)          # [R, V]
    _mark(xs, cut, mask[: xs.numel()].view(xs.shape), hit)
    return _marked(mask)


class _Scratch(threading.local):
    """Per-thread buffers the CPU sampling paths (`_blocked_probs`) reuse from step to step.

    Why: glibc hands freed multi-MB blocks back to the kernel, so fresh [R, V] float64
    tensors every step page-fault on first touch: the softmax of 8 x 32000 logits took
    2.6 ms with fresh buffers, 0.5 ms in reused ones.  One set per thread (engines
    sample in their worker threads); buffers over 64 MB are not kept.  Nothing that
    views them outlives the call.  They are normal tensors, never inference tensors: one
    thread may sample inside inference mode (a torch engine's step) and outside it (vLLM's
    logits processor).
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of numel elements (uninitialised), this thread's `name` buffer when it fits."""
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            with torch.inference_mode(False):
                buf = torch.empty(numel, dtype=dtype, device=device)
            if numel * buf.element_size() <= _SCRATCH_MAX_BYTES:
                self.buffers[name] = buf
        return buf[:numel]


_scratch = _Scratch()


class _Softmax(NamedTuple):
    """Step 1 of R rows, and the largest logits the speculative levels cut from."""

    probs: torch.Tensor     # float64 [R, V] = `_probs(x, rows)`, bit for bit
    xmax: torch.Tensor      # float64 [R] the largest logit
    base: torch.Tensor      # float64 [R] `_cut_base(xmax)`

    def take(self, index: torch.Tensor) -> _Softmax:
        return _Softmax(*(t.index_select(0, index) for t in self))


def _blocked_probs(x: torch.Tensor, rows: _Rows, xs: torch.Tensor | None = None,
                   cut: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [R, V] -> (probs float64 [R, V] = `_probs(x, rows)` bit for bit, and with `cut` [R] the
    flat indices (ascending) of xs [R, V] >= cut: `_at_least(xs, cut[:, None])`).

    A few rows at a time (~4 MB of float64) while they are in the cache; the softmax is
    per-row, so blocks change nothing.  probs is this thread's scratch, valid until its next call.
    """
    r, vocab = x.shape
    block = max(1, _BLOCK_BYTES // (8 * vocab))
    probs = _scratch.get("probs", r * vocab, torch.float64, x.device).view(r, vocab)    # [R, V]
    temp = rows.temp[:, None]                                                            # [R, 1]
    if cut is not None:
        mask = _marks(r * vocab, x.device)
        marks, cut = mask[: r * vocab].view(r, vocab), cut[:, None]                      # [R, V], [R, 1]
        hit = _scratch.get("hit", min(block, r) * vocab, xs.dtype, x.device).view(-1, vocab)  # [b, V]
    for i in range(0, r, block):
        j = min(r, i + block)
        t = probs[i:j]
        # x / T in float64, x promoted exactly in place (torch.div(x, T) would promote into a
        # fresh buffer, page faults included), and its softmax in place (the kernel reads each
        # entry before it writes it).
        t.copy_(x[i:j]).div_(temp[i:j])
        torch.ops.aten._softmax.out(t, -1, False, out=t)                                 # = torch.softmax(t)
        if cut is not None:
            _mark(xs[i:j], cut[i:j], marks[i:j], hit[: j - i])
    return probs, None if cut is None else _marked(mask)


def _second_floor(probs: torch.Tensor, pmax: torch.Tensor, rows: _Rows, min_p: bool) -> torch.Tensor:
    """Level 2: float64 [R] a p below which no token is in the top-p set (0: none), at least
    min_p * p_max.

    The floor of the quarter-octave bucket of p (sign, exponent and two mantissa bits of
    the float64: one shift) at which the mass summed per bucket from the top reaches
    top_p + 1e-9 (the slack covers the other summation order).  Only p >= 2**-63 is
    searched; a row not reaching top_p there gets 0.
    """
    r = probs.shape[0]
    bucket = (probs.view(torch.int64) >> 50).bitwise_and_(_BUCKETS - 1)                  # [R, V] (&: NaN-safe)
    mass = torch.zeros(r, _BUCKETS, dtype=torch.float64, device=probs.device)
    mass = mass.scatter_add_(1, bucket, probs)[:, -_TOP_BUCKETS:].flip(1).cumsum(dim=1)  # [R, 256] from the top
    j = torch.searchsorted(mass, rows.mass).squeeze(1)                                   # [R] 256: never
    edge = ((_BUCKETS - 1 - j) << 50).view(torch.float64)                                # [R] that bucket's floor
    floor = torch.where((rows.top_p < 1.0) & (j < _TOP_BUCKETS), edge, 0.0)
    return torch.maximum(floor, rows.min_p * pmax) if min_p else floor


def _tighter_cut(v: torch.Tensor, p: torch.Tensor, row: torch.Tensor, cut: torch.Tensor, sm: _Softmax,
                 rows: _Rows) -> torch.Tensor:
    """Level 1's cut [R] raised, from the candidates it selected: logits v [M] and probabilities
    p [M] of rows row [M].

    Why: p_max / 4096 selects ~3x the top-p set on the engine bench's model, and sorting the
    candidates is the costliest step after the softmax.  The cut is the lower edge of the first
    quarter-octave bucket of p / p_max (by logit) where the mass from the top reaches
    top_p + 1e-9, or `cut` where none does.
    """
    r = cut.shape[0]
    down = (sm.xmax.index_select(0, row) - v) / rows.width.index_select(0, row)          # [M] quarter octaves down
    bucket = torch.add(down.to(torch.int64).clamp_(max=_NEAR_BUCKETS - 1), row, alpha=_NEAR_BUCKETS)  # [M]
    mass = torch.bincount(bucket, weights=p, minlength=r * _NEAR_BUCKETS).view(r, _NEAR_BUCKETS).cumsum(dim=1)
    j = torch.searchsorted(mass, rows.mass).squeeze(1)                                   # [R] B: never
    edge = torch.addcmul(sm.base, (j + 1).to(torch.float64), rows.width, value=-1.0 - _CUT_MARGIN)
    # (Non-top-p rows reach no bucket; the last bucket also holds everything further down:
    # reaching top_p there bounds nothing.)
    return torch.where(j < _NEAR_BUCKETS - 1, torch.maximum(edge.to(cut.dtype), cut), cut)


def _prefix_candidates(xs: torch.Tensor, sm: _Softmax, cut: torch.Tensor, flat: torch.Tensor, rows: _Rows,
                       cap: int, tighten: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefix of each row's (logit desc, id asc) order at or above a cut [R] of xs [R, V]
    (float32 or float64 logits): flat [M] the indices (ascending) of xs >= cut.  `tighten`: only
    down to `_tighter_cut`, a shorter prefix of the same order.

    -> (cand int64 [R, W] ids, cand_p float64 [R, W] their probabilities, n int64 [R]):
    the first n of each row are exactly the first n of the stable full sort, the rest
    padding (id 0, p 0: the cdf stays flat); W <= cap is the longest prefix (at least 1).
    n is 0 where the prefix exceeds `cap`.
    """
    r, vocab = xs.shape
    dev = xs.device
    row = torch.div(flat, vocab, rounding_mode="floor")                                  # [M]
    v, p = xs.view(-1).index_select(0, flat), sm.probs.view(-1).index_select(0, flat)    # [M] logits, probs
    if tighten:
        # A higher cut: a shorter prefix of the same order.
        pick = (v >= _tighter_cut(v, p, row, cut, sm, rows).index_select(0, row)).nonzero().squeeze(1)  # [M']
        flat, row, v, p = (t.index_select(0, pick) for t in (flat, row, v, p))
    n = torch.bincount(row, minlength=r)                                                 # [R]
    longest = torch.bincount(n).shape[0] - 1             # the longest prefix (a shape: no read of the data)
    if longest > cap:
        # Rows over the cap: none of theirs (the full sort takes them).
        pick = (n <= cap).index_select(0, row).nonzero().squeeze(1)                      # [M']
        flat, row, v, p = (t.index_select(0, pick) for t in (flat, row, v, p))
        n = n.masked_fill(n > cap, 0)
        longest = torch.bincount(n).shape[0] - 1
    # Sorted by (row, logit desc, id asc); ties keep the ids' ascending order (stable).
    order = _row_order_keys(v, row).sort(stable=True).indices                            # [M']
    flat, row, p = (t.index_select(0, order) for t in (flat, row, p))
    col = torch.arange(flat.shape[0], device=dev) - (n.cumsum(0) - n).index_select(0, row)  # [M'] rank in its row
    width = max(longest, 1)
    cand = torch.zeros(r, width, dtype=torch.int64, device=dev)                          # [R, W]
    cand_p = torch.zeros(r, width, dtype=torch.float64, device=dev)                      # [R, W]
    cand.index_put_((row, col), torch.add(flat, row, alpha=-vocab))
    cand_p.index_put_((row, col), p)
    return cand, cand_p, n


def _row_order_keys(v: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Logits v [M] of rows row [M] -> int64 [M] keys ascending in (row, logit desc).

    float32 logits: the row above 32 bits, below them the float bits made monotone and
    inverted (-0.0 first made +0.0: the full sort sees them equal).  float64 has no room
    beside the row: a stable sort by logit first, its rank as the low bits.
    """
    if v.dtype == torch.float64:
        rank = torch.empty_like(row)
        rank[v.sort(descending=True, stable=True).indices] = torch.arange(v.shape[0], device=v.device)
        return row * (1 << 32) + rank                                                    # (M < 2**32)
    bits = (v + 0.0).view(torch.int32)                                                   # [M] signed bits
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)                                            # int32 [M] monotone in v
    return torch.add((1 << 31) - 1, row, alpha=1 << 32).sub_(mono)                       # low: in [0, 2**32)


def _prefix_draw(xs: torch.Tensor, sm: _Softmax, cut: torch.Tensor, flat: torch.Tensor, rows: _Rows, top_p: bool,
                 min_p: bool, cap: int, tighten: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3-5 on the prefix above cut [R] (flat: `_prefix_candidates`) -> (int64 [R] ids,
    bool [R] exact).

    exact: the kept set ends within the prefix, so the id is the full sort's, bit for
    bit; elsewhere the id is meaningless.
    """
    cand, cand_p, n = _prefix_candidates(xs, sm, cut, flat, rows, cap, tighten and top_p)  # [R, W] x 2, [R]
    cdf = cand_p.cumsum(dim=-1)                                                # [R, W]: the full cdf's prefix
    # min-p counted over the whole row: a permutation of the full sort's p, the same count.
    keep = _keep(cand_p, cdf, sm.probs, rows, top_p, min_p)                              # [R, 1]
    return _draw(cand, cdf, keep.clamp_max(cand.shape[1]), rows), keep.view(-1) <= n


def _sample_speculative(x: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                        cap: int = 0) -> torch.Tensor:
    """The full-sort rows of `_sample_rows(x, params, positions, 0)`, bit-identical, without
    sorting the vocabulary where a short prefix of the order holds the kept set.  -> int64 [R].

    Why: a stable sort of 32000 logits costs ~2.5 ms per CPU row (~80 ms at batch 32), while
    a top-p / min-p kept set is usually tens to hundreds of tokens.  Level 1 cuts at a logit
    (T log(1/4096) for top-p, T log(min_p) for min-p), level 2 at the floor of a histogram of
    the row's top-p mass, level 3 is the full sort.  {x >= cut} is a prefix of the order, so
    any cut is exact; the cuts only decide how often later levels run.  CPU only: a GPU sorts
    the vocabulary in well under a millisecond, and data-dependent shapes would sync the host.
    """
    vocab = x.shape[1]
    cap = min(cap or _SPECULATIVE_CAP, vocab)
    rows = _Rows.of(params, positions, vocab, x.device)
    top_p, min_p = any(q.top_p < 1.0 for q in params), any(q.min_p > 0.0 for q in params)
    xs = (x if x.dtype in (torch.float32, torch.float64) else x.float()).contiguous()    # [R, V] exact, to compare
    xmax = xs.amax(dim=-1).to(torch.float64)                                             # [R]
    base = _cut_base(xmax)                                                               # [R]
    # 1. The prefix down to p_max / 4096 (marked with step 1), tightened to the candidates' top-p mass.
    cut = (base + rows.drop).to(xs.dtype)                                                # [R]
    probs, flat = _blocked_probs(x, rows, xs, cut)                                       # [R, V], [M]
    sm = _Softmax(probs, xmax, base)
    ids, exact = _prefix_draw(xs, sm, cut, flat, rows, top_p, min_p, cap, tighten=True)
    rest = (~exact).nonzero().squeeze(1)                                                 # [F]
    if rest.shape[0] and top_p:
        # 2. Those rows again, from the floor of their top-p mass histogram.
        sub, sm_sub, xs_sub = rows.take(rest), sm.take(rest), xs.index_select(0, rest)
        pmax = sm_sub.probs.amax(dim=-1)                                                 # [F]
        drop = sub.temp * torch.log(_second_floor(sm_sub.probs, pmax, sub, min_p) / pmax)  # [F]
        cut = (sm_sub.base + drop.sub_(drop.abs().add_(1.0), alpha=_CUT_MARGIN)).to(xs.dtype)
        got, ok = _prefix_draw(xs_sub, sm_sub, cut, _at_least(xs_sub, cut[:, None]), sub, top_p, min_p, cap)
        ids.index_copy_(0, rest, got)
        rest = rest[~ok]                                                                 # [F']
    if rest.shape[0]:
        # 3. The full sort.
        full = _sorted_rows(x.index_select(0, rest), probs.index_select(0, rest), rows.take(rest), 0,
                            top_p, min_p)                                                # [F']
        ids.index_copy_(0, rest, full)
    return ids


def _group(p: SamplingParams, vocab: int) -> int:
    """Which `_sample_rows` mode serves a row: -2 greedy, -1 unfiltered, 0 full sort, 1 top-k."""
    if p.greedy:
        return -2
    if 0 < p.top_k * _TOPK_FRACTION <= vocab:
        return 1
    if p.top_p >= 1.0 and p.min_p == 0.0 and not 0 < p.top_k < vocab:
        return -1
    return 0


def _speculate(x: torch.Tensor, params: Sequence[SamplingParams]) -> bool:
    """Full-sort rows take the speculative prefix on the CPU, when top-p or min-p can bound it.

    (On CUDA a sort of the vocabulary is cheap and the data-dependent shapes of the
    speculative path would each cost a host sync.)
    """
    return x.device.type == "cpu" and any(p.top_p < 1.0 or p.min_p > 0.0 for p in params)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [S, V] -> int64 [S]: exactly torch.argmax(x, dim=-1), the first maximum of each row (its
    first NaN where it has one, as argmax treats NaN as the largest).

    Why: argmax's row reduction is not vectorized on the CPU (0.85 ms for [32, 32000] float32,
    amax 0.05 ms).  Two levels instead, ~0.1 ms: amax per 128-column chunk, argmax over the
    chunks, argmax inside the first chunk holding the maximum (which holds its first occurrence).
    """
    n, vocab = x.shape
    c = _ARGMAX_CHUNK
    if x.device.type != "cpu" or vocab < 4 * c:
        return torch.argmax(x, dim=-1)
    full = vocab // c
    maxima = x[:, : full * c].view(n, full, c).amax(dim=-1)                             # [S, V // c]
    if vocab % c:
        maxima = torch.cat((maxima, x[:, full * c :].amax(dim=-1, keepdim=True)), dim=1)  # [S, ceil(V / c)]
    first = maxima.argmax(dim=-1)                                                       # [S] chunk
    # The last chunk may be narrower: its columns past the vocabulary repeat column V - 1,
    # which then occurs first at its own place, so the argmax below never lands on a repeat.
    cols = (first[:, None] * c + torch.arange(c, device=x.device)).clamp_(max=vocab - 1)  # [S, c]
    return first * c + x.gather(1, cols).argmax(dim=-1)


def sample_ids(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> torch.Tensor:
    """logits [S, vocab] -> int64 [S] token ids on the logits' device (nothing crosses to the host).

    Rows are grouped by mode (greedy, unfiltered, full sort, top-k); a row's
    token does not depend on its group's other rows nor on the top-k bound.
    """
    n, vocab = logits.shape
    dev = logits.device
    groups = [_group(p, vocab) for p in params]
    out = None
    for mode in (-2, -1, 0, 1):
        rows = [i for i, g in enumerate(groups) if g == mode]
        if not rows:
            continue
        index = None if len(rows) == n else torch.tensor(rows, dtype=torch.int64, device=dev)
        x = logits if index is None else logits.index_select(0, index)                   # [R, V]
        if mode == -2:
            ids = first_argmax(x)
        elif mode == 0 and _speculate(x, [params[i] for i in rows]):
            ids = _sample_speculative(x, [params[i] for i in rows], [positions[i] for i in rows])
        else:
            k_bound = max(params[i].top_k for i in rows) if mode == 1 else mode
            ids = _sample_rows(x, [params[i] for i in rows], [positions[i] for i in rows], k_bound)
        if index is None:
            return ids
        if out is None:
            out = torch.zeros(n, dtype=torch.int64, device=dev)                          # [S]
        out.index_copy_(0, index, ids)
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """logits [S, vocab] for S sequences -> one token each; only the S int64 ids cross to the host."""
    return sample_ids(logits, params, positions).tolist()


def sample_one(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """logits [vocab] -> token id (the same as that row inside any batch)."""
    return sample(logits[None], [params], [position])[0]


def logprobs(logits: torch.Tensor, ids: torch.Tensor, top_n: int = 0,
             dtype: torch.dtype | None = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities on the logits' device, as small tensors (not yet wired to the API).

    logits [S, vocab], ids int64 [S] on the same device (the sampled tokens, from `sample_ids`) ->
    (float32 [S] log p(ids), int64 [S, top_n] the top_n ids by probability,
    float32 [S, top_n] their log p).  The distribution is the model's (log-softmax of
    the raw logits, before temperature and filters), as OpenAI and vLLM report it.
    `dtype` None: computed in the logits' own dtype (the log-probabilities too).
    """
    lp = torch.log_softmax(logits if dtype is None else logits.to(dtype), dim=-1)       # [S, V]
    chosen = lp.gather(1, ids[:, None]).squeeze(1)                                      # [S]
    top = torch.topk(lp, min(top_n, lp.shape[1]), dim=-1)                                # [S, n]
    return chosen, top.indices, top.values
