"""Preemption under a full KV pool never starves a request (tracker issue 23).

The real Scheduler and BlockManager with a stand-in for the model (each
chunk's tokens are computed; a sequence with nothing pending samples one
token): exact block arithmetic, no torch.  Long sequences fill a small pool
and keep growing; a short one arrives last, like a request handed off to a
full MD (it used to be the victim every time it needed a block: the most
recently admitted, and the last in the step's batch, preempted itself), also
once every long one has given way (counted from zero, the newcomer was then
the least preempted candidate).
"""

from __future__ import annotations

from pddgw.core.sampling import SamplingParams
from pddgw.engines.block_manager import BlockManager
from pddgw.engines.scheduler import Scheduler
from pddgw.engines.sequence import Sequence, SeqStatus
from pddgw.engines.types import EngineRequest

BLOCK = 4
PROMPT = tuple(range(1, 9))          # 2 blocks
# N: the most steps the short request waits between two of its tokens.
MAX_GAP_STEPS = 1


class Run:
    def __init__(self, num_blocks: int, budget: int = 64):
        self.blocks = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False)
        self.sched = Scheduler(self.blocks, 16, budget)
        self.order: list[str] = []               # preempted request ids, in order
        self.token_steps: dict[str, list[int]] = {}
        self.counts_spread: list[int] = []
        preempt = self.sched.preempt

        def record(seq: Sequence) -> None:
            self.order.append(seq.request_id)
            preempt(seq)
        self.sched.preempt = record              # type: ignore[method-assign]

    def add(self, rid: str, max_tokens: int) -> None:
        self.sched.waiting.append(Sequence(EngineRequest(rid, PROMPT, SamplingParams(max_tokens=max_tokens))))

    def step(self, i: int) -> None:
        for c in self.sched.schedule():
            s = c.seq
            s.num_computed += c.num_tokens
            if s.num_pending == 0:               # its logits: one sampled token
                s.tokens.append(7)
                self.token_steps.setdefault(s.request_id, []).append(i)
                if s.num_outputs >= s.sampling.max_tokens:
                    self.sched.remove(s)
                    self.blocks.release(s.block_ids)
                    s.block_ids = []
                    s.status = SeqStatus.FINISHED

    @property
    def idle(self) -> bool:
        return not self.sched.running and not self.sched.waiting


def _gaps(steps: list[int]) -> list[int]:
    return [b - a for a, b in zip(steps, steps[1:])]


def test_a_short_request_behind_growing_long_ones_is_never_preempted():
    run = Run(num_blocks=24)
    for i in range(4):
        run.add(f"long{i}", 60)
    for i in range(400):
        if i == 6:
            run.add("short", 12)                 # arrives last, into a pool about to be full
        run.step(i)
        if run.idle:
            break
    assert run.idle
    short = run.token_steps["short"]
    assert len(short) == 12 and short[0] == 6
    assert max(_gaps(short)) <= MAX_GAP_STEPS
    # Each long one gives way once (most recent first: cheapest recompute), before any twice;
    # among those preempted once, the one with the most tokens left goes next.
    assert run.order == ["long3", "long2", "long1", "long0", "long1", "long3"]
    assert "short" not in run.order
    for i in range(4):
        assert len(run.token_steps[f"long{i}"]) == 60


def test_a_short_request_arriving_after_every_long_one_was_preempted_is_not_the_first_victim():
    # Counted from 0, a newcomer would be the least preempted candidate once every long one
    # has given way: preempted first, then queued behind each later victim (17 steps without
    # a token here; up to 86 on a full MD, tests/reliability/test_full_md_starvation.py).
    # It starts at the most preempted live one's count.
    run = Run(num_blocks=60)
    for i in range(8):
        run.add(f"long{i}", 100)
    added = None
    for i in range(2000):
        if added is None and len(run.order) >= 8:
            live = [s.request_id for s in list(run.sched.running) + list(run.sched.waiting)]
            assert len(live) == 8 and min(run.sched.preempted.get(r, 0) for r in live) >= 1, run.sched.preempted
            run.add("short", 12)
            added = i
        run.step(i)
        if run.idle:
            break
    assert run.idle and added is not None
    short = run.token_steps["short"]
    assert len(short) == 12
    assert max(_gaps(short)) <= MAX_GAP_STEPS
    assert "short" not in run.order
    assert len(run.order) > 16                   # the pool stayed full while it ran
    for i in range(8):
        assert len(run.token_steps[f"long{i}"]) == 100


def test_no_request_is_preempted_again_before_every_other_candidate_was():
    # Equal sequences in a pool too small for them all: preemptions rotate.
    run = Run(num_blocks=14)
    for i in range(4):
        run.add(f"s{i}", 40)
    for i in range(2000):
        run.step(i)
        live = {s.request_id for s in list(run.sched.running) + list(run.sched.waiting)}
        live_counts = [run.sched.preempted.get(r, 0) for r in live]
        if len(live_counts) > 1:
            assert max(live_counts) - min(live_counts) <= 1, (i, run.sched.preempted)
        if run.idle:
            break
    assert run.idle and len(run.order) >= 4
    for k in range(4):
        assert len(run.token_steps[f"s{k}"]) == 40
    assert run.sched.preempted == {}            # forgotten with each finished sequence
