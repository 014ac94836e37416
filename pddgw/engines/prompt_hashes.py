"""A prompt's chained block hashes, computed once per process per prompt object.

In one process (`pddgw sim`, the embedded deployment) the router, P and the
decoders hold the very same prompt tuple (in-process links hand the message
object over), and each needs its chained hashes (the router's prefix queries
and affinity, every engine's prefix cache): keyed by the tuple's identity, the
first caller computes them, the others reuse them.  Identity, not equality: a
tuple is immutable, so one object has one set of hashes; a prompt decoded from
the wire is a new object, hashed afresh by the process that decoded it
(nothing computed elsewhere is taken on trust).

The cache holds the prompts it keys (an id is unique only while its object
lives), so it is bounded: the last `KEEP_PROMPTS` prompts, at most
`KEEP_TOKENS` tokens of them together.  Thread-safe (an engine may run on its
own thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from pddgw.engines.block_manager import chain_hashes

KEEP_PROMPTS = 64
KEEP_TOKENS = 1 << 20

# id(prompt) -> (prompt, {block size: hashes})
_cache: OrderedDict[int, tuple[tuple[int, ...], dict[int, tuple[int, ...]]]] = OrderedDict()
_tokens = 0
_lock = threading.Lock()


def prompt_hashes(prompt: Sequence[int], block_size: int) -> tuple[int, ...]:
    """`chain_hashes(prompt, block_size)` (its full blocks' chained hashes from the root)."""
    if type(prompt) is not tuple:
        return tuple(chain_hashes(prompt, block_size))
    key = id(prompt)
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] is prompt and block_size in hit[1]:
            _cache.move_to_end(key)
            return hit[1][block_size]
    hashes = tuple(chain_hashes(prompt, block_size))
    with _lock:
        _remember(key, prompt, block_size, hashes)
    return hashes


def _remember(key: int, prompt: tuple[int, ...], block_size: int, hashes: tuple[int, ...]) -> None:
    global _tokens
    entry = _cache.get(key)
    if entry is None or entry[0] is not prompt:
        if entry is not None:
            _tokens -= len(entry[0])
        entry = _cache[key] = (prompt, {})
        _tokens += len(prompt)
    entry[1][block_size] = hashes
    _cache.move_to_end(key)
    while len(_cache) > 1 and (len(_cache) > KEEP_PROMPTS or _tokens > KEEP_TOKENS):
        _, (old, _) = _cache.popitem(last=False)
        _tokens -= len(old)


def clear() -> None:
    """Forget every prompt (tests)."""
    global _tokens
    with _lock:
        _cache.clear()
        _tokens = 0
