"""What a long token-id tuple holds (exact ints? smallest, largest), found once per tuple object.

A 64K-token prompt meets several range checks in one process: every message
that carries it (`pddgw.messages`) and every engine that admits it
(`engines.base.check_request`), each ~3 ms of `set(map(type))`, `min` and
`max`.  Its facts are kept by the tuple's identity (`core.identity_memo`: why
identity, and its bounds).  Short tuples (a decode step's tokens) are checked
directly and not kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from pddgw.core.identity_memo import IdentityMemo

TOKEN_ID_LIMIT = 1 << 31     # token ids are int32 >= 0 on the wire
SHORT = 1024            # shorter sequences are checked directly: cheaper than the lookup's upkeep

# (every value an int and not a bool, smallest, largest); for a tuple its builder noted
# (`note_bounds`), a lower and an upper bound the builder vouches for.
Facts = tuple[bool, int, int]

# The last 256 long tuples, at most 2M ids together.
MEMO: IdentityMemo[Facts] = IdentityMemo(keep=256, keep_items=1 << 21)


def _facts(values: Sequence[int]) -> Facts:
    if set(map(type, values)) != {int}:
        return False, 0, 0
    return True, min(values), max(values)


def id_facts(values: Sequence[int]) -> Facts:
    """(all exact ints, min, max) of a non-empty sequence; (False, 0, 0) when any value is not an
    int (a bool included)."""
    if type(values) is not tuple or len(values) < SHORT:
        return _facts(values)
    return MEMO.get(values, _facts)


def in_range(values: Sequence[int], limit: int) -> bool:
    """Every value an int (not a bool) in [0, limit); True for an empty sequence."""
    if not values:
        return True
    ints, lo, hi = id_facts(values)
    if ints and lo >= 0 and hi < limit:
        return True
    if ints:       # noted bounds may be looser than the values (note_bounds): decide exactly
        ints, lo, hi = _facts(values)
    return ints and lo >= 0 and hi < limit


def note_bounds(values: tuple[int, ...], lo: int, hi: int) -> None:
    """Vouch that every value of `values` is an exact int in [lo, hi]: its builder in this process
    knows where each id came from (the simulator's prompts: drawn ids and earlier answers), so a
    64K-token prompt skips its three scans.  `in_range` then answers from the bounds; a bound
    outside the limit is checked exactly."""
    if len(values) >= SHORT:
        MEMO.put(values, (True, lo, hi))
