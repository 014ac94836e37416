"""What a long token-id tuple holds (exact ints? smallest, largest), found once per tuple object.

A 64K-token prompt meets several range checks in one process: every message
that carries it (`net.messages`) and every engine that admits it
(`engines.base.check_request`), each ~3 ms of `set(map(type))`, `min` and
`max`.  In one process (`pddgw sim`, the embedded deployment) in-process
links hand the very same tuple on, so its facts are kept by identity: a tuple
is immutable, so one object has one answer.  A tuple decoded from the wire is
a new object, checked afresh by the process that decoded it (nothing checked
elsewhere is taken on trust).

The memo holds the tuples it keys (an id is unique only while its object
lives): the last `KEEP` of them, at most `KEEP_TOKENS` ids together (a held
64K-token prompt is ~2 MB with its int objects).  Short tuples (a decode step's tokens) are
checked directly and not kept.  Thread-safe (an engine may run on its own
thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

KEEP = 256
KEEP_TOKENS = 1 << 21
SHORT = 1024            # shorter sequences are checked directly: cheaper than the lookup's upkeep

Facts = tuple[bool, int, int]        # (every value an int and not a bool, smallest, largest)

_memo: OrderedDict[int, tuple[tuple[int, ...], Facts]] = OrderedDict()
_tokens = 0                          # ids held by the memo's tuples
_lock = threading.Lock()


def _facts(values: Sequence[int]) -> Facts:
    if set(map(type, values)) != {int}:
        return False, 0, 0
    return True, min(values), max(values)  # type: ignore[call-overload]


def id_facts(values: Sequence[int]) -> Facts:
    """(all exact ints, min, max) of a non-empty sequence; (False, 0, 0) when any value is not an
    int (a bool included)."""
    if type(values) is not tuple or len(values) < SHORT:
        return _facts(values)
    key = id(values)
    with _lock:
        hit = _memo.get(key)
        if hit is not None and hit[0] is values:
            _memo.move_to_end(key)
            return hit[1]
    facts = _facts(values)
    global _tokens
    with _lock:
        old = _memo.pop(key, None)
        if old is not None:
            _tokens -= len(old[0])
        _memo[key] = (values, facts)
        _tokens += len(values)
        while len(_memo) > 1 and (len(_memo) > KEEP or _tokens > KEEP_TOKENS):
            _, (gone, _) = _memo.popitem(last=False)
            _tokens -= len(gone)
    return facts


def in_range(values: Sequence[int], limit: int) -> bool:
    """Every value an int (not a bool) in [0, limit); True for an empty sequence."""
    if not values:
        return True
    ints, lo, hi = id_facts(values)
    return ints and lo >= 0 and hi < limit
