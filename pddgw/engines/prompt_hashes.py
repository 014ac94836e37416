"""A prompt's chained block hashes, computed once per process per prompt object.

In one process (`pddgw sim`, the embedded deployment) the router, P and the
decoders hold the very same prompt tuple, and each needs its chained hashes
(the router's prefix queries and affinity, every engine's prefix cache): kept
by the tuple's identity and the block size (`core.identity_memo`: why
identity, and its bounds), the first caller computes them, the others reuse
them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pddgw.core.identity_memo import IdentityMemo
from pddgw.engines.block_manager import chain_hashes

# The last 64 prompts, at most 1M tokens together.
MEMO: IdentityMemo[tuple[int, ...]] = IdentityMemo(keep=64, keep_items=1 << 20)


def prompt_hashes(prompt: Sequence[int], block_size: int) -> tuple[int, ...]:
    """`chain_hashes(prompt, block_size)` (its full blocks' chained hashes from the root)."""
    if type(prompt) is not tuple:
        return tuple(chain_hashes(prompt, block_size))
    return MEMO.get(prompt, lambda p: tuple(chain_hashes(p, block_size)), tag=block_size)


def note(prompt: tuple[int, ...], block_size: int, hashes: tuple[int, ...]) -> None:
    """Keep `hashes` as `prompt`'s chained block hashes: for its builder, which chained them from
    an earlier prompt's it kept (the simulator's next turn keeps most of the previous one)."""
    MEMO.put(prompt, hashes, tag=block_size)
