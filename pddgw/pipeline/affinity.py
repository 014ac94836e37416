"""Which MD instance holds a prompt's prefix, as the router remembers it.

Asking every MD (a WAN round trip) before opening the request on one (a
second) would cost two round trips before prefill; instead the router
remembers which prompt blocks it opened on each instance and picks by the
longest remembered prefix, then opens there directly: that instance's
answer (`Opened.cached_tokens`) is the authoritative hit.  A stale entry
(the block was evicted) only costs a worse pick, never a wrong transfer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Per instance, the block hashes recently opened there (least recent forgotten first).

    Per instance, not one owner per block: a prefix every conversation shares
    (the system prompt) lives on every MD, and a conversation's own blocks
    must still count after another conversation's request went elsewhere.
    """

    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity            # blocks remembered per instance
        self._held: dict[str, OrderedDict[int, None]] = {}

    def __len__(self) -> int:
        return sum(len(h) for h in self._held.values())

    def record(self, instance: str, hashes: Sequence[int]) -> None:
        """`instance` now holds (or will hold) the blocks with these chained hashes."""
        held = self._held.setdefault(instance, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def match(self, instance: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` remembered on `instance`."""
        held = self._held.get(instance) or OrderedDict()
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n
