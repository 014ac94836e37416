"""pddgw's KV connector for vLLM (v1 KV-connector interface): KV that arrived
over pddgw's links goes into vLLM's paged cache before the forward needing it.

vLLM loads this module by path (`kv_connector_module_path`) and builds one
scheduler side per engine (which tokens are loaded instead of computed; it
reaches its engine through the `Bridge` registered under its `engine_id`)
and one worker side per process (which copies them into the paged cache).

A load, all on the engine thread inside `EngineCore.step`:
  1. the engine stages an import's KV in `Bridge.staged`, then adds the request;
  2. `get_num_new_matched_tokens`: staged tokens past vLLM's own prefix hit
     are external (never the last token: vLLM must compute one to sample);
     a staged range that no longer reaches the hit loads nothing (same KV,
     computed instead);
  3. `update_state_after_alloc` / `build_connector_meta` hand (blocks, token
     range, staged tensor) of this step's requests to the worker side;
  4. `start_load_kv` writes them into their slots, every layer.
A retained request's blocks are freed on `release`; exports read `Bridge.kv_caches`.

TP > 1: each worker process holds its rank's KV heads (vLLM's QKVParallelLinear
sharding) and learns its layout in `register_kv_caches`.  Imports are staged
in shared memory and only the file's name crosses vLLM's message queue
(`StagedKV.__reduce__`); exports are a `collective_rpc` of `read_kv`, in
chunks since those bytes do cross the queue.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)


# Where staged imports live for TP > 1: memory every worker process can map by name.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(slots=True, weakref_slot=True)
class StagedKV:
    """An import's KV, waiting to be loaded: tokens [token_start, token_start + n) of every layer.

    In private memory (TP = 1: vLLM's worker shares the engine's process), or in a file in
    shared memory (`in_shared_memory`, TP > 1), which the staging owns: the file is removed
    when the staging is dropped.  Pickled (vLLM sends each step's metadata to its worker
    processes), a shared staging is its file's name, and unpickles as a read-only mapping.
    """

    token_start: int
    data: torch.Tensor          # [layers, 2, n, kv_heads, head_dim], the cache's dtype, on its device
    path: str | None = None     # the shared-memory file behind `data`

    @classmethod
    def in_shared_memory(cls, token_start: int, shape: tuple[int, ...], dtype: torch.dtype,
                         name: str) -> StagedKV:
        numel = math.prod(shape)
        if numel == 0:
            return cls(token_start, torch.empty(shape, dtype=dtype))      # nothing to load, ever
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, numel * dtype.itemsize)
            data = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        staged = cls(token_start, data, path)
        weakref.finalize(staged, _unlink, path)
        return staged

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.path is None:
            raise TypeError("pddgw KV connector: staged KV in private memory cannot cross to vLLM's "
                            "worker processes (TP > 1 stages in shared memory)")
        return _attach, (self.token_start, self.path, tuple(self.data.shape),
                         str(self.data.dtype).removeprefix("torch."))


def _attach(token_start: int, path: str, shape: tuple[int, ...], dtype: str) -> StagedKV:
    """A worker's read-only view of a shared staging (the engine's process owns the file)."""
    data = torch.from_file(path, shared=False, size=math.prod(shape), dtype=getattr(torch, dtype)).view(shape)
    return StagedKV(token_start, data)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def staged_files(engine_id: str) -> list[str]:
    """The shared-memory stagings of an engine (named `{engine_id}-...`) that exist now."""
    prefix = f"{engine_id}-"
    return sorted(os.path.join(SHM_DIR, f) for f in os.listdir(SHM_DIR) if f.startswith(prefix))


def remove_staged(engine_id: str) -> None:
    for path in staged_files(engine_id):
        _unlink(path)


@dataclass(slots=True)
class _Load:
    block_ids: list[int]
    token_start: int            # first token to write
    token_end: int
    staged: StagedKV


@dataclass
class Bridge:
    """What one VllmEngine shares with its connector's scheduler side (same process, one thread),
    and with its worker side when that runs in this process too (TP = 1)."""

    block_size: int
    kv_caches: list[torch.Tensor] = field(default_factory=list)        # per layer, set by the engine
    layout: BlockLayout | None = None                                  # set by the engine
    staged: dict[str, StagedKV] = field(default_factory=dict)          # vLLM request id ->
    retained: set[str] = field(default_factory=set)                    # free on release only
    loaded_tokens: int = 0                                             # handed to the workers
    _load_end: dict[str, int] = field(default_factory=dict)                       # offered, not yet allocated
    _allocated: dict[str, tuple[list[int], int, int]] = field(default_factory=dict)  # blocks, start, end


_BRIDGES: dict[str, Bridge] = {}
_LOCK = threading.Lock()


def register_bridge(engine_id: str, bridge: Bridge) -> None:
    with _LOCK:
        if engine_id in _BRIDGES:
            raise ValueError(f"KV connector bridge {engine_id!r} registered twice")
        _BRIDGES[engine_id] = bridge


def drop_bridge(engine_id: str) -> None:
    with _LOCK:
        _BRIDGES.pop(engine_id, None)


def _bridge(engine_id: str) -> Bridge:
    with _LOCK:
        try:
            return _BRIDGES[engine_id]
        except KeyError:
            raise RuntimeError(f"pddgw KV connector: no engine registered as {engine_id!r} in this "
                               "process (the connector only runs inside pddgw's VllmEngine)") from None


class BlockLayout:
    """Where vLLM's attention backend keeps each K and V element inside one block, learned
    from the backend itself.

    No fixed shape describes every backend's block (the CPU backend packs keys in an
    ISA-specific order).  `learn` writes a probe through the backend's own cache-update op
    and records two int64 maps [block_size, kv_heads * head_dim] of offsets into
    `cache[block]`; reads and writes are then a gather / scatter per layer, bit-exact.  The
    cache's first dimension must be the block.
    """

    def __init__(self, k_off: torch.Tensor, v_off: torch.Tensor):
        self.k_off, self.v_off = k_off, v_off          # [block_size, kv_heads * head_dim], on the cache's device

    @classmethod
    def learn(cls, layer: Any, cache: torch.Tensor, block_size: int, kv_heads: int, head_dim: int,
              scratch_block: int) -> BlockLayout:
        dev = cache.device
        n = block_size * kv_heads * head_dim
        codes = torch.arange(n, dtype=torch.long, device=dev)
        slots = scratch_block * block_size + torch.arange(block_size, dtype=torch.long, device=dev)
        offsets = {}
        for kind in ("k", "v"):
            # Base-255 digits + 1: exact in every cache dtype (bf16 holds integers to 256), never 0.
            for scale in (1, 255):
                digit = (codes // scale % 255 + 1).to(cache.dtype).view(block_size, kv_heads, head_dim)
                zero = torch.zeros_like(digit)
                cache[scratch_block].zero_()
                key, value = (digit, zero) if kind == "k" else (zero, digit)
                layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
                row = cache[scratch_block].reshape(-1).to(torch.long)
                where = row.nonzero().squeeze(1)
                if where.numel() != n:
                    raise RuntimeError(f"vLLM's KV cache layout: the probe wrote {where.numel()} of {n} "
                                       f"{kind.upper()} elements of a block")
                offsets.setdefault(kind, {})[scale] = (where, row[where] - 1)
            # Each element's code = d0 + 255 * d1, its offset where both passes saw it.
            w0, d0 = offsets[kind][1]
            w1, d1 = offsets[kind][255]
            if not torch.equal(w0, w1):
                raise RuntimeError("vLLM's KV cache layout: the probe's two passes disagree")
            off = torch.empty(n, dtype=torch.long, device=dev)
            off[d0 + 255 * d1] = w0
            offsets[kind] = off.view(block_size, kv_heads * head_dim)
        cache[scratch_block].zero_()
        return cls(offsets["k"], offsets["v"])

    def write(self, caches: list[torch.Tensor], block_ids: list[int], block_size: int, start: int,
              data: torch.Tensor) -> None:
        """data [layers, 2, n, kv_heads, head_dim] -> tokens [start, start + n) of every layer."""
        n = data.shape[2]
        blocks, rows, k_idx, v_idx = self._index(caches[0].device, block_ids, block_size, start, start + n)
        for layer, cache in enumerate(caches):
            k = data[layer, 0].reshape(n, -1).to(cache.device, cache.dtype)
            v = data[layer, 1].reshape(n, -1).to(cache.device, cache.dtype)
            flat = _flat(cache)
            if flat is not None:
                flat[blocks[rows], k_idx] = k
                flat[blocks[rows], v_idx] = v
            else:
                whole = cache[blocks]                                  # [b, ...] gathered blocks
                view = whole.view(len(blocks), -1)
                view[rows, k_idx] = k
                view[rows, v_idx] = v
                cache[blocks] = whole

    def read(self, caches: list[torch.Tensor], block_ids: list[int], block_size: int, start: int, end: int,
             kv_heads: int, head_dim: int) -> torch.Tensor:
        """Tokens [start, end) of the given layers' caches -> [layers, 2, n, kv_heads, head_dim]."""
        n = end - start
        out = []
        blocks, rows, k_idx, v_idx = self._index(caches[0].device, block_ids, block_size, start, end)
        for cache in caches:
            flat = _flat(cache)
            # Rows of the whole pool, or of the gathered blocks.
            src, at = (flat, blocks[rows]) if flat is not None else (cache[blocks].reshape(len(blocks), -1), rows)
            out.append(torch.stack((src[at, k_idx], src[at, v_idx])).view(2, n, kv_heads, head_dim))
        return torch.stack(out)

    def _index(self, dev: torch.device, block_ids: list[int], block_size: int, start: int, end: int):
        """-> (the blocks touched [b], each token's row among them [n, 1], K and V offsets [n, kvh*hd]),
        the same for every layer (one engine's caches share a device)."""
        pos = torch.arange(start, end, device=dev)
        first, last = start // block_size, (end - 1) // block_size
        blocks = torch.tensor(block_ids[first : last + 1], dtype=torch.long, device=dev)
        rows = (pos // block_size - first).unsqueeze(1)
        offs = pos % block_size
        return blocks, rows, self.k_off[offs], self.v_off[offs]


def _flat(cache: torch.Tensor) -> torch.Tensor | None:
    """[num_blocks, elements] over the same memory, when every block is one contiguous run."""
    try:
        return cache.view(cache.shape[0], -1)
    except RuntimeError:
        return None


@dataclass(slots=True)
class _RankKV:
    """One tensor-parallel rank's paged caches and its share of the KV heads (TP > 1: in a
    vLLM worker process, which serves one engine)."""

    caches: list[torch.Tensor]      # per layer, in layer order
    layout: BlockLayout
    block_size: int
    heads: slice                    # its KV heads among the model's
    head_dim: int
    answers: bool                   # the first replica of its heads: it answers exports


_RANK: _RankKV | None = None


def _learn_rank(vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> _RankKV:
    """This worker's caches in layer order, its heads, and how its backend packs a block."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.models.utils import extract_layer_index

    rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    total = vllm_config.model_config.get_total_num_kv_heads()
    names = sorted(kv_caches, key=extract_layer_index)
    layer = vllm_config.compilation_config.static_forward_context[names[0]]
    local = layer.num_kv_heads                          # max(1, total // tp)
    first = rank * total // tp                          # vLLM's QKVParallelLinear: rank // replicas
    if local != max(1, total // tp):
        raise RuntimeError(f"pddgw KV connector: rank {rank} of {tp} holds {local} of {total} KV heads, "
                           f"expected {max(1, total // tp)}")
    block_size = vllm_config.cache_config.block_size
    layout = BlockLayout.learn(layer, kv_caches[names[0]], block_size, local, layer.head_size, scratch_block=1)
    replicas = max(1, tp // total)
    return _RankKV([kv_caches[n] for n in names], layout, block_size, slice(first, first + local),
                   layer.head_size, rank % replicas == 0)


def read_kv(worker: Any, block_ids: list[int], start: int, end: int, layer_start: int,
            layer_end: int) -> torch.Tensor | None:
    """`collective_rpc` target (TP > 1): this rank's heads of tokens [start, end) of the given
    layers -> [layers, 2, n, its kv heads, head_dim]; None from a rank whose heads an earlier
    replica answers."""
    rank = _RANK
    if rank is None:
        raise RuntimeError("pddgw KV connector: this vLLM worker registered no KV caches")
    if not rank.answers:
        return None
    return rank.layout.read(rank.caches[layer_start:layer_end], block_ids, rank.block_size, start, end,
                            rank.heads.stop - rank.heads.start, rank.head_dim)


class PddgwConnectorMetadata(KVConnectorMetadata):
    """One step's loads.  TP = 1: with the engine's bridge (same process).  TP > 1: without
    (pickled to every worker; each load's staging travels as its shared-memory file's name)."""

    def __init__(self, bridge: Bridge | None, loads: list[_Load]):
        self.bridge = bridge
        self.loads = loads


class PddgwConnector(KVConnectorBase_V1):
    """Both sides of the connector; which one by `role` (module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._b = _bridge(vllm_config.kv_transfer_config.engine_id) if role == KVConnectorRole.SCHEDULER \
            else None
        self._tp = vllm_config.parallel_config.world_size > 1   # workers in their own processes

    # ---- worker side (one per process: TP = 1 every engine's, TP > 1 its rank's) --------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        global _RANK
        if self._tp:
            _RANK = _learn_rank(self._vllm_config, kv_caches)
        # TP = 1: each engine hands its caches to its Bridge (metadata carries them)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddgwConnectorMetadata)
        b, rank = meta.bridge, _RANK
        for load in meta.loads:
            s = load.staged
            part = s.data[:, :, load.token_start - s.token_start : load.token_end - s.token_start]
            if b is not None:
                b.layout.write(b.kv_caches, load.block_ids, b.block_size, load.token_start, part)
            else:
                assert rank is not None, "pddgw KV connector: a load before register_kv_caches"
                rank.layout.write(rank.caches, load.block_ids, rank.block_size, load.token_start,
                                  part[:, :, :, rank.heads])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return                  # export reads the paged cache after the step

    def wait_for_save(self) -> None:
        return

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        staged = self._b.staged.get(request.request_id)
        if staged is None or staged.token_start > num_computed_tokens:
            return 0, False
        end = min(staged.token_start + staged.data.shape[2], request.num_tokens - 1)
        self._b._load_end[request.request_id] = end
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        end = self._b._load_end.pop(request.request_id, None)
        if num_external_tokens <= 0 or end is None:
            return
        # The external tokens are the ones just before `end` (the scheduler may have taken
        # fewer local ones than it offered, never a different end).
        self._b._allocated[request.request_id] = (list(blocks.get_block_ids()[0]),
                                                  end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        loads = []
        for rid, (block_ids, start, end) in self._b._allocated.items():
            staged = self._b.staged.pop(rid, None)
            if staged is not None and end > start:
                loads.append(_Load(block_ids, start, end, staged))
                self._b.loaded_tokens += end - start
        self._b._allocated.clear()
        return PddgwConnectorMetadata(None if self._tp else self._b, loads)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._b.staged.pop(request.request_id, None)
        self._b._allocated.pop(request.request_id, None)
        self._b._load_end.pop(request.request_id, None)
        return request.request_id in self._b.retained, None
