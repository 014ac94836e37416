"""The torch engine: a Llama-family model over the paged KV pool.

One `step` = schedule -> pack the chunks into one batch -> one forward ->
sample the fully computed sequences -> publish full blocks -> finish what
stopped.  The bookkeeping is `PagedEngine`'s; this module is the model math
and the KV pool.  See `Engine` for the contract.

Logprobs are computed on the logits' device for only the rows that asked,
from the raw logits (vLLM's raw_logprobs), and cross to the host in one
transfer with the sampled ids.  Prompt logprobs: the positions that score a
prompt token (`PagedEngine._prompt_rows`) get logits rows after the sampled
ones in the same forward, at most max_num_batched_tokens of them.
"""

from __future__ import annotations

import torch

from pddgw.config import Config, ConfigError, EngineConfig
from pddgw.engines.base import check_export_buffer, register_engine
from pddgw.engines.dtypes import model_dtype
from pddgw.engines.grammar import Grammars
from pddgw.engines.kv_pool import DTYPE_NAMES, DTYPES, KVPool, buffer_to_tensor, tensor_to_buffer
from pddgw.engines.paged import PagedEngine, Sampled
from pddgw.engines.penalties import adjust_logits
from pddgw.engines.sampler import logprobs, sample, sample_ids
from pddgw.engines.scheduler import Chunk
from pddgw.engines.sequence import Sequence
from pddgw.engines.step_inputs import IncrementalInputs, ListInputs
from pddgw.engines.tokenizer import Tokenizer
from pddgw.engines.types import LOGPROB_FLOOR, KVChunk, RequestError, SamplingParams, TokenLogprobs
from pddgw.engines.weights import SharedModels, load_model
from pddgw.kernels import get_ops


