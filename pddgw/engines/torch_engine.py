"""The torch engine: a Llama-family model over the paged KV pool.

One `step` = schedule -> pack the chunks into one batch -> one forward ->
sample the sequences that are fully computed -> publish full blocks to the
prefix cache -> finish what stopped.  See `Engine` for the contract.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pddgw.config import Config, ConfigError, EngineConfig
from pddgw.engines.attention import AttnMetadata
from pddgw.engines.base import Engine, register_engine
from pddgw.engines.block_manager import BlockManager
from pddgw.engines.kv_pool import DTYPE_NAMES, DTYPES, KVPool, buffer_to_tensor, tensor_to_buffer
from pddgw.engines.sampler import sample
from pddgw.engines.scheduler import Chunk, Scheduler
from pddgw.engines.sequence import Sequence, SeqStatus
from pddgw.engines.tokenizer import Tokenizer
from pddgw.engines.types import (AddResult, CapacityError, EngineRequest, EngineStats, KVChunk,
                                 KVLayout, RequestError, RequestOutput)
from pddgw.engines.weights import load_model
from pddgw.kernels import get_ops


@register_engine("torch")
class TorchEngine(Engine):
    def __init__(self, model: torch.nn.Module, spec, cfg: EngineConfig, dtype: torch.dtype,
                 max_model_len: int = 0):
        self.model = model
        self.spec = spec
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.ops = get_ops(cfg.attention_backend, cfg.device)
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.pool = KVPool(spec.num_layers, cfg.num_blocks, cfg.block_size, spec.num_kv_heads,
                           spec.head_dim, dtype, cfg.device)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        limit = max_model_len or spec.max_position_embeddings
        # A sequence must fit in the pool on its own, or preemption could never make room.
        self._max_model_len = min(limit, spec.max_position_embeddings, cfg.num_blocks * cfg.block_size)
        self._layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, DTYPE_NAMES[dtype],
                                cfg.block_size)
        self._eos = frozenset(spec.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self._events: list[RequestOutput] = []   # outputs produced outside step (aborts)

    @classmethod
    def from_config(cls, config: Config, engine: EngineConfig | None = None) -> tuple["TorchEngine", Tokenizer]:
        """Load the configured model; `engine` overrides config.engine (per-node settings)."""
        ecfg = engine or config.engine
        if ecfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"engine.device = {ecfg.device!r}, but this torch build sees no CUDA device "
                              "(set device = \"cpu\")")
        if ecfg.device == "cpu" and ecfg.cpu_threads:
            torch.set_num_threads(ecfg.cpu_threads)
        dtype = DTYPES[config.model.dtype]
        model, tokenizer = load_model(config.model.path or None, dtype, ecfg.device,
                                      tiny_seed=config.model.tiny_seed)
        return cls(model, model.spec, ecfg, dtype, config.model.max_model_len), tokenizer

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
        bad = next((t for t in (*request.prompt_token_ids, *request.output_token_ids)
                    if not 0 <= t < vocab), None)
        if bad is not None:
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
        slots = self.pool.slots(seq.block_ids, token_start, token_end)
        data = self.pool.gather(slots, layer_start, layer_end)     # [L, 2, n, kvh, hd]
        return KVChunk(request_id, token_start, token_end, layer_start, layer_end,
                       self.spec.num_kv_heads, self.spec.head_dim, self._layout.dtype,
                       tensor_to_buffer(data))

    def import_kv(self, chunk: KVChunk) -> None:
        seq = self._get(chunk.request_id)
        rid = chunk.request_id
        if seq.status != SeqStatus.IMPORTING:
            raise RequestError(f"request {rid!r} is {seq.status.name}, not importing")
        if (chunk.num_kv_heads, chunk.head_dim) != (self.spec.num_kv_heads, self.spec.head_dim):
            raise RequestError(f"request {rid!r}: KV shape heads={chunk.num_kv_heads} "
                               f"head_dim={chunk.head_dim} does not match this model's "
                               f"{self.spec.num_kv_heads}x{self.spec.head_dim}")
        if chunk.dtype not in DTYPES:
            raise RequestError(f"request {rid!r}: unknown KV dtype {chunk.dtype!r}")
        if not 0 <= chunk.layer_start < chunk.layer_end <= self.spec.num_layers:
            raise RequestError(f"request {rid!r}: layers [{chunk.layer_start}, {chunk.layer_end}) "
                               f"outside [0, {self.spec.num_layers})")
        if not 0 <= chunk.token_start < chunk.token_end <= seq.num_prompt:
            raise RequestError(f"request {rid!r}: tokens [{chunk.token_start}, {chunk.token_end}) "
                               f"outside the prompt [0, {seq.num_prompt})")
        if len(chunk.data) != chunk.expected_nbytes():
            raise RequestError(f"request {rid!r}: KV payload is {len(chunk.data)} bytes, "
                               f"expected {chunk.expected_nbytes()}")
        data = buffer_to_tensor(chunk.data, chunk.dtype,
                                (chunk.layer_end - chunk.layer_start, 2, chunk.num_tokens,
                                 chunk.num_kv_heads, chunk.head_dim))
        # Tokens from this engine's prefix cache live in shared blocks: never overwrite them.
        start = max(chunk.token_start, seq.num_cached_tokens)
        if start >= chunk.token_end:
            return
        data = data[:, :, start - chunk.token_start :]
        self.pool.scatter(self.pool.slots(seq.block_ids, start, chunk.token_end).to(self.device),
                          data.to(self.device), chunk.layer_start)
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

    def _forward(self, chunks: list[Chunk]) -> dict[str, int]:
        """Pack the chunks, run the model, sample the sequences that are complete."""
        bs = self.blocks.block_size
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
            if end == len(seq.tokens) and not seq.hold:
                to_sample.append(i)
        width = max(len(t) for t in tables)
        dev = self.device
        table = torch.zeros((len(tables), width), dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        meta = AttnMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=table.to(dev),
            cu_q_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            is_decode=q_lens[-1] == len(chunks),
            ops=self.ops,
        )
        logits_rows = torch.tensor([q_lens[i + 1] - 1 for i in to_sample], dtype=torch.int64, device=dev)
        with torch.inference_mode():
            logits = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                                torch.tensor(pos, dtype=torch.int64, device=dev),
                                meta, self.pool.caches, logits_rows)            # [S, vocab]
        if not to_sample:
            return {}
        seqs = [chunks[i].seq for i in to_sample]
        tokens = sample(logits.cpu(), [s.sampling for s in seqs], [s.num_outputs for s in seqs])
        return {s.request_id: t for s, t in zip(seqs, tokens)}

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
