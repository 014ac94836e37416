"""What every paged engine shares: requests, blocks, prefix cache, scheduling, stopping.

`PagedEngine` implements the whole `Engine` contract except what touches KV
data or logits, which a subclass supplies:

  `_forward(chunks)`   run one batch; -> {request_id: (sampled token,
                       TokenLogprobs or None)} for the complete sequences not
                       on hold (logprobs exactly where sampling asked)
  `_export(seq, ...)`  the KV payload of a token x layer range
  `_import(seq, chunk, start)`  write an arriving chunk's tokens [start, end)

and optionally where payloads land (`_block_array`: one block of every layer
in the wire layout; `_staging_array`: a buffer to copy from).  The torch and
cost-model engines both run this very control logic.

Receiving in place (`import_buffer` / `accept_kv`, on the event loop while
the engine thread may step), invariants:
  * a lease covers one unpublished block of an IMPORTING request, allocated
    to it alone, for a chunk of exactly that block's tokens none present yet;
  * `finish_import` refuses while a lease is open;
  * `abort` parks leased blocks until their payload ends (`accept_kv` or a
    weakref finalizer), then `_reclaim` frees them: no freed block is written;
  * only the engine thread touches the BlockManager; other threads move
    leases under `_import_lock`, finalizers only append to a deque.
"""

from __future__ import annotations

import threading
import weakref
from abc import abstractmethod
from collections import deque
from collections.abc import Sequence as Seq
from collections.abc import Set
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from pddgw.config import EngineConfig
from pddgw.engines.base import TrackedEngine, check_kv_span
from pddgw.engines.block_manager import BlockManager
from pddgw.engines.model_spec import ModelSpec
from pddgw.engines.prompt_hashes import prompt_hashes
from pddgw.engines.scheduler import Chunk, Scheduler
from pddgw.engines.sequence import Sequence, SeqStatus
from pddgw.core.tokens import TokenLogprobs
from pddgw.engines.types import (AddResult, CapacityError, EngineRequest, EngineStats, FinishReason,
                                 KVChunk, KVLayout, KVSpan, RequestError, RequestOutput)

# What `_forward` returns per sampled sequence: its token, and its logprobs when it asked for them.
Sampled = tuple[int, TokenLogprobs | None]


class LeaseState(IntEnum):
    OPEN = 1      # handed out by import_buffer: the payload may be arriving
    PARKED = 2    # its import was aborted while open: the block waits for the payload's end
    DONE = 3      # committed, dropped or given back


@dataclass(slots=True, eq=False)
class _Lease:
    """One pool block handed out for one chunk's payload (see the module docstring)."""

    seq: Sequence | None            # None once parked
    block_index: int
    block_id: int
    token_start: int
    token_end: int
    exporter: weakref.ref           # the array the network writes through
    state: LeaseState = LeaseState.OPEN


def _exporter(data: Any) -> object | None:
    """The object that exports a payload buffer (a memoryview's `obj`), if known."""
    return data.obj if isinstance(data, memoryview) else None


_NOT_SAMPLED = (None, None)


def _prompt_waits(s: Sequence) -> bool:
    """Whether a step still has to take `s` in for its prompt (computed or imported)."""
    return s.status in (SeqStatus.WAITING, SeqStatus.READY) or (
        s.status == SeqStatus.RUNNING and s.num_computed < s.num_prompt)