@register_engine("torch")
class TorchEngine(PagedEngine):
    scores_prompts = True

    def __init__(self, model: torch.nn.Module, spec, cfg: EngineConfig, dtype: torch.dtype,
                 max_model_len: int = 0, tokenizer: Tokenizer | None = None):
        """`tokenizer`: the model's, for grammar-constrained sampling (None: requests with a
        grammar are refused)."""
        if cfg.num_blocks < 1:
            raise ConfigError("engine.num_blocks: the torch engine needs a pool size (> 0)")
        super().__init__(spec, cfg, DTYPE_NAMES[dtype], cfg.num_blocks, max_model_len)
        if tokenizer is not None:
            self.grammars = Grammars(tokenizer, spec.vocab_size, spec.eos_token_ids)
        self.model = model
        self.device = torch.device(cfg.device)
        self.threads = cfg.cpu_threads if self.device.type == "cpu" else 0
        # One OpenMP team a process: engines stepping on several threads take turns on one
        # (engines/compute_thread.py); a one-thread engine opens no team and keeps its own.
        self.shares_compute_thread = self.device.type == "cpu" and self.threads != 1
        # CPU: prepacked GEMM weights (model.py: AMX tiles or oneDNN); a no-op elsewhere and for float64.
        if self.device.type == "cpu" and hasattr(model, "prepack"):
            model.prepack()
        self.ops = get_ops(cfg.attention_backend, cfg.device)
        self.pool = KVPool(spec.num_layers, cfg.num_blocks, cfg.block_size, spec.num_kv_heads,
                           spec.head_dim, dtype, cfg.device)
        # Step inputs: decode batches from persistent device tensors (step_inputs.py).
        bs = cfg.block_size
        max_blocks = min(cfg.num_blocks, -(-self.max_model_len // bs))   # widest block table
        self.inputs: IncrementalInputs | ListInputs = IncrementalInputs(
            bs, self.device, self.ops, self._to_sample, max_rows=cfg.max_num_seqs,
            max_blocks=max_blocks)
        # CUDA graphs (cuda_graphs.py): decode steps replay graphs captured here; `self.model`
        # becomes the runner, called like the model, which runs anything else eagerly.
        self.graphs = None
        if cfg.cuda_graphs and self.device.type == "cuda":
            from pddgw.engines.cuda_graphs import CudaGraphRunner
            from pddgw.kernels import reference

            if self.ops is reference:
                import structlog

                structlog.get_logger(__name__).warning(
                    "engine.cuda_graphs: the torch attention backend cannot be captured; "
                    "decode steps run eagerly (use attention_backend = \"triton\")")
            else:
                self.graphs = CudaGraphRunner(model, self.pool.caches, self.ops,
                                              max_num_seqs=cfg.max_num_seqs, max_blocks=max_blocks,
                                              device=self.device)
                self.graphs.capture()
                self.model = self.graphs

    @classmethod
    def from_config(cls, config: Config, engine: EngineConfig | None = None,
                    models: SharedModels | None = None) -> tuple[TorchEngine, Tokenizer]:
        """Load the configured model (from `models` when given: shared with the process's other
        engines); `engine` overrides config.engine (per-node settings)."""
        ecfg = engine or config.engine
        if config.model.profile:
            raise ConfigError(f"model.profile = {config.model.profile!r} has no weights: the torch engine "
                              "needs model.path (or nothing, for the built-in tiny model)")
        if ecfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"engine.device = {ecfg.device!r}, but this torch build sees no CUDA device "
                              "(set device = \"cpu\")")
        dtype = DTYPES[model_dtype(config.model)]
        model, tokenizer = (models.load if models is not None else load_model)(
            config.model.path or None, dtype, ecfg.device, config.model.tiny_seed)
        return cls(model, model.spec, ecfg, dtype, config.model.max_model_len, tokenizer), tokenizer

    # ---- KV data ------------------------------------------------------------------
    def _export(self, seq: Sequence, token_start: int, token_end: int, layer_start: int,
                layer_end: int) -> KVChunk:
        data = self.pool.read(seq.block_ids, token_start, token_end, layer_start, layer_end)  # [L, 2, n, kvh, hd]
        return KVChunk(self._layout.span(seq.request_id, (token_start, token_end), (layer_start, layer_end)),
                       tensor_to_buffer(data))

    def export_kv_into(self, request_id: str, token_start: int, token_end: int, into: memoryview) -> KVChunk:
        """Gathered from the pool straight into `into`: the one copy of an in-process transfer."""
        seq = self._get(request_id)
        layer_end = self._check_export(request_id, token_start, token_end, seq.num_computed, 0, None)
        span = self._layout.span(seq.request_id, (token_start, token_end), (0, layer_end))
        check_export_buffer(into, span)
        self.pool.read(seq.block_ids, token_start, token_end, 0, layer_end,
                       out=buffer_to_tensor(into, span.dtype, span.shape))          # [L, 2, n, kvh, hd]
        return KVChunk(span, into)

    def _check_chunk_data(self, chunk: KVChunk) -> None:
        if chunk.virtual:
            raise RequestError(f"request {chunk.request_id!r}: a virtual KV chunk (sized, no data, "
                               "from a cost-model engine) cannot fill a real KV pool")

    def _block_array(self, block_id: int):
        return self.pool.block_array(block_id)

    def _staging_array(self, nbytes: int):
        return self.pool.staging_array(nbytes)

    def _import(self, seq: Sequence, chunk: KVChunk, start: int) -> None:
        data = buffer_to_tensor(chunk.payload, chunk.dtype, chunk.shape)   # [L, 2, n, kvh, hd], no copy
        # The one copy of a payload that did not land in place: into the pool's pages (with a
        # dtype conversion if the sender's differs; host -> device on a GPU).
        self.pool.write(seq.block_ids, start, data[:, :, start - chunk.token_start :], chunk.layer_start)

    # ---- the forward ------------------------------------------------------------------
    def _forward(self, chunks: list[Chunk]) -> dict[str, Sampled]:
        """Pack the chunks, run the model, sample the sequences that are complete."""
        if self.threads and torch.get_num_threads() != self.threads:
            # OpenMP's thread count is the calling thread's: engines of one process keep theirs.
            torch.set_num_threads(self.threads)
        inputs = self.inputs.build(chunks)
        to_sample = inputs.to_sample
        rows, targets, owners = self._scoring_rows(chunks)
        logits_rows = inputs.logits_rows
        if rows:
            logits_rows = torch.cat([logits_rows, torch.tensor(rows, dtype=torch.int64, device=self.device)])
        with torch.inference_mode():
            logits = self.model(inputs.input_ids, inputs.positions, inputs.meta,
                                self.pool.caches, logits_rows)                   # [S + P, vocab]
        if rows:
            s = len(to_sample)
            self._score_prompts(logits[s:], targets, owners)
            logits = logits[:s]
        if not to_sample:
            return {}
        seqs = [chunks[i].seq for i in to_sample]
        params = [s.sampling for s in seqs]
        positions = [s.num_outputs for s in seqs]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Penalties, logit_bias, min_tokens, grammars: on the rows that ask, in place unless the raw
        # logits are still needed for logprobs (no [S, vocab] copy per step; an inference tensor
        # changes only in inference mode).
        with torch.inference_mode():
            drawn = adjust_logits(logits, params, positions, seqs, self._eos,
                                  [s.constraint for s in seqs], inplace=not want)    # [S, vocab]
        if want:
            return _sample_with_logprobs(logits, drawn, seqs, params, positions, want)
        # On the logits' device; only the S sampled ids cross to the host.
        tokens = sample(drawn, params, positions)
        return {s.request_id: (t, None) for s, t in zip(seqs, tokens)}

    def _scoring_rows(self, chunks: list[Chunk]) -> tuple[list[int], list[int], list[tuple[str, int, int]]]:
        """Packed rows whose logits score a prompt token, that token, and per request
        (id, first prompt slot, rows): rows follow the packing (chunks in order, each chunk's
        tokens contiguous), as both input builders lay them out."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[str, int, int]] = []
        if not self._scoring:
            return rows, targets, owners
        offset = 0
        for c in chunks:
            span = self._prompt_rows(c)
            if span:
                seq, start = c.seq, c.seq.num_computed
                rows += range(offset + span.start - start, offset + span.stop - start)
                targets += seq.tokens[span.start + 1 : span.stop + 1]
                owners.append((seq.request_id, span.start, len(span)))
            offset += c.num_tokens
        return rows, targets, owners

    def _score_prompts(self, logits: torch.Tensor, targets: list[int], owners: list[tuple[str, int, int]]) -> None:
        """logits [P, vocab] of the scored rows -> their `TokenLogprobs` into `_scoring`."""
        k = min(max(self.seqs[rid].sampling.prompt_logprobs or 0 for rid, _, _ in owners), logits.shape[1])
        ids = torch.tensor(targets, dtype=torch.int64, device=logits.device)
        chosen, top_ids, top_lp = logprobs(logits, ids, k, dtype=None)                 # [P], [P, k], [P, k]
        f64 = torch.float64
        host = torch.cat([chosen.to(f64), top_ids.to(f64).flatten(),
                          top_lp.to(f64).flatten()]).clamp_min(LOGPROB_FLOOR).tolist()
        n = len(targets)
        chosen_h, ids_h, lp_h = host[:n], host[n : n + n * k], host[n + n * k :]
        row = 0
        for rid, first, count in owners:
            ki = min(self.seqs[rid].sampling.prompt_logprobs or 0, k)
            slots = self._scoring[rid]
            for j in range(count):
                r = row + j
                slots[first + j] = TokenLogprobs(chosen_h[r], tuple(int(t) for t in ids_h[r * k : r * k + ki]),
                                                 tuple(lp_h[r * k : r * k + ki]))
            row += count


def _sample_with_logprobs(logits: torch.Tensor, drawn: torch.Tensor, seqs: list[Sequence],
                          params: list[SamplingParams], positions: list[int], want: list[int]) -> dict[str, Sampled]:
    """Sample every row from `drawn` (the adjusted logits); the logprobs of the rows in `want`
    (those that asked) from the raw `logits`, on their device.  One transfer to the host: the S
    ids, and [R] + [R, k] + [R, k] values (k the largest number of alternatives asked for; each
    row keeps its own first k_i)."""
    n = len(seqs)
    ids = sample_ids(drawn, params, positions)                                           # int64 [S]
    k = max(params[i].logprobs or 0 for i in want)
    index = None if len(want) == n else torch.tensor(want, dtype=torch.int64, device=logits.device)
    x = logits if index is None else logits.index_select(0, index)                      # [R, vocab]
    y = ids if index is None else ids.index_select(0, index)                            # [R]
    chosen, top_ids, top_lp = logprobs(x, y, k)                                          # [R], [R, k], [R, k]
    k = top_ids.shape[1]                      # (fewer when the vocabulary is smaller)
    f64 = torch.float64
    host = torch.cat([ids.to(f64), chosen.to(f64).clamp_min(LOGPROB_FLOOR),            # ids < 2**53: exact
                      top_ids.to(f64).flatten(), top_lp.to(f64).clamp_min(LOGPROB_FLOOR).flatten()]).tolist()
    r = len(want)
    tokens = [int(t) for t in host[:n]]
    chosen_h, ids_h, lp_h = host[n : n + r], host[n + r : n + r + r * k], host[n + r + r * k :]
    out: dict[str, Sampled] = {s.request_id: (t, None) for s, t in zip(seqs, tokens)}
    for j, i in enumerate(want):
        ki = min(params[i].logprobs or 0, k)
        row = slice(j * k, j * k + ki)
        out[seqs[i].request_id] = (tokens[i], TokenLogprobs(chosen_h[j], tuple(int(t) for t in ids_h[row]),
                                                            tuple(lp_h[row])))
    return out
