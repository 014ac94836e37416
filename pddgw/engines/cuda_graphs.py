"""CUDA graphs for the torch engine's decode steps.

A small model's decode step is bound by kernel launches, not math; a graph
replays one whole forward's launches with one call.  A graph replays fixed
addresses, shapes and launch grids, so every input lives in a static buffer
(`StaticDecodeInputs`) and the batch is padded to a bucket size
(`bucket_sizes`: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs).

Contract of `CudaGraphRunner` (one per engine, `engine.cuda_graphs = true`):
  * `capture()` records one graph per bucket, largest first, in one memory
    pool, after eager warm-ups; padding rows have slot -1 (no KV write) and
    seq_len 1.
  * It is called exactly like the model.  A decode-only batch that fits the
    largest bucket and the table width replays the smallest bucket >= B;
    anything else runs the model eagerly (always correct, only slower).
  * The KV pool, weights and static buffers must never be reallocated while
    the graphs live; the returned logits are a view valid until the next replay.

Replayable because the forward reads nothing back from the device, and the
Triton launch plan (`triton_ops.plan_attention`) depends on shapes only, the
table width fixed at `max_blocks`.  The torch reference backend is not
replayable (a boolean-mask KV store): the runner is then not built.
`graphs=False` records plain callables over the same buffers, for CPU tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from pddgw.engines.attention import AttnMetadata

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def bucket_sizes(max_num_seqs: int, largest: int = 512) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8 up to 64, every
    multiple of 16 up to 256, of 32 beyond, capped at min(max_num_seqs, largest), which is
    always included."""
    top = min(max_num_seqs, largest)
    if top < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(288, largest + 1, 32))
    return tuple(sorted({s for s in sizes if s < top} | {top}))


def pick_bucket(buckets: Sequence[int], batch: int) -> int | None:
    """The smallest bucket >= batch (buckets ascending), or None when the batch is larger."""
    for b in buckets:
        if b >= batch:
            return b
    return None


class StaticDecodeInputs:
    """Static input buffers of a decode forward for up to `rows` sequences.

    `fill` writes one step's decode inputs into rows [0, B) and makes rows
    [B, bucket) padding; the `AttnMetadata` / tensors of a bucket are views
    of the same buffers for every step (what a graph captured).

    Table entries past a sequence's blocks keep whatever an earlier step left
    there: the attention kernels read only keys below seq_lens, so those
    entries are never dereferenced.
    """

    PAD_SLOT = -1          # store_kv skips it
    PAD_SEQ_LEN = 1        # one (ignored) key: the cheapest valid attention row

    def __init__(self, rows: int, max_blocks: int, device: torch.device, ops: ModuleType):
        self.rows, self.max_blocks, self.device, self.ops = rows, max_blocks, device, ops
        dev = device
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)                 # [R]
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)                 # [R]
        self.slot_mapping = torch.full((rows,), self.PAD_SLOT, dtype=torch.int64, device=dev)   # [R]
        self.block_tables = torch.zeros((rows, max_blocks), dtype=torch.int32, device=dev)    # [R, MB]
        self.seq_lens = torch.full((rows,), self.PAD_SEQ_LEN, dtype=torch.int32, device=dev)  # [R]
        self.cu_q_lens = torch.arange(rows + 1, dtype=torch.int32, device=dev)            # [R+1]
        self.rows_all = torch.arange(rows, dtype=torch.int64, device=dev)                 # [R]

    def meta(self, bucket: int) -> AttnMetadata:
        """The decode metadata of the first `bucket` rows (views of the static buffers)."""
        return AttnMetadata(slot_mapping=self.slot_mapping[:bucket],
                            block_tables=self.block_tables[:bucket],
                            cu_q_lens=self.cu_q_lens[: bucket + 1],
                            seq_lens=self.seq_lens[:bucket], is_decode=True, ops=self.ops)

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding rows: no KV write, one key read."""
        if end > start:
            self.slot_mapping[start:end].fill_(self.PAD_SLOT)
            self.seq_lens[start:end].fill_(self.PAD_SEQ_LEN)

    def fits(self, input_ids: torch.Tensor, meta: AttnMetadata) -> bool:
        """Whether a step's decode inputs fit these buffers."""
        b = input_ids.shape[0]
        return (meta.is_decode and 1 <= b <= self.rows and meta.seq_lens.shape[0] == b
                and meta.block_tables.shape[1] <= self.max_blocks)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
             bucket: int) -> None:
        """Rows [0, B) <- the step's inputs (B = len(input_ids) <= bucket), rows [B, bucket) padding."""
        b, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        self.pad(b, bucket)


