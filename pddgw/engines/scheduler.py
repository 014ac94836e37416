"""Continuous batching: which tokens of which sequences the next forward computes.

Each step has a token budget (max_num_batched_tokens), a batch bound
(max_num_seqs running sequences) and a per-sequence cap (max_chunk_tokens);
for an instance of several attention-DP ranks the budget and the bound are
the ranks' together.  A step that decodes computes at most
`mixed_step_tokens` other tokens (prefill chunks, extends) besides its
decodes, at most `mixed_chunk_tokens` of one sequence (a rank's share), so
a decode next to long prefills waits a short chunk's time.  Order of service:
  1. READY imports join the running set, in the order their imports finished;
     one on hold with nothing to compute keeps its KV but no batch place;
  2. running sequences, in admission order: a decode costs one token, an
     extend or a prefill chunk as many as the budget allows;
  3. waiting sequences, in arrival order, each from its longest prefix-cache
     hit (never the last prompt token: its logits are needed).
When a running sequence needs a block and none is left, the least protected
running sequence (`_protection`) is preempted, possibly the one asking: its
blocks are freed and it is recomputed later from its tokens.  Waiting
sequences just wait (back-pressure).  A sequence that retains its KV (a
prefill streaming its KV out) is admitted with blocks for all its tokens and
is never preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pddgw.engines.block_manager import BlockManager, OutOfBlocks
from pddgw.engines.sequence import Sequence, SeqStatus


@dataclass(slots=True)
class Chunk:
    seq: Sequence
    num_tokens: int      # tokens [seq.num_computed, seq.num_computed + num_tokens) are computed


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_chunk_tokens: int = 0, mixed_step_tokens: int = 0, mixed_chunk_tokens: int = 0):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_chunk_tokens = max_chunk_tokens or max_num_batched_tokens
        self.mixed_step_tokens = mixed_step_tokens or max_num_batched_tokens
        self.mixed_chunk_tokens = min(mixed_chunk_tokens or self.max_chunk_tokens, self.max_chunk_tokens)
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()      # READY: imported, waiting for a place in the batch
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Times each live sequence was preempted, counted from the most preempted live one's
        # count when it first ran (the first key of `_protection`).
        self.preempted: dict[str, int] = {}
        self._newcomers: list[Sequence] = []       # joined `running` since the last count
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.blocks.block_size)

    def has_work(self) -> bool:
        """Whether a step would compute anything (or admit a waiting sequence, or try to)."""
        if any(s.num_pending > 0 for s in self.running):
            return True
        room = len(self.running) < self.max_num_seqs
        return room and (bool(self.waiting) or any(s.num_pending > 0 for s in self.ready))

    def _run_ready(self) -> None:
        """READY sequences with something to compute join the running set while it has room."""
        room = self.max_num_seqs - len(self.running)
        if room <= 0 or not self.ready:
            return
        kept: deque[Sequence] = deque()           # on hold with nothing to compute, in order
        while self.ready and room > 0:
            seq = self.ready.popleft()
            if seq.num_pending > 0:
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                self._newcomers.append(seq)
                room -= 1
            else:
                kept.append(seq)
        kept.extend(self.ready)
        self.ready = kept

    def schedule(self) -> list[Chunk]:
        budget = self.max_num_batched_tokens
        batch: dict[str, Chunk] = {}       # this step's running chunks, by request, in order
        preempted = False
        self._run_ready()
        self._count_newcomers()
        bs = self.blocks.block_size
        running, most = SeqStatus.RUNNING, self.max_chunk_tokens
        # Tokens other than decodes this step may still compute (capped where it decodes).
        others = budget
        if self.mixed_step_tokens < budget and any(_decodes(s) for s in self.running):
            others, most = self.mixed_step_tokens, self.mixed_chunk_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            pending = len(seq.tokens) - seq.num_computed - (1 if seq.hold else 0)     # `num_pending`
            if seq.status != running or pending == 0:
                continue   # preempted in this loop, or on hold with nothing to compute
            decode = pending == 1 and seq.num_outputs > 0
            if not decode and others == 0:
                continue
            room = budget if decode else min(budget, others)
            n = pending if pending <= room and pending <= most else min(pending, room, most)
            if seq.num_computed + n > len(seq.block_ids) * bs:     # it needs a block (most steps do not)
                clean, refund = self._reserve(seq, seq.num_computed + n, batch)
                budget += refund
                if not clean:
                    preempted = True
                    if seq.status != SeqStatus.RUNNING:
                        continue
            batch[seq.request_id] = Chunk(seq, n)
            budget -= n
            if not decode:
                others -= n
        chunks = list(batch.values())
        while (self.waiting and min(budget, others) > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            n = self._admit(seq, min(budget, others, most))
            if n is None:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._newcomers.append(seq)
            if n:
                chunks.append(Chunk(seq, n))
                budget -= n
                others -= n
        return chunks

    def decodes(self) -> list[Sequence] | None:
        """The next step when it is one decode token of every running sequence and nothing else:
        `schedule`'s very batch, its blocks allocated as `schedule` allocates them, in running
        order (no Chunk each: the caller computes one token of each).  None, with nothing
        changed, for any other step: one that admits or joins a sequence, preempts, computes
        more than one token of a sequence or skips one (on hold, or past the token budget)."""
        running = self.running
        n = len(running)
        if not n or n > self.max_num_batched_tokens:
            return None
        if n < self.max_num_seqs:
            if self.waiting and n < self.max_num_batched_tokens:
                return None                  # `schedule` would try to admit
            if any(s.num_pending > 0 for s in self.ready):
                return None                  # `_run_ready` would join one
        bs = self.blocks.block_size
        needy = []
        for seq in running:
            computed = seq.num_computed
            if len(seq.tokens) - computed != 1 or seq.hold:
                return None
            if computed >= len(seq.block_ids) * bs:
                needy.append(seq)
        if len(needy) > self.blocks.num_allocatable:
            return None                      # `_reserve` would preempt
        self._count_newcomers()
        for seq in needy:
            seq.block_ids += self.blocks.allocate(1)
        return running[:]

    def _reserve(self, seq: Sequence, num_tokens: int, batch: dict[str, Chunk]) -> tuple[bool, int]:
        """Make seq hold blocks for num_tokens, preempting less protected sequences if needed
        (a victim already in `batch` leaves it).

        -> (False if anything was preempted, seq itself possibly; the batch tokens freed).
        """
        need = self.blocks_for(num_tokens) - len(seq.block_ids)
        clean, refund = True, 0
        while need > self.blocks.num_allocatable:
            victim = self._victim(seq)
            self.preempt(victim)
            clean = False
            if victim is seq:
                return False, refund
            dropped = batch.pop(victim.request_id, None)
            if dropped is not None:
                refund += dropped.num_tokens
        if need > 0:
            seq.block_ids += self.blocks.allocate(need)
        return clean, refund

    def _count_newcomers(self) -> None:
        """Give each running sequence not counted yet (admitted, or its import finished, since
        the last step) the most preempted live sequence's count: `_victim` only ever picks
        among `running`, so every candidate is counted before it is compared."""
        floor = -1
        for seq in self._newcomers:
            # (One that left `running` since is not counted: a preempted one is, a finished one goes.)
            if seq.status == SeqStatus.RUNNING and seq.request_id not in self.preempted:
                if floor < 0:
                    floor = max(self.preempted.values(), default=0)
                self.preempted[seq.request_id] = floor
        self._newcomers.clear()

    def _protection(self, seq: Sequence, admitted: int) -> tuple[int, int, int]:
        """Higher = kept longer under preemption; `admitted`: its index in `running`.

        Keys, most important first: (1) fewer preemptions, so nobody is preempted a k+1-th
        time while another candidate has k, and no request starves (newcomers start at the
        most preempted live count, `_count_newcomers`); (2) fewer output tokens left; (3)
        admitted earlier (the latest, cheapest to recompute, goes first).
        """
        left = seq.sampling.max_tokens - seq.num_outputs
        return self.preempted[seq.request_id], -left, -admitted

    def _victim(self, seq: Sequence) -> Sequence:
        """The least protected running sequence, `seq` (the one asking) included; never one
        whose KV streams out (see `_admit`)."""
        cands = [(self._protection(c, i), c) for i, c in enumerate(self.running)
                 if c is seq or not c.retain]
        return min(cands, key=lambda pc: pc[0])[1]

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it first in line; it recomputes from its tokens."""
        self.blocks.release(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_published = 0
        seq.kv_source = "compute"
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preempted[seq.request_id] = self.preempted.get(seq.request_id, 0) + 1

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting seq its cached prefix and blocks for its first chunk; None if no room."""
        bs = self.blocks.block_size
        # Never serve the last token from cache: its forward yields the next logits.
        hashes = seq.block_hashes((len(seq.tokens) - 1) // bs, bs)
        # Prompt logprobs come from the logits of every prompt position: no cached prefix.
        cached = self.blocks.match(hashes, seq.request_id) if seq.sampling.prompt_logprobs is None else []
        self.blocks.acquire(cached)
        n_cached = len(cached) * bs
        n = min(len(seq.tokens) - n_cached - (1 if seq.hold else 0), budget, self.max_chunk_tokens)
        # A retained sequence (P) streams its KV out while it is computed: preempting it
        # would invalidate what its senders export.  It gets blocks for all its tokens at
        # admission, so it never needs more, or waits until they are free.
        upto = len(seq.tokens) if seq.retain else n_cached + n
        try:
            fresh = self.blocks.allocate(self.blocks_for(upto) - len(cached))
        except OutOfBlocks:
            self.blocks.release(cached)
            return None
        seq.block_ids = cached + fresh
        seq.num_computed = seq.num_cached_tokens = n_cached
        seq.num_published = len(cached)
        self.prefix_hit_tokens += n_cached
        self.prefix_query_tokens += len(seq.tokens)
        return n

    def remove(self, seq: Sequence) -> None:
        self.preempted.pop(seq.request_id, None)
        if seq.status == SeqStatus.READY:
            self.ready.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


def _decodes(seq: Sequence) -> bool:
    """Whether `seq`'s next computed token is a decode (one token past its prompt, sampled next)."""
    return (seq.status == SeqStatus.RUNNING and not seq.hold and seq.num_outputs > 0
            and len(seq.tokens) - seq.num_computed == 1)
