"""`mixed_step_tokens`: a step that decodes computes few other tokens (a relaying P's TPOT).

The real Scheduler and BlockManager with a stand-in for the model (each
chunk's tokens are computed; a sequence with nothing pending samples one
token): the chunks of every step, exactly.
"""

from __future__ import annotations

from pddgw.core.sampling import SamplingParams
from pddgw.engines.block_manager import BlockManager
from pddgw.engines.scheduler import Scheduler
from pddgw.engines.sequence import Sequence
from pddgw.engines.types import EngineRequest


def _run(budget: int, chunk: int, mixed: int, mixed_chunk: int) -> list[list[tuple[str, int]]]:
    """A decoding request, then two prompts of 100 tokens: each step's (request, tokens)."""
    sched = Scheduler(BlockManager(256, 4, enable_prefix_caching=False), 16, budget, max_chunk_tokens=chunk,
                      mixed_step_tokens=mixed, mixed_chunk_tokens=mixed_chunk)
    relay = Sequence(EngineRequest("relay", (5,) * 8, SamplingParams(max_tokens=1000)))
    sched.waiting.append(relay)
    steps: list[list[tuple[str, int]]] = []

    def step() -> None:
        chunks = sched.schedule()
        steps.append([(c.seq.request_id, c.num_tokens) for c in chunks])
        for c in chunks:
            c.seq.num_computed += c.num_tokens
            if c.seq.num_pending == 0:
                c.seq.tokens.append(7)
                if c.seq.request_id != "relay":          # a prefill: its first token ends it
                    sched.running.remove(c.seq)
                    sched.blocks.release(c.seq.block_ids)

    step()                                               # the relay's prompt and first token
    for k in ("a", "b"):
        sched.waiting.append(Sequence(EngineRequest(k, (9,) * 100, SamplingParams(max_tokens=1))))
    while len(steps) < 12 and (sched.waiting or len(sched.running) > 1):
        step()
    return steps


def test_without_a_cap_a_decode_shares_its_step_with_whole_chunks():
    steps = _run(budget=64, chunk=64, mixed=0, mixed_chunk=0)
    assert steps == [[("relay", 8)], [("relay", 1), ("a", 63)], [("relay", 1), ("a", 37), ("b", 26)],
                     [("relay", 1), ("b", 63)], [("relay", 1), ("b", 11)]]


def test_a_cap_bounds_the_other_tokens_of_a_step_that_decodes():
    steps = _run(budget=64, chunk=64, mixed=16, mixed_chunk=16)
    assert steps[0] == [("relay", 8)]
    assert steps[1:4] == [[("relay", 1), ("a", 16)]] * 3
    assert all(sum(n for r, n in s if r != "relay") <= 16 and ("relay", 1) in s for s in steps[1:])
    assert sum(n for s in steps for r, n in s if r == "a") == 100


def test_ranks_share_the_step_cap_one_chunk_each():
    # Two DP ranks: 32 other tokens a step, at most 16 of one sequence (its rank's share).
    steps = _run(budget=128, chunk=64, mixed=32, mixed_chunk=16)
    assert steps[1:4] == [[("relay", 1), ("a", 16), ("b", 16)]] * 3


def test_a_step_without_decodes_is_not_capped():
    sched = Scheduler(BlockManager(256, 4, enable_prefix_caching=False), 16, 64, max_chunk_tokens=64,
                      mixed_step_tokens=16, mixed_chunk_tokens=16)
    sched.waiting.append(Sequence(EngineRequest("a", (9,) * 100, SamplingParams(max_tokens=1))))
    assert [(c.seq.request_id, c.num_tokens) for c in sched.schedule()] == [("a", 64)]