class CudaGraphRunner:
    """The model's decode forwards as replayed graphs (see the module docstring).

    Called like the model: `runner(input_ids, positions, meta, kv_caches, logits_indices)`
    -> logits [S, vocab].  `graphs=False` records plain callables instead of CUDA graphs
    (any device; for tests of everything around the replay).
    """

    def __init__(self, model: Callable[..., torch.Tensor], kv_caches: KVCaches, ops: ModuleType,
                 *, max_num_seqs: int, max_blocks: int, device: torch.device,
                 buckets: Sequence[int] | None = None, graphs: bool = True, warmup: int = 2):
        if graphs and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.ops = ops
        self.device = torch.device(device)
        self.buckets = tuple(sorted(buckets)) if buckets else bucket_sizes(max_num_seqs)
        self.graphs = graphs
        self.warmup = warmup
        self.static = StaticDecodeInputs(self.buckets[-1], max_blocks, self.device, ops)
        self._replay: dict[int, Callable[[], None]] = {}
        self._out: dict[int, torch.Tensor] = {}       # bucket -> static logits [bucket, vocab]
        self._pool = None
        # Counters (tests and benchmarks): steps replayed, steps run eagerly.
        self.num_replayed = self.num_eager = 0

    # ---- start ---------------------------------------------------------------------
    def _forward(self, bucket: int) -> torch.Tensor:
        st = self.static
        with torch.inference_mode():
            return self.model(st.input_ids[:bucket], st.positions[:bucket], st.meta(bucket),
                              self.kv_caches, st.rows_all[:bucket])              # [bucket, vocab]

    def capture(self) -> None:
        """Record every bucket's forward, largest first (their memory comes from one pool)."""
        self.static.pad(0, self.static.rows)
        if not self.graphs:
            for b in reversed(self.buckets):
                self._record_eager(b)
            return
        dev = self.device
        torch.cuda.synchronize(dev)
        side = torch.cuda.Stream(dev)
        for b in reversed(self.buckets):
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self._forward(b)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(b)
            if self._pool is None:
                self._pool = graph.pool()
            self._replay[b], self._out[b] = graph.replay, out
        torch.cuda.synchronize(dev)

    def _record_eager(self, bucket: int) -> None:
        """The forward over the static buffers as a callable (no graph): same inputs and outputs."""
        out = self._forward(bucket)

        def replay() -> None:
            new = self._forward(bucket)
            with torch.inference_mode():
                out.copy_(new)
        self._replay[bucket], self._out[bucket] = replay, out

    # ---- steps ---------------------------------------------------------------------
    def bucket_for(self, input_ids: torch.Tensor, meta: AttnMetadata,
                   kv_caches: KVCaches) -> int | None:
        """The bucket that replays this step, or None for the eager path."""
        if meta.ops is not self.ops or not kv_caches or kv_caches[0][0] is not self.kv_caches[0][0]:
            return None
        if not self.static.fits(input_ids, meta):
            return None
        return pick_bucket(self.buckets, input_ids.shape[0])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                 kv_caches: KVCaches, logits_indices: torch.Tensor) -> torch.Tensor:
        bucket = self.bucket_for(input_ids, meta, kv_caches)
        if bucket is None or bucket not in self._replay:
            self.num_eager += 1
            return self.model(input_ids, positions, meta, kv_caches, logits_indices)
        b = input_ids.shape[0]
        self.static.fill(input_ids, positions, meta, bucket)
        self._replay[bucket]()
        self.num_replayed += 1
        out = self._out[bucket]                                         # [bucket, vocab]
        # Distinct rows below B, as many as B: all of them, in order (the decode norm).
        if logits_indices.shape[0] == b:
            return out[:b]
        return out.index_select(0, logits_indices)                      # [S, vocab]
