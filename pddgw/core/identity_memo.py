"""Values computed from a long immutable tuple, kept by the tuple object's identity.

In one process (`pddgw sim`, the embedded deployment) in-process links hand
the very same message objects on, so a 64K-token prompt tuple meets the same
computation several times: every message and engine range-checks it
(`core.ids`), the router and every engine hash its blocks
(`engines.prompt_hashes`), each a few milliseconds.  Keyed by identity, the
first caller computes and the others reuse: a tuple is immutable, so one
object has one answer.  Identity, not equality: a tuple decoded from the wire
is a new object, computed afresh by the process that decoded it (nothing
computed elsewhere is taken on trust).

The memo holds the tuples it keys (an id is unique only while its object
lives), so it is bounded: the last `keep` entries, at most `keep_items` items
of their tuples together (a held 64K-token prompt is ~2 MB with its int
objects).  Thread-safe (an engine may run on its own thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class IdentityMemo(Generic[V]):
    def __init__(self, keep: int, keep_items: int):
        self.keep = keep
        self.keep_items = keep_items
        # (id(obj), tag) -> (obj, value), least recently used first
        self._entries: OrderedDict[tuple[int, Hashable], tuple[tuple[Any, ...], V]] = OrderedDict()
        self.items = 0                      # items of the held tuples, together
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, obj: tuple[Any, ...], compute: Callable[[tuple[Any, ...]], V], tag: Hashable = None) -> V:
        """compute(obj), once per (object, tag) while the memo keeps it; `tag` tells apart values
        of one object that depend on something else too (a block size)."""
        key = (id(obj), tag)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] is obj:
                self._entries.move_to_end(key)
                return hit[1]
        value = compute(obj)
        self._store(key, obj, value)
        return value

    def put(self, obj: tuple[Any, ...], value: V, tag: Hashable = None) -> None:
        """Keep `value` for (obj, tag) as if computed here: for a value obj's builder in this
        process knows already (it built obj from a tuple whose value it kept)."""
        self._store((id(obj), tag), obj, value)

    def _store(self, key: tuple[int, Hashable], obj: tuple[Any, ...], value: V) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.items -= len(old[0])
            self._entries[key] = (obj, value)
            self.items += len(obj)
            while len(self._entries) > 1 and (len(self._entries) > self.keep or self.items > self.keep_items):
                _, (gone, _) = self._entries.popitem(last=False)
                self.items -= len(gone)

    def holds(self, obj: tuple[Any, ...], tag: Hashable = None) -> bool:
        with self._lock:
            hit = self._entries.get((id(obj), tag))
            return hit is not None and hit[0] is obj

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.items = 0
