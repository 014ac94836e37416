"""Logit adjustments before sampling: logit_bias, min_tokens, penalties, grammar masks.

`adjust_logits` applies them to a batch's logits in vLLM's order and formulas
(its docstring lists the steps).  Every row's result depends on that row alone;
rows that ask for nothing pass through untouched, and the input is left as it
is unless the caller asks for `inplace` (log-probabilities are of the raw logits).

`TokenCounts` keeps a sequence's distinct tokens and output counts, brought up to
date by `sync` with only the tokens appended since (tokens only ever grow), so the
penalties cost the distinct tokens, not the vocabulary nor the history.  The sparse
penalty path is bit for bit the dense formulas.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

import torch

from pddgw.core.sampling import SamplingParams
from pddgw.engines.grammar import Constraint, mask_rows


class TokenCounts:
    """A sequence's tokens as the penalties count them, kept up to date as tokens are appended.

    Each distinct token once, the prompt's first: `ids`, `prompt` (1: in the prompt) and
    `counts` (its occurrences among the output tokens), as arrays that become tensors
    without a Python loop; `top` the largest count.  `sync(tokens)` counts the tokens
    appended since its last call, so a step costs what was appended, not the history.
    Tokens only ever grow (a preempted sequence keeps them; a handoff, or a re-drive's
    output given at admission, appends several at once).
    """

    __slots__ = ("ids", "prompt", "counts", "top", "_slots", "_seen")

    def __init__(self, tokens: Sequence[int], num_prompt: int):
        # Comprehensions and Counter rather than a loop per token: one pass in C over the tokens,
        # one comprehension over the distinct ones.
        prompt = dict.fromkeys(tokens[:num_prompt])                  # distinct, in order
        out = Counter(tokens[num_prompt:])
        ids = [*prompt, *(t for t in out if t not in prompt)]
        self._slots: dict[int, int] | None = None                    # token -> its index, built when first needed
        self.ids = array("q", ids)
        self.prompt = array("q", [1]) * len(prompt) + array("q", [0]) * (len(ids) - len(prompt))
        self.counts = array("q", [out.get(t, 0) for t in ids])
        self.top = max(out.values(), default=0)
        self._seen = len(tokens)

    def sync(self, tokens: Sequence[int]) -> TokenCounts:
        """Count tokens[seen:], the output tokens appended since the last call."""
        if len(tokens) < self._seen:
            raise RuntimeError(f"a sequence's tokens went from {self._seen} to {len(tokens)}: they only grow")
        new = tokens[self._seen :]
        if not new:
            return self
        self._seen = len(tokens)
        if self._slots is None:
            self._slots = dict(zip(self.ids, itertools.count()))
        slots, counts = self._slots, self.counts
        # (Many at once, e.g. a handoff's extend: Counter counts them in C.)
        for t, c in (Counter(new).items() if len(new) > 8 else zip(new, itertools.repeat(1))):
            s = slots.get(t)
            if s is None:
                slots[t] = len(self.ids)
                self.ids.append(t)
                self.prompt.append(0)
                counts.append(c)
            else:
                c = counts[s] = counts[s] + c
            if c > self.top:
                self.top = c
        return self


class History(Protocol):
    """A sequence's tokens so far: the prompt, then the output (the engine's `Sequence` is one).

    `counts`: its `TokenCounts` where the sequence keeps one (created with it, for a request
    with penalties), which `adjust_logits` brings up to date; None: counted afresh.
    """

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def num_prompt(self) -> int: ...

    @property
    def counts(self) -> TokenCounts | None: ...


class TokenHistory(NamedTuple):
    """A `History` built from a token list (tests, the vLLM processor)."""

    tokens: Sequence[int]
    num_prompt: int
    counts: TokenCounts | None = None


def _needs_adjusting(p: SamplingParams, position: int, constraint: Constraint | None) -> bool:
    return p.penalized or bool(p.logit_bias) or position < p.min_tokens or constraint is not None


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                  histories: Sequence[History], eos: Collection[int] = (),
                  constraints: Sequence[Constraint | None] | None = None, inplace: bool = False) -> torch.Tensor:
    """logits [S, V] -> [S, V] with each row's logit_bias, min_tokens mask, penalties and grammar
    mask applied.

    positions[i] is row i's output count (the position it samples), histories[i] its tokens,
    constraints[i] its grammar's matcher (None: no grammar; engines/grammar.py), fed the row's
    output tokens it has not seen before its mask is computed.
    Returns `logits` itself when no row asks for anything; otherwise a new tensor (the
    input is left as it is: log-probabilities are of the raw logits), or with `inplace`
    (the caller needs no raw logits) `logits`, changed.  In vLLM's order:

      1. logit_bias: x[t] += bias[t]
      2. min_tokens: while position < min_tokens, x[t] = -inf for the stop tokens (EOS unless
         ignore_eos, and stop_token_ids)
      3. repetition: for t in prompt or output, x[t] / r if x[t] > 0 else x[t] * r
      4. x[t] -= frequency * count_out[t]; then x[t] -= presence * (count_out[t] > 0)
      5. grammar: x[t] = -inf for every t the row's grammar does not admit next

    Steps 3-4 run over each penalized row's distinct tokens only (`_penalize`), from its
    `TokenCounts`; steps 1, 2 and 5 over the rows that ask.
    """
    n, vocab = logits.shape
    cons = constraints if constraints is not None else [None] * n
    rows = [i for i in range(n) if _needs_adjusting(params[i], positions[i], cons[i])]
    if not rows:
        return logits
    dev = logits.device
    i64 = dict(dtype=torch.int64, device=dev)
    whole = len(rows) == n
    index = None
    if inplace or whole:
        x, at = (logits if inplace else logits.clone()), rows                            # [S, V]; asked row j: x[at[j]]
    else:
        index = torch.tensor(rows, **i64)
        x, at = logits.index_select(0, index), range(len(rows))                          # [R, V]
    ps = [params[i] for i in rows]
    # 1. logit_bias (ids were checked against the vocabulary when the request was added)
    bias = [(at[j], t, b) for j, p in enumerate(ps) for t, b in p.logit_bias]
    if bias:
        bj, bt, bb = zip(*bias)
        x.index_put_((torch.tensor(bj, **i64), torch.tensor(bt, **i64)),
                     torch.tensor(bb, dtype=x.dtype, device=dev), accumulate=True)
    # 2. min_tokens: the stop tokens cannot be drawn yet
    stops = [(at[j], t) for j, (i, p) in enumerate(zip(rows, ps)) if positions[i] < p.min_tokens
             for t in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))) if t < vocab]
    if stops:
        sj, st = zip(*stops)
        x[torch.tensor(sj, **i64), torch.tensor(st, **i64)] = float("-inf")
    # 3-4. penalties, over the rows that have one
    pen = [j for j, p in enumerate(ps) if p.penalized]
    if pen:
        hist = [histories[rows[j]] for j in pen]
        counts = [TokenCounts(h.tokens, h.num_prompt) if h.counts is None else h.counts.sync(h.tokens) for h in hist]
        _penalize(x, [at[j] for j in pen], [ps[j] for j in pen], counts)
    # 5. grammar masks, over the rows that have one (their bitmask is filled on the host)
    gram = [j for j, i in enumerate(rows) if cons[i] is not None]
    if gram:
        hist = [histories[rows[j]] for j in gram]
        gidx = None if len(gram) == x.shape[0] else torch.tensor([at[j] for j in gram], **i64)
        y = x if gidx is None else x.index_select(0, gidx)                              # [G, V]
        mask_rows(y, [cons[rows[j]] for j in gram], [h.tokens[h.num_prompt:] for h in hist])
        if gidx is not None:
            x.index_copy_(0, gidx, y)
    return x if index is None else logits.index_copy(0, index, x)


def _penalize(x: torch.Tensor, at: Sequence[int], ps: Sequence[SamplingParams], counts: Sequence[TokenCounts]) -> None:
    """Steps 3-4 in place on rows `at` of x [*, V], on each row's distinct tokens only: [M]
    entries (M the distinct prompt and output tokens of the P rows), not [P, V].

    Bit for bit the dense formulas: on the M entries, the same elementwise ops in x's dtype,
    with the counts in x's dtype that an accumulating index_put of ones gives on this device
    (past 256 in bfloat16 that is not the count); every other entry of a row is
    y - f * 0 - p * 0: y itself, or y + 0.0 (-0.0 turned +0.0) where f or p is negative.
    """
    dev = x.device
    f = dict(dtype=x.dtype, device=dev)
    rep = torch.tensor([p.repetition_penalty for p in ps], **f)                          # [P]
    freq = torch.tensor([p.frequency_penalty for p in ps], **f)                          # [P]
    pres = torch.tensor([p.presence_penalty for p in ps], **f)                           # [P]
    ids, prompt, cnt = array("q"), array("q"), array("q")
    for c in counts:
        ids.extend(c.ids)
        prompt.extend(c.prompt)
        cnt.extend(c.counts)
    m = len(ids)
    if m:
        lens = torch.tensor([len(c.ids) for c in counts])                                # [P]
        row = torch.repeat_interleave(torch.arange(len(counts)), lens)                    # [M] which penalized row
        host = torch.stack([torch.frombuffer(ids, dtype=torch.int64), torch.frombuffer(prompt, dtype=torch.int64),
                            torch.frombuffer(cnt, dtype=torch.int64), row, torch.tensor(at)[row]])
        tok, in_prompt, c, row, xr = host.to(dev)                                        # [M] each
        y = x[xr, tok]                                                                   # [M]
        out_seen = c > 0
        r = rep[row]
        # (rows with r == 1 need no prompt: y / 1 and y * 1 are y)
        y = torch.where(out_seen | (in_prompt > 0), torch.where(y > 0, y / r, y * r), y)
        y = y - freq[row] * _counts_in(c, x.dtype, max(k.top for k in counts))
        y = y - pres[row] * out_seen
    for k, p in enumerate(ps):
        if math.copysign(1.0, p.frequency_penalty) < 0 or math.copysign(1.0, p.presence_penalty) < 0:
            x[at[k]].add_(0.0)                                                           # [V]: -0.0 -> +0.0
    if m:
        x.index_put_((xr, tok), y)


def _counts_in(c: torch.Tensor, dtype: torch.dtype, top: int) -> torch.Tensor:
    """int64 [M] counts -> [M] in dtype, as an accumulating index_put of ones in dtype leaves them
    on c's device: the counts themselves while every count is exact in dtype (<= 2 ** (mantissa
    bits + 1); `top` the largest), else that index_put itself (over the M entries)."""
    if top <= 2 / torch.finfo(dtype).eps:
        return c.to(dtype)
    slot = torch.repeat_interleave(torch.arange(c.shape[0], device=c.device), c)          # [sum c]
    return torch.zeros(c.shape[0], dtype=dtype, device=c.device).index_put_(
        (slot,), torch.ones((), dtype=dtype, device=c.device), accumulate=True)
