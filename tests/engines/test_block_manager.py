"""BlockManager unit tests: exact block IDs through allocation, caching, eviction, pins."""

import pytest

from pddgw.engines.block_manager import ROOT_HASH, BlockManager, OutOfBlocks, chain_hashes


def test_chain_hashes_are_chained_and_deterministic():
    toks = list(range(40))
    h = chain_hashes(toks, 16)
    assert len(h) == 2                                  # only full blocks
    assert h == chain_hashes(toks[:32], 16)
    assert chain_hashes(toks[16:32], 16, parent=h[0]) == [h[1]]
    assert chain_hashes(toks, 16, start_block=1, parent=h[0]) == [h[1]]
    # Same block contents under another parent hash to something else.
    assert chain_hashes(toks[16:32], 16, parent=ROOT_HASH) != [h[1]]
    # Fixed key and algorithm: identical in every process and on every machine.
    assert h[0] == chain_hashes(list(range(16)), 16)[0]
    assert all(0 <= x < 2**63 for x in h)


def test_hash_definition_is_pinned():
    # Nodes of different versions must agree on prefix identity: changing the
    # hash definition is a protocol change.
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == [2724265953507160219, 1598588668753429100]


def test_allocate_release_order_and_ids():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate(2) == [0, 1]
    assert bm.allocate(3) == [2, 3, 4]
    assert (bm.num_free, bm.num_cached, bm.num_used) == (1, 0, 5)
    bm.release([0, 1])                                   # unhashed: back to the free list, tail first
    assert bm.allocate(3) == [5, 1, 0]
    with pytest.raises(OutOfBlocks):
        bm.allocate(1)
    bm.check_integrity([[2, 3, 4], [5, 1, 0]])


def test_prefix_cache_hit_lru_eviction_and_reuse():
    bm = BlockManager(num_blocks=4, block_size=4)
    toks = list(range(12))
    hashes = chain_hashes(toks, 4)
    blocks = bm.allocate(3)
    assert blocks == [0, 1, 2]
    for b, h in zip(blocks, hashes):
        assert bm.publish(b, h)
    bm.release(blocks)                                   # tail first into the LRU: 2, 1, 0
    assert (bm.num_free, bm.num_cached, bm.num_used) == (1, 3, 0)
    assert bm.match(hashes) == [0, 1, 2]
    assert bm.match([hashes[0], 999, hashes[2]]) == [0]  # stops at the first miss
    # A new request hits the first two blocks.
    hit = bm.match(hashes[:2])
    bm.acquire(hit)
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    # Allocating 2: the free block 3 first, then the LRU's oldest cached block (2, the tail).
    assert bm.allocate(2) == [3, 2]
    assert bm.block_hash(2) is None and bm.match(hashes) == [0, 1]
    bm.check_integrity([[0, 1, 3, 2]])
    # Publishing an already-cached hash into another block is refused (dedup).
    assert not bm.publish(3, hashes[0])
    bm.release([0, 1, 3, 2])
    assert (bm.num_free, bm.num_cached) == (2, 2)
    bm.check_integrity()


def test_pins_keep_blocks_out_of_eviction():
    bm = BlockManager(num_blocks=3, block_size=2)
    hashes = chain_hashes([7, 7, 8, 8], 2)
    blocks = bm.allocate(2)
    for b, h in zip(blocks, hashes):
        bm.publish(b, h)
    bm.release(blocks)
    bm.pin("xfer-1", bm.match(hashes))
    assert bm.num_pins == 1 and bm.num_allocatable == 1
    with pytest.raises(OutOfBlocks):
        bm.allocate(2)
    assert bm.allocate(1) == [2]
    with pytest.raises(KeyError):
        bm.pin("xfer-1", [])
    assert bm.unpin("xfer-1") and not bm.unpin("xfer-1")
    bm.check_integrity([[2]])
    assert bm.match(hashes) == [0, 1]                    # still cached after unpin


def test_integrity_detects_leaks():
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate(1)
    with pytest.raises(AssertionError, match="block 0"):
        bm.check_integrity()                             # nobody claims block 0: a leak


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=False)
    b = bm.allocate(1)
    assert not bm.publish(b[0], 123)
    assert bm.match([123]) == []


class _CountingTable(dict):
    """The hash table, counting look-ups."""

    gets = 0

    def get(self, key, default=None):
        self.gets += 1
        return super().get(key, default)


def test_a_match_under_its_pin_looks_up_only_past_the_pinned_blocks():
    bm = BlockManager(num_blocks=12, block_size=2)
    hashes = chain_hashes(list(range(20)), 2)            # a 10-block prompt
    first = bm.allocate(4)
    for b, h in zip(first, hashes):
        bm.publish(b, h)
    bm.release(first)
    bm.pin("r", bm.match(hashes))                        # its prefix query: 4 blocks held
    more = bm.allocate(2)                                # another request computes blocks 4 and 5
    bm.publish(more[0], hashes[4])
    bm.publish(more[1], hashes[5])
    bm._by_hash = table = _CountingTable(bm._by_hash)
    want = bm.match(hashes)
    assert want == [0, 1, 2, 3, 4, 5] and table.gets == 10
    table.gets = 0
    assert bm.match(hashes, "r") == want and table.gets == 6          # past the pinned four only
    assert bm.match(hashes[:3], "r") == [0, 1, 2] and table.gets == 6   # within them: none
    other = chain_hashes(list(range(1, 21)), 2)          # another prompt under that key: no shortcut
    assert bm.match(other, "r") == bm.match(other) == []
    assert bm.match(hashes, "nobody") == want
    assert bm.unpin("r")
    table.gets = 0
    assert bm.match(hashes, "r") == want and table.gets == 10          # the pin is gone
    bm.check_integrity([more])
