"""KV block ownership: free list, reference counts and the prefix cache.

The BlockManager is the only code that touches these.  A block is in exactly
one of three states:

  free    ref 0, no hash, never allocated yet or in the free list
  cached  ref 0, hashed, in the LRU of evictable blocks (still findable by hash)
  used    ref > 0 (held by requests and/or pins), hashed or not

so free + cached + used == total at every moment (`check_integrity`).

Prefix identity is the chained block hash: hash(parent hash, the block's
token IDs) with a fixed key, identical across processes and machines.  Only
full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from operator import eq

# Parent of the first block of every sequence.
ROOT_HASH = 0
_HASH_KEY = b"pddgw-block-v1"
# The keyed state before any data: copying it per block skips the key's setup (a third of a
# 64K-token prompt's hashing time).
_KEYED = hashlib.blake2b(digest_size=8, key=_HASH_KEY)


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH,
                 start_block: int = 0) -> list[int]:
    """Chained hashes of the full blocks of token_ids, from block `start_block` on.

    `parent` must be the hash of block start_block - 1 (ROOT_HASH for 0).
    """
    n_blocks = len(token_ids) // block_size
    if n_blocks <= start_block:
        return []
    # Hashed bytes per block: parent then the block's ids, each little-endian int64.  Packing
    # every block at once and slicing is 3x faster than a struct.pack per block on 64K prompts.
    ids = array("q", token_ids[start_block * block_size : n_blocks * block_size])
    if sys.byteorder != "little":
        ids.byteswap()
    raw = memoryview(ids).cast("B")
    step = block_size * 8
    out = []
    for off in range(0, len(raw), step):
        h = _KEYED.copy()
        h.update(parent.to_bytes(8, "little", signed=True))
        h.update(raw[off : off + step])
        parent = int.from_bytes(h.digest(), "little") >> 1   # 63-bit, JSON/int64 safe
        out.append(parent)
    return out


class OutOfBlocks(RuntimeError):
    """Not enough free + evictable blocks for an allocation."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Free blocks: those never allocated, [_fresh, num_blocks), then the released ones in
        # release order (`_free`); allocation takes the never-allocated first, lowest id first.  A
        # deque of every id up front cost an H200 MD's 2.5M-block pool ~0.3 s and ~90 MB at start.
        self._fresh = 0
        self._free: deque[int] = deque()
        self._lru: OrderedDict[int, None] = OrderedDict()   # cached blocks, oldest first
        self._by_hash: dict[int, int] = {}
        self._pins: dict[str, list[int]] = {}

    # ---- queries ------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self._fresh - len(self._free) - len(self._lru)

    @property
    def num_allocatable(self) -> int:
        return self.num_free + len(self._lru)

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> int | None:
        return self._hash[block]

    def match(self, hashes: Sequence[int], pinned: str | None = None) -> list[int]:
        """Blocks holding the leading run of `hashes` (no reference taken).

        `pinned`: the key of a pin (a prefix query's); its blocks that hold the leading hashes
        start the run without a look-up (a held block keeps its hash), which saves a 64K-token
        prompt a thousand hash-table misses.  Same answer either way."""
        if not self.enable_prefix_caching or not hashes:
            return []
        start: list[int] = []
        blocks = self._pins.get(pinned) if pinned is not None else None
        if blocks and all(map(eq, hashes, map(self._hash.__getitem__, blocks))):
            if len(hashes) <= len(blocks):
                return blocks[: len(hashes)]
            start, hashes = blocks, hashes[len(blocks):]
        by_hash = self._by_hash
        if hashes[0] not in by_hash:
            return start[:]
        # Every look-up in one C loop, cut at the first miss (one `get` at a time took ~4x longer).
        out = list(map(by_hash.get, hashes))
        try:
            del out[out.index(None):]
        except ValueError:
            pass
        return start + out

    # ---- reference counting ------------------------------------------------
    def acquire(self, blocks: Iterable[int]) -> None:
        """Take a reference on blocks found by `match` (pulls cached ones out of the LRU)."""
        ref, lru = self._ref, self._lru      # (locals: a 64K-token prompt walks a thousand blocks)
        for b in blocks:
            r = ref[b]
            if not r:
                del lru[b]
            ref[b] = r + 1

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with ref 1; evicts least recently used cached blocks if needed."""
        if n > self.num_allocatable:
            raise OutOfBlocks(f"need {n} blocks, {self.num_allocatable} allocatable")
        out = []
        for _ in range(n):
            if self._fresh < self.num_blocks:
                b = self._fresh
                self._fresh += 1
            elif self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._by_hash[self._hash[b]]
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first so tails are evicted first."""
        ref, hashes, free, lru = self._ref, self._hash, self._free, self._lru
        for b in reversed(blocks):
            r = ref[b] - 1
            assert r >= 0, f"block {b} released more often than acquired"
            ref[b] = r
            if not r:
                if hashes[b] is None:
                    free.append(b)
                else:
                    lru[b] = None

    def publish(self, block: int, block_hash: int) -> bool:
        """Make a computed full block findable by hash; False if another block has it."""
        if not self.enable_prefix_caching:
            return False
        if self._hash[block] is not None:
            return self._hash[block] == block_hash
        if block_hash in self._by_hash:
            return False
        self._hash[block] = block_hash
        self._by_hash[block_hash] = block
        return True

    # ---- pins ---------------------------------------------------------------
    def pin(self, key: str, blocks: Sequence[int]) -> None:
        """Hold blocks under `key` (a transfer in flight) until `unpin(key)`."""
        if key in self._pins:
            raise KeyError(f"pin {key!r} already exists")
        self.acquire(blocks)
        self._pins[key] = list(blocks)

    def unpin(self, key: str) -> bool:
        blocks = self._pins.pop(key, None)
        if blocks is None:
            return False
        self.release(blocks)
        return True

    # ---- integrity ------------------------------------------------------------
    def check_integrity(self, held: Iterable[Sequence[int]] = ()) -> None:
        """free + cached + used == total; `held` are the block lists of live requests.

        Ref counts must equal the references held by requests and pins.
        """
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert all(b < self._fresh for b in free), "never-allocated block in the free list"
        free.update(range(self._fresh, self.num_blocks))
        assert not free & lru, "block both free and cached"
        expected = [0] * self.num_blocks
        for blocks in list(held) + list(self._pins.values()):
            for b in blocks:
                expected[b] += 1
        for b in range(self.num_blocks):
            assert self._ref[b] == expected[b], f"block {b}: ref {self._ref[b]} != held {expected[b]}"
            if self._ref[b] == 0:
                assert (b in free) != (b in lru), f"unreferenced block {b} neither free nor cached"
                assert (b in lru) == (self._hash[b] is not None), f"block {b}: cached iff hashed"
            else:
                assert b not in free and b not in lru, f"used block {b} on a free list"
        for h, b in self._by_hash.items():
            assert self._hash[b] == h, f"hash map disagrees for block {b}"
        assert len(free) + len(lru) + self.num_used == self.num_blocks
