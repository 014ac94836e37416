"""One step's model inputs: token ids, positions and the attention metadata.

Two builders produce exactly the same tensors (values, dtypes, shapes):
`ListInputs` rebuilds everything from Python lists each step (prefill and
extend batches, and the reference in tests); `IncrementalInputs` builds
decode batches from persistent device tensors, writing only what changed.
Anything `IncrementalInputs` does not cover goes through `ListInputs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from pddgw.engines.attention import AttnMetadata
from pddgw.engines.scheduler import Chunk
from pddgw.engines.sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor     # [T] int64
    positions: torch.Tensor     # [T] int64 (absolute)
    meta: AttnMetadata
    logits_rows: torch.Tensor   # [S] int64, packed row of each sampled sequence's last token
    to_sample: list[int]        # chunk index of each sampled sequence


def _generated(chunk: Chunk) -> int:
    """How many of the chunk's tokens (its last ones) are generated, not the prompt's."""
    start = chunk.seq.num_computed
    return max(0, start + chunk.num_tokens - max(start, chunk.seq.num_prompt))


def _decodes(chunk: Chunk) -> bool:
    """Whether the chunk is a decode: one new token, a generated one (not the last token of a
    prompt whose others were cached or chunked: that one is attended as the prompt is)."""
    return chunk.num_tokens == 1 == _generated(chunk)


class ListInputs:
    """Every step rebuilds tables, slots, positions, ids and seq_lens from lists and copies them."""

    def __init__(self, block_size: int, device: torch.device, ops: ModuleType,
                 to_sample: Callable[[Chunk], bool]):
        self.block_size = block_size
        self.device = device
        self.ops = ops
        self.to_sample = to_sample

    def build(self, chunks: list[Chunk]) -> StepInputs:
        bs = self.block_size
        ids, pos, slots, q_lens, seq_lens, tables, to_sample = [], [], [], [0], [], [], []
        for i, c in enumerate(chunks):
            seq, start = c.seq, c.seq.num_computed
            end = start + c.num_tokens
            ids += seq.tokens[start:end]
            pos += range(start, end)
            slots += [seq.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            q_lens.append(q_lens[-1] + c.num_tokens)
            seq_lens.append(end)
            tables.append(seq.block_ids)
            if self.to_sample(c):
                to_sample.append(i)
        width = max(len(t) for t in tables)
        dev = self.device
        table = torch.zeros((len(tables), width), dtype=torch.int32)          # [B, width]
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        generated = [_generated(c) for c in chunks]
        is_decode = all(c.num_tokens == 1 == g for c, g in zip(chunks, generated))     # `_decodes` of each
        meta = AttnMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),  # [T]
            block_tables=table.to(dev),                                       # [B, width]
            cu_q_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),    # [B+1]
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),   # [B]
            is_decode=is_decode,
            ops=self.ops,
            generated=None if is_decode or not any(generated) else torch.tensor(generated, dtype=torch.int32),
        )
        logits_rows = torch.tensor([q_lens[i + 1] - 1 for i in to_sample], dtype=torch.int64, device=dev)
        return StepInputs(torch.tensor(ids, dtype=torch.int64, device=dev),   # [T]
                          torch.tensor(pos, dtype=torch.int64, device=dev),   # [T]
                          meta, logits_rows, to_sample)


class IncrementalInputs:
    """Decode batches (every chunk one token) from persistent device tensors.

    Each decoding sequence owns a row of `table` [max_rows, max_blocks]: written in full when
    it gets the row (or its block list was replaced), then only its new blocks, one
    `index_put_` per step; entries past its blocks stay zero, as the list path pads.  Positions
    advance on the device when the batch is the previous one each a token further (checked on
    the host); slots and seq_lens are derived on the device.  A longer chunk, more sequences
    than rows or a sequence longer than a row goes to `fallback`.
    """

    def __init__(self, block_size: int, device: torch.device, ops: ModuleType,
                 to_sample: Callable[[Chunk], bool], max_rows: int, max_blocks: int):
        self.fallback = ListInputs(block_size, device, ops, to_sample)
        self.block_size = block_size
        self.device = device
        self.ops = ops
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        dev = device
        self.table = torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=dev)  # [R, MB]
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=dev)          # [R] batch order
        self.slots = torch.zeros(max_rows, dtype=torch.int64, device=dev)              # [R] batch order
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=dev)           # [R] batch order
        self.arange32 = torch.arange(max_rows + 1, dtype=torch.int32, device=dev)      # [R+1] cu_q_lens
        self.arange64 = torch.arange(max_rows, dtype=torch.int64, device=dev)          # [R] logits rows
        # Host mirror of the table rows: owner, its block list object, blocks written.
        self.row_of: dict[Sequence, int] = {}
        self.free_rows: list[int] = list(range(max_rows - 1, -1, -1))
        self.row_ids: list[list[int] | None] = [None] * max_rows
        self.row_len = [0] * max_rows          # entries written (the rest of the row is zero)
        # The previous decode batch, in order, and where its positions stood.
        self._batch: list[Sequence] | None = None
        self._batch_pos: list[int] = []        # num_computed of each at that step
        self._rows: list[int] = []
        self._rows_dev: torch.Tensor | None = None   # [B] int64
        self._width = 0
        self._tables: torch.Tensor | None = None     # [B, width] the batch's rows of `table`
        # Counters (tests and benchmarks): steps built each way (`num_advanced`: fast steps whose
        # positions and slots moved on on the device), table entries written.
        self.num_fast = self.num_fallback = self.num_advanced = self.num_row_writes = 0

    def invalidate(self) -> None:
        """Forget the previous batch (positions are copied afresh next step); rows stay."""
        self._batch = None

    # ---- rows ------------------------------------------------------------------------
    def _assign_rows(self, seqs: list[Sequence]) -> list[int] | None:
        """Rows for a new batch composition; frees rows of sequences not in it."""
        keep = set(seqs)
        for s in [s for s in self.row_of if s not in keep]:
            self.free_rows.append(self.row_of.pop(s))
        rows = []
        for s in seqs:
            r = self.row_of.get(s)
            if r is None:
                if not self.free_rows:
                    return None
                r = self.free_rows.pop()
                self.row_of[s] = r
                self.row_ids[r] = None       # forces a full write below
            rows.append(r)
        return rows

    def _write_rows(self, seqs: list[Sequence], rows: list[int], changed: list[int]) -> tuple[int, bool]:
        """Bring the table rows of batch entries `changed` up to date.

        -> (widest of them, whether any row was rewritten rather than grown)."""
        rr, cc, vv = [], [], []
        width, replaced = 0, False
        for i in changed:
            s, r = seqs[i], rows[i]
            ids, n = s.block_ids, len(s.block_ids)
            if ids is self.row_ids[r] and n >= self.row_len[r]:
                start, old = self.row_len[r], 0            # grown in place: the new blocks only
            else:
                start, old = 0, self.row_len[r]            # new owner / new list: all, zero the rest
                self.row_ids[r] = ids
                replaced = True
            tail = max(old - n, 0)
            cnt = n - start + tail
            rr += [r] * cnt
            cc += range(start, n + tail)
            vv += ids[start:n]
            vv += [0] * tail
            self.row_len[r] = n
            width = max(width, n)
        if rr:
            dev = self.device
            self.table.index_put_((torch.tensor(rr, dtype=torch.int64, device=dev),
                                   torch.tensor(cc, dtype=torch.int64, device=dev)),
                                  torch.tensor(vv, dtype=torch.int32, device=dev))
            self.num_row_writes += len(rr)
        return width, replaced

    # ---- build ---------------------------------------------------------------------
    def build(self, chunks: list[Chunk]) -> StepInputs:
        B = len(chunks)
        if B > self.max_rows:
            return self._fallback(chunks)
        seqs = [c.seq for c in chunks if _decodes(c)]
        if len(seqs) != B:
            return self._fallback(chunks)         # a prefill / extend chunk: the list path
        same = seqs == self._batch        # identity per element: Sequence has no __eq__
        if same:
            rows = self._rows
        else:
            rows = self._assign_rows(seqs)
            if rows is None:
                return self._fallback(chunks)
        prev_pos = self._batch_pos if same else None
        # One host pass: token ids, sampling, positions check, rows needing a write.
        ids, to_sample, changed, pos, cross = [], [], [], [], []
        add_id, add_pos = ids.append, pos.append
        advanced = same
        bs = self.block_size
        row_ids, row_len = self.row_ids, self.row_len
        for i, s in enumerate(seqs):
            p = s.num_computed
            add_pos(p)
            if advanced and p != prev_pos[i] + 1:
                advanced = False
            if not p % bs:
                cross.append(i)                   # the first token of a block
            tokens = s.tokens
            add_id(tokens[p])
            if p + 1 == len(tokens) and not s.hold:
                to_sample.append(i)
            blk = s.block_ids
            r = rows[i]
            if blk is not row_ids[r] or len(blk) != row_len[r]:
                if len(blk) > self.max_blocks:
                    self.invalidate()
                    return self._fallback(chunks)
                changed.append(i)
        width, replaced = self._write_rows(seqs, rows, changed)
        advanced = advanced and not replaced      # a replaced block list: slots from scratch
        dev = self.device
        if same and not replaced:
            width = max(self._width, width)       # rows only grew
        else:
            width = max(row_len[r] for r in rows)
        if not same:
            self._rows = rows
            self._rows_dev = torch.tensor(rows, dtype=torch.int64, device=dev)   # [B]
        self._batch, self._batch_pos, self._width = seqs, pos, width
        if changed or not same:
            self._tables = self.table[:, :width].index_select(0, self._rows_dev)  # [B, width]
        tables = self._tables
        positions, slots, seq_lens = self.positions[:B], self.slots[:B], self.seq_lens[:B]   # [B] each
        if advanced:
            # Every sequence moved on by one token, and so did its slot, unless it entered
            # a new block: those few slots are written from the host.
            self.num_advanced += 1
            positions += 1
            seq_lens += 1
            slots += 1
            if cross:
                slots.index_put_((torch.tensor(cross, dtype=torch.int64, device=dev),),
                                 torch.tensor([seqs[i].block_ids[pos[i] // bs] * bs for i in cross],
                                              dtype=torch.int64, device=dev))
        else:
            positions.copy_(torch.tensor(pos, dtype=torch.int64))
            blocks = tables.gather(1, torch.div(positions, bs, rounding_mode="floor")[:, None])  # [B, 1]
            torch.add(blocks[:, 0].to(torch.int64) * bs, positions % bs, out=slots)
            seq_lens.copy_(positions + 1)
        meta = AttnMetadata(slot_mapping=slots, block_tables=tables, cu_q_lens=self.arange32[: B + 1],
                            seq_lens=seq_lens, is_decode=True, ops=self.ops)
        logits_rows = (self.arange64[:B] if len(to_sample) == B
                       else torch.tensor(to_sample, dtype=torch.int64, device=dev))   # [S]
        self.num_fast += 1
        return StepInputs(torch.tensor(ids, dtype=torch.int64, device=dev),   # [B]
                          positions, meta, logits_rows, to_sample)

    def _fallback(self, chunks: list[Chunk]) -> StepInputs:
        self.invalidate()
        self.num_fallback += 1
        return self.fallback.build(chunks)
