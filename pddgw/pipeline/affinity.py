"""Which MD instance holds a prompt's prefix, as the router remembers it.

Asking every MD (a WAN round trip) before opening the request on one (a
second) would cost two round trips before prefill; instead the router
remembers which instance it last opened each prompt block on and picks by
the longest remembered prefix, then opens there directly: that instance's
answer (`Opened.cached_tokens`) is the authoritative hit.  A stale entry
(the block was evicted) only costs a worse pick, never a wrong transfer.
Bounded: the least recently recorded blocks are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, instance: str, hashes: Sequence[int]) -> None:
        """`instance` now holds (or will hold) the blocks with these chained hashes."""
        owner = self._owner
        for h in hashes:
            owner[h] = instance
            owner.move_to_end(h)
        while len(owner) > self.capacity:
            owner.popitem(last=False)

    def match(self, instance: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` last recorded on `instance`."""
        n = 0
        for h in hashes:
            if self._owner.get(h) != instance:
                break
            n += 1
        return n
