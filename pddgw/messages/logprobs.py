"""Log-probabilities in pieces of at most MAX_LOGPROB_POSITIONS positions.

A `Logprobs` piece travels right before the message carrying its tokens, on the
same link and in the same traffic class (P -> decoder before KvDone, decoder ->
router before TokenItem), so the receiver joins them at its edge.  Prompt
logprobs answer a PromptLogprobsQuery.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pddgw.core.errors import check as _check
from pddgw.core.ids import TOKEN_ID_LIMIT
from pddgw.core.sampling import MAX_LOGPROBS
from pddgw.core.tokens import LOGPROB_FLOOR, TokenLogprobs
from pddgw.messages.fields import _int_tuple, _text, _uint

# Positions per Logprobs message: 64 x 21 floats of <= 24 JSON characters stay well inside
# the frame's 64 KiB of metadata.
MAX_LOGPROB_POSITIONS = 64


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Log-probabilities of output positions [position, position + n) of a request.

    Sent right before the message carrying those tokens (module docstring).
    `logprobs[i]` is the sampled token's at position + i; `top_ids` / `top_logprobs`
    hold top_n alternatives per position, row by row, most probable first.  Values are finite, in [LOGPROB_FLOOR, 0]
    (-inf travels as the floor); the ids are the packed payload.
    """

    request_id: str
    position: int
    top_n: int
    logprobs: tuple[float, ...]
    top_logprobs: tuple[float, ...]
    top_ids: tuple[int, ...]
    tag: Literal["logprobs"] = "logprobs"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _uint(self.position, "position", 1 << 31)
        _uint(self.top_n, "top_n", MAX_LOGPROBS + 1)
        _floats(self, "logprobs", self.logprobs, MAX_LOGPROB_POSITIONS)
        n = len(self.logprobs)
        _check(n >= 1, "logprobs must cover at least one position")
        _floats(self, "top_logprobs", self.top_logprobs, n * self.top_n)
        _int_tuple(self, "top_ids", self.top_ids, n * self.top_n, TOKEN_ID_LIMIT)
        _check(len(self.top_logprobs) == len(self.top_ids) == n * self.top_n,
               "top_logprobs and top_ids must hold top_n entries per position")

    def entries(self) -> tuple[TokenLogprobs, ...]:
        k = self.top_n
        return tuple(TokenLogprobs(lp, self.top_ids[i * k : (i + 1) * k], self.top_logprobs[i * k : (i + 1) * k])
                     for i, lp in enumerate(self.logprobs))


def _floats(obj: object, name: str, values: Any, count_limit: int) -> None:
    """A tuple of at most `count_limit` log-probabilities: finite, in [LOGPROB_FLOOR, 0]."""
    _check(type(values) in (tuple, list) and len(values) <= count_limit,
           f"{name} must list at most {count_limit} numbers")
    out = []
    for v in values:
        _check(type(v) in (int, float) and math.isfinite(v) and LOGPROB_FLOOR <= v <= 0,
               f"{name}: {v!r} is not a log-probability in [{LOGPROB_FLOOR}, 0]")
        out.append(float(v))
    object.__setattr__(obj, name, tuple(out))


def logprob_pieces(request_id: str, position: int, entries: Sequence[TokenLogprobs]) -> list[Logprobs]:
    """The Logprobs messages for positions [position, position + len(entries)), in order.

    Every entry must have the same number of alternatives (the request's k)."""
    out = []
    for a in range(0, len(entries), MAX_LOGPROB_POSITIONS):
        part = entries[a : a + MAX_LOGPROB_POSITIONS]
        k = len(part[0].top_ids)
        out.append(Logprobs(request_id, position + a, k, tuple(max(e.logprob, LOGPROB_FLOOR) for e in part),
                            tuple(max(v, LOGPROB_FLOOR) for e in part for v in e.top_logprobs),
                            tuple(t for e in part for t in e.top_ids)))
    return out
