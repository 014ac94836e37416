"""Field checks and limits shared by the node messages.

Each check raises ValueError naming the field, so a message that exists is well
formed, whether built locally or decoded from the wire.  The limits are generous
for real use and small enough that a hostile peer cannot make a node hold much.
"""

from __future__ import annotations

import math
from typing import Any

from pddgw.core.errors import check as _check
from pddgw.core.ids import in_range
from pddgw.core.kv import MAX_REQUEST_ID_CHARS
from pddgw.core.sampling import SamplingParams

# Limits on metadata fields: generous for real use, small enough that a hostile
# peer cannot make us hold much.
MAX_ID_CHARS = MAX_REQUEST_ID_CHARS


MAX_TEXT_CHARS = 4096


MAX_TOKEN_IDS = 1 << 20


MAX_BATCH_ITEMS = 4096             # TokenItems in one TokenBatch (their ids together: MAX_TOKEN_IDS)


MAX_HASHES = 1 << 20


HASH_LIMIT = 1 << 64               # prefix hashes are uint64


MAX_TARGETS = 16


MAX_BLOCK_TOKENS = 1 << 16         # a KV block's tokens (engines' block sizes are powers of two, far below)


def _text(v: Any, name: str, limit: int = MAX_ID_CHARS, empty: bool = True) -> None:
    _check(type(v) is str, f"{name} must be a string")
    _check(len(v) <= limit, f"{name} longer than {limit} characters")
    _check(empty or bool(v), f"{name} must not be empty")


def _uint(v: Any, name: str, limit: int = 1 << 63) -> None:
    _check(type(v) is int, f"{name} must be an integer")
    _check(0 <= v < limit, f"{name} out of range [0, {limit})")


def _flag(v: object, name: str) -> None:
    _check(type(v) is bool, f"{name} must be a boolean")


def _number(v: object, name: str) -> None:
    ok = (type(v) is int and 0 <= v < 1 << 63) or (type(v) is float and math.isfinite(v) and v >= 0)
    _check(ok, f"{name} must be a finite number >= 0")


def _int_tuple(obj: object, name: str, values: Any, count_limit: int, value_limit: int) -> None:
    """Normalise a sequence field to a tuple of ints and range-check it."""
    if type(values) is not tuple:
        _check(isinstance(values, (list, range)) or hasattr(values, "tolist"), f"{name} must be a sequence of ints")
        values = tuple(values.tolist() if hasattr(values, "tolist") else values)
        object.__setattr__(obj, name, values)
    _check(len(values) <= count_limit, f"{name}: more than {count_limit} values")
    # The common case checked in C, once per tuple object (prompts are 10^4-10^5 ids and cross
    # several messages in one process: core.ids); the slow loop names the culprit.
    if not in_range(values, value_limit):
        for v in values:
            _check(type(v) is int and 0 <= v < value_limit, f"{name}: {v!r} out of range [0, {value_limit})")


def _nonce(v: object, name: str) -> None:
    _check(type(v) is str and len(v) == 64 and all(c in "0123456789abcdef" for c in v),
           f"{name} must be 64 lowercase hex characters")


def _sampling(sp: object) -> None:
    """A message's nested sampling (its own constructor validated the values)."""
    _check(type(sp) is SamplingParams, "sampling must be a SamplingParams")


def _bools(obj: object, name: str, values: Any, count: int) -> None:
    """A per-target tuple of booleans (empty = all False)."""
    _check(type(values) in (tuple, list) and len(values) in (0, count),
           f"{name} must have one entry per target")
    object.__setattr__(obj, name, tuple(values))
    for v in values:
        _flag(v, f"{name}[]")
