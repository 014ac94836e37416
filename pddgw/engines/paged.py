"""What every paged engine shares: requests, blocks, prefix cache, scheduling, stopping.

`PagedEngine` implements the whole `Engine` contract except the model: the
BlockManager (free lists, ref counts, prefix cache, pins), the continuous-
batching Scheduler (chunked prefill, extends, decodes, preemption), import
bookkeeping, hold / append_tokens, stop logic and publishing full blocks.  A
subclass supplies the three things that touch KV data or logits:

  `_forward(chunks)`       run one batch; -> {request_id: sampled token} for
                           the sequences that are complete and not on hold
  `_export(seq, ...)`      the KV payload of a token x layer range
  `_import(seq, chunk, start)`  write an arriving chunk's tokens [start, end)

The torch engine computes them with a real model over a real KV pool; the
cost-model engine (`costmodel.py`) replaces them by their time on modeled
hardware, so both run the very same control logic.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence as Seq

from pddgw.config import EngineConfig
from pddgw.engines.base import Engine
from pddgw.engines.block_manager import BlockManager
from pddgw.engines.model_spec import ModelSpec
from pddgw.engines.scheduler import Chunk, Scheduler
from pddgw.engines.sequence import Sequence, SeqStatus
from pddgw.engines.types import (DTYPE_ITEMSIZE, AddResult, CapacityError, EngineRequest, EngineStats,
                                 KVChunk, KVLayout, RequestError, RequestOutput)


class PagedEngine(Engine):
    def __init__(self, spec: ModelSpec, cfg: EngineConfig, kv_dtype: str, num_blocks: int,
                 max_model_len: int = 0):
        self.spec = spec
        self.cfg = cfg
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        limit = max_model_len or spec.max_position_embeddings
        # A sequence must fit in the pool on its own, or preemption could never make room.
        self._max_model_len = min(limit, spec.max_position_embeddings, num_blocks * cfg.block_size)
        self._layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype, cfg.block_size)
        self._eos = frozenset(spec.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self._events: list[RequestOutput] = []   # outputs produced outside step (aborts)

    # ---- what a subclass computes ---------------------------------------------------
    @abstractmethod
    def _forward(self, chunks: list[Chunk]) -> dict[str, int]:
        """Compute the chunks' tokens; -> sampled token of each complete, non-held sequence."""

    @abstractmethod
    def _export(self, seq: Sequence, token_start: int, token_end: int, layer_start: int,
                layer_end: int) -> KVChunk:
        """The KV of a validated range, as a chunk."""

    @abstractmethod
    def _import(self, seq: Sequence, chunk: KVChunk, start: int) -> None:
        """Write tokens [start, chunk.token_end) of a validated chunk into seq's blocks."""

    def _check_chunk_data(self, chunk: KVChunk) -> None:
        """Subclass hook: refuse a payload this engine cannot store (RequestError)."""

    # ---- contract: properties -------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    # ---- contract: requests -------------------------------------------------------
    def add_request(self, request: EngineRequest) -> AddResult:
        rid = request.request_id
        if rid in self.seqs:
            raise RequestError(f"request {rid!r} already exists")
        n_prompt, n_out = len(request.prompt_token_ids), len(request.output_token_ids)
        if n_prompt == 0:
            raise RequestError(f"request {rid!r}: empty prompt")
        total = n_prompt + n_out
        if total >= self._max_model_len:
            raise RequestError(f"request {rid!r}: {total} tokens leave no room for output "
                               f"(context length {self._max_model_len})")
        if n_out >= request.sampling.max_tokens:
            raise RequestError(f"request {rid!r}: {n_out} output tokens given, max_tokens is "
                               f"{request.sampling.max_tokens}")
        vocab = self.spec.vocab_size
        ids = (*request.prompt_token_ids, *request.output_token_ids)
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise RequestError(f"request {rid!r}: token id {bad} outside the vocabulary [0, {vocab})")
        seq = Sequence(request)
        if request.kv_source == "import":
            self._admit_import(seq)
        else:
            self.scheduler.waiting.append(seq)
        self.seqs[rid] = seq
        return AddResult(rid, seq.num_cached_tokens)

    def _admit_import(self, seq: Sequence) -> None:
        """Cached prefix + fresh blocks for the rest of the prompt, all at once."""
        bs = self.blocks.block_size
        cached = self.blocks.match(seq.block_hashes(seq.num_prompt // bs, bs))
        need = self.scheduler.blocks_for(seq.num_prompt) - len(cached)
        self.blocks.acquire(cached)
        if need > self.blocks.num_allocatable:
            self.blocks.release(cached)
            raise CapacityError(f"request {seq.request_id!r}: import needs {need} KV blocks, "
                                f"{self.blocks.num_allocatable} allocatable")
        seq.block_ids = cached + self.blocks.allocate(need)
        seq.num_computed = seq.num_cached_tokens = seq.last_reported = len(cached) * bs
        seq.num_published = len(cached)
        seq.imported = bytearray(seq.num_prompt)
        seq.status = SeqStatus.IMPORTING
        self.scheduler.prefix_hit_tokens += seq.num_cached_tokens
        self.scheduler.prefix_query_tokens += seq.num_prompt

    def _get(self, request_id: str) -> Sequence:
        seq = self.seqs.get(request_id)
        if seq is None:
            raise RequestError(f"unknown request {request_id!r}")
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        was_retained = seq.status == SeqStatus.RETAINED
        if seq.status == SeqStatus.IMPORTING and seq.imported is not None:
            # A cancelled import keeps its complete leading blocks: the conversation's
            # next turn finds them cached instead of moving them again.
            arrived = seq.imported.find(0, seq.num_cached_tokens)
            seq.num_computed = seq.num_prompt if arrived == -1 else arrived
            self._publish(seq)
        self._free(seq)
        if not was_retained:
            self._events.append(RequestOutput(request_id, (), seq.num_outputs, seq.num_computed,
                                              True, "abort"))
        return True

    def release(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None or seq.status != SeqStatus.RETAINED:
            return False
        self._free(seq)
        return True

    def _free(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.blocks.release(seq.block_ids)
        seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        del self.seqs[seq.request_id]

    def append_tokens(self, request_id: str, token_ids: Seq[int], final: bool) -> None:
        seq = self._get(request_id)
        if seq.status not in (SeqStatus.WAITING, SeqStatus.IMPORTING, SeqStatus.RUNNING):
            raise RequestError(f"request {request_id!r} is {seq.status.name}, cannot extend")
        if not seq.hold:
            raise RequestError(f"request {request_id!r} is not on hold: its next tokens are sampled here")
        vocab = self.spec.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise RequestError(f"request {request_id!r}: handed-off token id outside [0, {vocab})")
        if len(seq.tokens) + len(token_ids) > self._max_model_len:
            raise RequestError(f"request {request_id!r}: handoff exceeds the context length")
        if seq.num_outputs + len(token_ids) > seq.sampling.max_tokens:
            raise RequestError(f"request {request_id!r}: handoff exceeds max_tokens")
        seq.tokens += token_ids
        seq.hold = not final
        reason = self._finish_reason(seq, token_ids[-1]) if final and token_ids else None
        if reason is not None:
            # The handed-off tokens already complete the request: nothing to sample.
            self._events.append(RequestOutput(request_id, (), seq.num_outputs, seq.num_computed,
                                              True, reason))
            self._finish(seq, reason)

    def has_work(self) -> bool:
        if self._events or self.scheduler.waiting:
            return True
        return any(s.num_pending > 0 for s in self.scheduler.running)

    # ---- contract: prefix cache -----------------------------------------------
    def match_prefix(self, block_hashes: Seq[int], pin_key: str | None = None) -> int:
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
        layer_end = self.spec.num_layers if layer_end is None else layer_end
        if not 0 <= token_start < token_end <= seq.num_computed:
            raise RequestError(f"request {request_id!r}: tokens [{token_start}, {token_end}) not "
                               f"in computed range [0, {seq.num_computed})")
        if not 0 <= layer_start < layer_end <= self.spec.num_layers:
            raise RequestError(f"layers [{layer_start}, {layer_end}) outside [0, {self.spec.num_layers})")
        return self._export(seq, token_start, token_end, layer_start, layer_end)

    def import_kv(self, chunk: KVChunk) -> None:
        seq = self._get(chunk.request_id)
        rid = chunk.request_id
        if seq.status != SeqStatus.IMPORTING:
            raise RequestError(f"request {rid!r} is {seq.status.name}, not importing")
        if (chunk.num_kv_heads, chunk.head_dim) != (self.spec.num_kv_heads, self.spec.head_dim):
            raise RequestError(f"request {rid!r}: KV shape heads={chunk.num_kv_heads} "
                               f"head_dim={chunk.head_dim} does not match this model's "
                               f"{self.spec.num_kv_heads}x{self.spec.head_dim}")
        if chunk.dtype not in DTYPE_ITEMSIZE:
            raise RequestError(f"request {rid!r}: unknown KV dtype {chunk.dtype!r}")
        if not 0 <= chunk.layer_start < chunk.layer_end <= self.spec.num_layers:
            raise RequestError(f"request {rid!r}: layers [{chunk.layer_start}, {chunk.layer_end}) "
                               f"outside [0, {self.spec.num_layers})")
        if not 0 <= chunk.token_start < chunk.token_end <= seq.num_prompt:
            raise RequestError(f"request {rid!r}: tokens [{chunk.token_start}, {chunk.token_end}) "
                               f"outside the prompt [0, {seq.num_prompt})")
        if len(chunk.data) != chunk.payload_nbytes:
            raise RequestError(f"request {rid!r}: KV payload is {len(chunk.data)} bytes, "
                               f"expected {chunk.payload_nbytes}")
        self._check_chunk_data(chunk)
        # Tokens from this engine's prefix cache live in shared blocks: never overwrite them.
        start = max(chunk.token_start, seq.num_cached_tokens)
        if start >= chunk.token_end:
            return
        self._import(seq, chunk, start)
        if chunk.layer_end == self.spec.num_layers:
            # A token counts as arrived once its last layer has (chunks of a range come in layer order).
            seq.imported[start : chunk.token_end] = b"\x01" * (chunk.token_end - start)

    def finish_import(self, request_id: str) -> None:
        seq = self._get(request_id)
        if seq.status != SeqStatus.IMPORTING:
            raise RequestError(f"request {request_id!r} is {seq.status.name}, not importing")
        missing = seq.imported.find(0, seq.num_cached_tokens)
        if missing != -1:
            raise RequestError(f"request {request_id!r}: KV of prompt token {missing} never arrived")
        seq.num_computed = seq.num_prompt
        seq.imported = None
        seq.status = SeqStatus.RUNNING
        self.scheduler.running.append(seq)
        self._publish(seq)

    # ---- contract: step ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._events = self._events, []
        chunks = self.scheduler.schedule()
        if not chunks:
            return outputs
        sampled = self._forward(chunks)
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            self._publish(seq)
            token = sampled.get(seq.request_id)
            position = seq.num_outputs
            if token is not None:
                seq.tokens.append(token)
            reason = self._finish_reason(seq, token)
            if token is None and seq.num_computed == seq.last_reported:
                continue
            seq.last_reported = seq.num_computed
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(RequestOutput(seq.request_id, () if token is None else (token,),
                                         position, seq.num_computed, reason is not None, reason))
        return outputs

    @staticmethod
    def _to_sample(chunk: Chunk) -> bool:
        """Does this chunk complete its sequence, so that its last logits are sampled?"""
        seq = chunk.seq
        return seq.num_computed + chunk.num_tokens == len(seq.tokens) and not seq.hold

    def _finish_reason(self, seq: Sequence, token: int | None):
        if token is None:
            return None
        sp = seq.sampling
        if token in sp.stop_token_ids or (token in self._eos and not sp.ignore_eos):
            return "stop"
        if seq.num_outputs >= sp.max_tokens or len(seq.tokens) >= self._max_model_len:
            return "length"
        return None

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
        hashes = seq.block_hashes(full, bs)
        for b in range(seq.num_published, full):
            self.blocks.publish(seq.block_ids[b], hashes[b])
        seq.num_published = full

    # ---- contract: introspection ----------------------------------------------------
    def stats(self) -> EngineStats:
        statuses = [s.status for s in self.seqs.values()]
        return EngineStats(
            num_blocks=self.blocks.num_blocks, free_blocks=self.blocks.num_free,
            cached_blocks=self.blocks.num_cached, used_blocks=self.blocks.num_used,
            running=statuses.count(SeqStatus.RUNNING), waiting=statuses.count(SeqStatus.WAITING),
            importing=statuses.count(SeqStatus.IMPORTING), retained=statuses.count(SeqStatus.RETAINED),
            pins=self.blocks.num_pins, prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            prefix_query_tokens=self.scheduler.prefix_query_tokens,
            preemptions=self.scheduler.num_preemptions)

    def check_integrity(self) -> None:
        self.blocks.check_integrity(s.block_ids for s in self.seqs.values())