class PagedEngine(TrackedEngine):
    _RETAINED = SeqStatus.RETAINED
    _EXTENDABLE = frozenset({SeqStatus.WAITING, SeqStatus.IMPORTING, SeqStatus.READY, SeqStatus.RUNNING})
    # Whether `_forward` computes prompt logprobs (fills `_scoring` for `_prompt_rows`).
    scores_prompts = False

    def __init__(self, spec: ModelSpec, cfg: EngineConfig, kv_dtype: str, num_blocks: int,
                 max_model_len: int = 0):
        self.spec = spec
        self.cfg = cfg
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        ranks = cfg.dp_ranks
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs * ranks, cfg.max_num_batched_tokens * ranks,
                                   max_chunk_tokens=cfg.max_num_batched_tokens,
                                   mixed_step_tokens=cfg.mixed_step_tokens * ranks,
                                   mixed_chunk_tokens=cfg.mixed_step_tokens)
        limit = max_model_len or spec.max_position_embeddings
        # A sequence must fit in the pool on its own, or preemption could never make room.
        self._max_model_len = min(limit, spec.max_position_embeddings, num_blocks * cfg.block_size)
        self._layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype, cfg.block_size)
        self._eos = frozenset(spec.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self._live = self.seqs                    # the same table, by TrackedEngine's name
        self._events: list[RequestOutput] = []   # outputs produced outside step (aborts)
        # Prompt logprobs being computed: slot i scores prompt token i + 1; `_forward` fills the
        # slots it computed, a recompute overwrites them with the same values, and the step that
        # computes the last prompt token emits them once.  Such a request skips the prefix cache.
        self._scoring: dict[str, list[TokenLogprobs | None]] = {}
        self._held = False          # the last step held sampled tokens back (output_interval)
        # Receiving KV in place (module docstring): the lock guards leases, IMPORTING status and
        # `Sequence.imported` against the network thread; it is never held across a step.
        self._import_lock = threading.Lock()
        self._parked: set[_Lease] = set()
        self._gone: deque[_Lease] = deque()       # leases whose view was released (any thread)
        self._returned: list[int] = []            # parked blocks to release on the engine thread
        self.kv_bytes_landed = 0                  # imported payload bytes received in place
        self.kv_bytes_copied = 0                  # imported payload bytes copied into the pool
        # Grammar-constrained sampling (engines/grammar.py): None = this engine has no vocabulary
        # to compile grammars against (a request with one is refused).
        self.grammars = None

    # ---- what a subclass computes ---------------------------------------------------
    @abstractmethod
    def _forward(self, chunks: list[Chunk]) -> dict[str, Sampled]:
        """Compute the chunks' tokens; -> (sampled token, logprobs or None) of each complete,
        non-held sequence (logprobs exactly where its sampling asked for them)."""

    @abstractmethod
    def _export(self, seq: Sequence, token_start: int, token_end: int, layer_start: int,
                layer_end: int) -> KVChunk:
        """The KV of a validated range, as a chunk."""

    @abstractmethod
    def _import(self, seq: Sequence, chunk: KVChunk, start: int) -> None:
        """Write tokens [start, chunk.token_end) of a validated chunk into seq's blocks."""

    def _check_chunk_data(self, chunk: KVChunk) -> None:
        """Subclass hook: refuse a payload this engine cannot store (RequestError)."""

    def _block_array(self, block_id: int) -> Any | None:
        """Subclass hook (any thread): a new writable byte array over one block's KV of every
        layer in the wire layout [layers, 2, block_size, kv_heads, head_dim], or None.  A fresh
        object per call that supports weak references: its death ends a lease."""
        return None

    def _staging_array(self, nbytes: int) -> Any | None:
        """Subclass hook (any thread): a new writable byte buffer to receive a payload that
        `_import` then copies from, or None."""
        return None

    # ---- contract: requests -------------------------------------------------------
    def add_request(self, request: EngineRequest) -> AddResult:
        self._reclaim()
        self._check_new(request)
        rid = request.request_id
        seq = Sequence(request)
        sampling = request.sampling
        seq.stops = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self._eos)
        seq.out_limit = min(sampling.max_tokens, self._max_model_len - seq.num_prompt)
        if self.blocks.enable_prefix_caching:
            # The prompt's full blocks hashed once per process (prompt_hashes.py): the router and
            # the other in-process nodes hashed this very tuple already.  Sequence grows its
            # hash list lazily from what is there.
            seq.seed_hashes(list(prompt_hashes(request.prompt_token_ids, self.blocks.block_size)))
        if request.sampling.grammar is not None:
            if self.grammars is None:
                raise RequestError(f"request {rid!r}: grammar: this engine has no vocabulary for grammars")
            # Compiled here, on the engine's thread (cached by spec); fed the output tokens before each draw.
            seq.constraint = self.grammars.constraint(request.sampling.grammar)
        if request.kv_source == "import":
            self._admit_import(seq)
        else:
            self.scheduler.waiting.append(seq)
            if request.sampling.prompt_logprobs is not None:
                if not self.scores_prompts:
                    raise RequestError(f"request {rid!r}: prompt_logprobs: this engine "
                                       f"({type(self).__name__}) does not compute them")
                self._scoring[rid] = [None] * (seq.num_prompt - 1)
        # An earlier request of this id that was aborted but not yet stepped: its abort
        # output must not reach the new one.
        self._events = [e for e in self._events if e.request_id != rid]
        self.seqs[rid] = seq
        return AddResult(rid, seq.num_cached_tokens)

    def _admit_import(self, seq: Sequence) -> None:
        """Cached prefix + fresh blocks for the rest of the prompt, all at once."""
        bs = self.blocks.block_size
        cached = self.blocks.match(seq.block_hashes(seq.num_prompt // bs, bs), seq.request_id)
        need = self.scheduler.blocks_for(seq.num_prompt) - len(cached)
        self.blocks.acquire(cached)
        room = self.blocks.num_allocatable
        if need > room:
            self.blocks.release(cached)
            # The room it was refused for: with its cached prefix held (released, those blocks
            # count as evictable again).
            raise CapacityError(f"request {seq.request_id!r}: import needs {need} KV blocks, "
                                f"{room} allocatable")
        seq.block_ids = cached + self.blocks.allocate(need)
        seq.num_computed = seq.num_cached_tokens = seq.last_reported = len(cached) * bs
        seq.num_published = len(cached)
        seq.imported = bytearray(seq.num_prompt)
        seq.status = SeqStatus.IMPORTING
        self.scheduler.prefix_hit_tokens += seq.num_cached_tokens
        self.scheduler.prefix_query_tokens += seq.num_prompt

    def _num_computed(self, seq: Sequence) -> int:
        return seq.num_computed

    def _abort(self, seq: Sequence) -> int:
        parked: set[int] = set()
        if seq.status == SeqStatus.IMPORTING and seq.imported is not None:
            with self._import_lock:
                self._collect_gone()
                # Blocks a payload may still be landing in wait for its end (`abort`, module docstring).
                for lease in seq.leases.values():
                    lease.state, lease.seq = LeaseState.PARKED, None
                    self._parked.add(lease)
                    parked.add(lease.block_id)
                seq.leases.clear()
                seq.status = SeqStatus.FINISHED      # import_buffer hands out nothing more
                # A cancelled import keeps its complete leading blocks: the conversation's
                # next turn finds them cached instead of moving them again.
                arrived = seq.imported.find(0, seq.num_cached_tokens)
            seq.num_computed = seq.num_prompt if arrived == -1 else arrived
            self._publish(seq)
        self._free(seq, parked)
        return seq.num_computed

    def _forget(self, seq: Sequence) -> None:
        self._free(seq)

    def _free(self, seq: Sequence, parked: Set[int] = frozenset()) -> None:
        self._scoring.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        self.blocks.release([b for b in seq.block_ids if b not in parked] if parked else seq.block_ids)
        seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        del self.seqs[seq.request_id]

    def _appended(self, seq: Sequence, final: bool, reason: FinishReason | None) -> None:
        if reason is not None:
            self._finish(seq, reason)

    def has_work(self) -> bool:
        return bool(self._events) or self.scheduler.has_work()

    def prompt_work(self) -> bool:
        return any(map(_prompt_waits, self.seqs.values()))

    def prompt_ends_next_step(self) -> bool:
        left = [s.num_prompt - s.num_computed for s in self.seqs.values() if _prompt_waits(s)]
        sched = self.scheduler
        return len(left) <= sched.max_num_seqs and sum(left) <= sched.max_num_batched_tokens

    # ---- contract: prefix cache -----------------------------------------------
    def match_prefix(self, block_hashes: Seq[int], pin_key: str | None = None) -> int:
        self._reclaim()
        blocks = self.blocks.match(block_hashes)
        if pin_key is not None:
            self.blocks.pin(pin_key, blocks)
        return len(blocks)

    def unpin(self, pin_key: str) -> bool:
        return self.blocks.unpin(pin_key)

    # ---- contract: KV transfer -----------------------------------------------------
    def export_kv(self, request_id: str, token_start: int, token_end: int,
                  layer_start: int = 0, layer_end: int | None = None) -> KVChunk:
        seq = self._get(request_id)
        layer_end = self._check_export(request_id, token_start, token_end, seq.num_computed, layer_start, layer_end)
        return self._export(seq, token_start, token_end, layer_start, layer_end)

    def _check_span(self, seq: Sequence, span: KVSpan) -> None:
        """RequestError unless `span` fits this importing request and this model."""
        if seq.status != SeqStatus.IMPORTING:
            raise RequestError(f"request {span.request_id!r} is {seq.status.name}, not importing")
        check_kv_span(span, self._layout, seq.num_prompt)

    def _check_chunk(self, seq: Sequence, chunk: KVChunk) -> None:
        self._check_span(seq, chunk.span)        # the payload's size is KVChunk's own invariant
        self._check_chunk_data(chunk)

    def import_buffer(self, span: KVSpan) -> memoryview | None:
        staging = False
        with self._import_lock:
            self._collect_gone()
            seq = self.seqs.get(span.request_id)
            if seq is None or seq.status != SeqStatus.IMPORTING or seq.imported is None:
                return None
            try:
                self._check_span(seq, span)
            except RequestError:
                return None                  # import_kv reports it
            arr = self._lease(seq, span)
            if arr is not None:
                return memoryview(arr)
            staging = True
        buf = self._staging_array(span.nbytes) if staging else None
        return None if buf is None else memoryview(buf)

    def _lease(self, seq: Sequence, span: KVSpan) -> Any | None:
        """Under the lock: the pool block `span` covers exactly, leased to its payload; or None."""
        bs = self.blocks.block_size
        if ((span.layer_start, span.layer_end) != (0, self.spec.num_layers) or span.dtype != self._layout.dtype
                or span.token_start % bs or span.num_tokens != bs or span.token_start < seq.num_cached_tokens):
            return None
        index = span.token_start // bs
        if index in seq.leases or seq.imported.find(1, span.token_start, span.token_end) != -1:
            return None                      # a duplicate: never two writers for one block
        block = seq.block_ids[index]
        arr = self._block_array(block)
        if arr is None:
            return None
        lease = _Lease(seq, index, block, span.token_start, span.token_end, weakref.ref(arr))
        weakref.finalize(arr, self._gone.append, lease)
        seq.leases[index] = lease
        return arr

    def _find_lease(self, chunk: KVChunk) -> _Lease | None:
        """Under the lock: the lease whose memory holds this chunk's payload, if any."""
        exporter = _exporter(chunk.payload)
        if exporter is None:
            return None
        seq = self.seqs.get(chunk.request_id)
        if seq is not None:
            lease = seq.leases.get(chunk.token_start // self.blocks.block_size)
            if (lease is not None and lease.exporter() is exporter
                    and (lease.token_start, lease.token_end) == (chunk.token_start, chunk.token_end)):
                return lease
        for lease in self._parked:
            if lease.exporter() is exporter:
                return lease
        return None

    def accept_kv(self, chunk: KVChunk) -> bool:
        with self._import_lock:
            self._collect_gone()
            lease = self._find_lease(chunk)
            if lease is not None and lease.state == LeaseState.PARKED:
                self._end_parked(lease)      # the import was aborted: the block goes back
                return True
            seq = self._get(chunk.request_id)
            self._check_chunk(seq, chunk)
            if lease is None:
                return False
            # The payload is in its block: commit = mark its tokens present (the lease covers
            # every layer of tokens past the cached prefix).
            del seq.leases[lease.block_index]
            lease.state = LeaseState.DONE
            seq.imported[lease.token_start : lease.token_end] = b"\x01" * (lease.token_end - lease.token_start)
            self.kv_bytes_landed += chunk.payload_nbytes
            return True

    def import_kv(self, chunk: KVChunk) -> None:
        if self.accept_kv(chunk):
            return
        seq = self.seqs[chunk.request_id]      # accept_kv checked it is importing
        # Tokens from this engine's prefix cache live in shared blocks: never overwrite them.
        start = max(chunk.token_start, seq.num_cached_tokens)
        if start >= chunk.token_end:
            return
        self._import(seq, chunk, start)
        self.kv_bytes_copied += chunk.payload_nbytes * (chunk.token_end - start) // chunk.num_tokens
        if chunk.layer_end == self.spec.num_layers:
            # A token counts as arrived once its last layer has (chunks of a range come in layer order).
            with self._import_lock:
                seq.imported[start : chunk.token_end] = b"\x01" * (chunk.token_end - start)

    def finish_import(self, request_id: str) -> None:
        seq = self._get(request_id)
        with self._import_lock:
            self._collect_gone()
            if seq.status != SeqStatus.IMPORTING:
                raise RequestError(f"request {request_id!r} is {seq.status.name}, not importing")
            if seq.leases:
                lease = min(seq.leases.values(), key=lambda x: x.token_start)
                raise RequestError(f"request {request_id!r}: KV of prompt tokens [{lease.token_start}, "
                                   f"{lease.token_end}) is still arriving")
            missing = seq.imported.find(0, seq.num_cached_tokens)
            if missing != -1:
                raise RequestError(f"request {request_id!r}: KV of prompt token {missing} never arrived")
            seq.num_computed = seq.num_prompt
            seq.imported = None
            seq.status = SeqStatus.READY
        self.scheduler.ready.append(seq)
        self._publish(seq)

    # ---- leases: the network thread's side ends here ------------------------------------
    def _collect_gone(self) -> None:
        """Under the lock: settle leases whose view was released (by whatever thread)."""
        while self._gone:
            lease = self._gone.popleft()
            if lease.state == LeaseState.OPEN:
                # Released undelivered (e.g. its connection was lost mid-frame): the block may
                # be leased again; its tokens are still missing.
                if lease.seq is not None and lease.seq.leases.get(lease.block_index) is lease:
                    del lease.seq.leases[lease.block_index]
                lease.state = LeaseState.DONE
            elif lease.state == LeaseState.PARKED:
                self._end_parked(lease)

    def _end_parked(self, lease: _Lease) -> None:
        self._parked.discard(lease)
        lease.state = LeaseState.DONE
        self._returned.append(lease.block_id)

    def _reclaim(self) -> None:
        """Engine thread: release parked blocks whose payload has ended."""
        with self._import_lock:
            self._collect_gone()
            blocks, self._returned = self._returned, []
        if blocks:
            self.blocks.release(blocks)

    # ---- contract: step ---------------------------------------------------------
    def held_last_step(self) -> bool:
        return self._held

    def step(self) -> list[RequestOutput]:
        self._reclaim()
        outputs, self._events = self._events, []
        self._held = False
        if self._decode_step(outputs):
            return outputs
        chunks = self.scheduler.schedule()
        if not chunks:
            return outputs
        sampled = self._forward(chunks)
        bs = self.blocks.block_size
        scoring = self._scoring
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            if seq.num_computed // bs > seq.num_published:
                self._publish(seq)
            token, lp = sampled.get(seq.request_id, _NOT_SAMPLED)
            scored = self._scored(seq) if scoring else ()
            if token is not None:
                self._sampled(seq, token, lp, outputs, scored)
            elif seq.num_computed != seq.last_reported:
                seq.last_reported = seq.num_computed
                outputs.append(RequestOutput(seq.request_id, (), len(seq.tokens) - seq.num_prompt,
                                             seq.num_computed, False, None, (), scored))
        return outputs

    def _decode_step(self, outputs: list[RequestOutput]) -> bool:
        """Subclass hook: run this step here when it is one decode token of every running
        sequence (`Scheduler.decodes`), its outputs into `outputs`, and say so; False leaves the
        step to the general path (chunks, `_forward`)."""
        return False

    def _sampled(self, seq: Sequence, token: int, lp: TokenLogprobs | None, outputs: list[RequestOutput],
                 scored: tuple[TokenLogprobs, ...] = ()) -> None:
        """After a step computed seq's last token: append the token sampled from it and, unless
        it is held for its run (output_interval), put its output in `outputs`."""
        position = len(seq.tokens) - seq.num_prompt
        seq.tokens.append(token)
        # `_finish_reason` only where it can say something (Sequence.stops, out_limit).
        reason = (None if position + 1 < seq.out_limit and token not in seq.stops
                  else self._finish_reason(seq, token))
        if seq.out_every == 1:
            ids, lps = (token,), () if lp is None else (lp,)
        else:
            mark = seq.out_mark
            if reason is None and mark >= 0 and position + 1 - mark < seq.out_every:
                if lp is not None:
                    seq.out_logprobs.append(lp)
                self._held = True
                return                        # held: it goes out with the run (output_interval)
            if mark >= 0:
                ids = tuple(seq.tokens[seq.num_prompt + mark :])
                position = mark
            else:
                ids = (token,)
            if lp is not None:
                seq.out_logprobs.append(lp)
            lps = tuple(seq.out_logprobs)
            seq.out_logprobs.clear()
            seq.out_mark = seq.num_outputs
        seq.last_reported = seq.num_computed
        if reason is not None:
            self._finish(seq, reason)
        outputs.append(RequestOutput(seq.request_id, ids, position, seq.num_computed, reason is not None,
                                     reason, lps, scored))

    def _prompt_rows(self, chunk: Chunk) -> range:
        """The positions of this chunk whose logits score a prompt token (the next one) for a
        request still owed its prompt logprobs; empty for every other chunk."""
        seq = chunk.seq
        if seq.request_id not in self._scoring:
            return range(0)
        start = seq.num_computed
        return range(start, min(start + chunk.num_tokens, seq.num_prompt - 1))

    def _scored(self, seq: Sequence) -> tuple[TokenLogprobs, ...]:
        """After a chunk: the prompt logprobs, once the whole prompt is computed (then no more)."""
        slots = self._scoring.get(seq.request_id)
        if slots is None or seq.num_computed < seq.num_prompt:
            return ()
        del self._scoring[seq.request_id]
        missing = next((i for i, v in enumerate(slots) if v is None), None)
        if missing is not None:
            raise RuntimeError(f"request {seq.request_id!r}: prompt token {missing + 1} was never scored")
        return tuple(slots)  # type: ignore[arg-type]

    @staticmethod
    def _to_sample(chunk: Chunk) -> bool:
        """Does this chunk complete its sequence, so that its last logits are sampled?"""
        seq = chunk.seq
        return seq.num_computed + chunk.num_tokens == len(seq.tokens) and not seq.hold

    def _finish(self, seq: Sequence, reason) -> None:
        seq.finish_reason = reason
        if seq.retain:
            self.scheduler.remove(seq)
            seq.status = SeqStatus.RETAINED
        else:
            self._free(seq)

    def _publish(self, seq: Sequence) -> None:
        """Publish newly computed full blocks to the prefix cache."""
        bs = self.blocks.block_size
        full = seq.num_computed // bs
        if full <= seq.num_published:
            return
        first = seq.num_published
        for block, h in zip(seq.block_ids[first:full], seq.block_hashes(full, bs, first)):
            self.blocks.publish(block, h)
        seq.num_published = full

    # ---- contract: introspection ----------------------------------------------------
    def stats(self) -> EngineStats:
        self._reclaim()
        statuses = [s.status for s in self.seqs.values()]
        return EngineStats(
            num_blocks=self.blocks.num_blocks, free_blocks=self.blocks.num_free,
            cached_blocks=self.blocks.num_cached, used_blocks=self.blocks.num_used,
            running=statuses.count(SeqStatus.RUNNING),
            waiting=statuses.count(SeqStatus.WAITING) + statuses.count(SeqStatus.READY),
            importing=statuses.count(SeqStatus.IMPORTING), retained=statuses.count(SeqStatus.RETAINED),
            pins=self.blocks.num_pins, prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            prefix_query_tokens=self.scheduler.prefix_query_tokens,
            preemptions=self.scheduler.num_preemptions)

    def check_integrity(self) -> None:
        self._reclaim()
        with self._import_lock:
            network = [lease.block_id for lease in self._parked] + self._returned
        self.blocks.check_integrity([*(s.block_ids for s in self.seqs.values()), network])
