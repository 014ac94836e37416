"""The CPU attention backend: paged decode attention and the K/V store in C (`cpu_attention.c`),
bfloat16 prompt rows on AMX tiles (`cpu_prompt_attention.c`), other prompt rows from `reference`.

Why hand-written: torch has no paged attention on the CPU.  The reference decode path gathers
every sequence's pages into a padded copy and runs torch's fused SDPA over it (tuned for long
queries, not one token), so each layer reads the KV twice and writes it once; reading the
pages in place takes a bfloat16 SmolLM2 layer at batch 16 x 320 tokens from ~710 to ~360 us,
pages from memory (`python -m pddgw.bench.cpu_attention`).  Storing a step's new K/V rows is a
copy in C too: torch's `index_put_` into the pool's strided views took ~7 % of such a decode
step (two calls a layer, each forking OpenMP threads for a few rows).

Prompt rows: torch's SDPA runs one call per prompt and rounds like nothing else here; the AMX
kernel takes a bfloat16 prefill step's attention 2-3 x faster (`python -m pddgw.bench.prefill_ops`:
SmolLM2's 4 x 256 tokens ~1.6 -> ~0.8 ms a layer), reads every key from the pages, and gives a row
the same bits however its prompt was chunked (cpu_prompt_attention.c says how).

The libraries are built on first use (`cpu_build`); where no compiler builds them, and for
float64 or inputs they do not take, the calls go to `reference`.

Numerics: those of torch's CPU flash attention for 16-bit inputs (cpu_attention.c says how);
not bit-identical to the reference, but to itself on every CPU with the same features,
whatever the batch beside a sequence or the thread count (one thread per sequence).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pddgw.kernels import cpu_build, reference

__all__ = ["available", "extend_attention", "paged_decode_attention", "store_kv"]


_SOURCE = Path(__file__).with_name("cpu_attention.c")
_PROMPT_SOURCE = Path(__file__).with_name("cpu_prompt_attention.c")
_SYMBOLS = {torch.float32: "decode_f32", torch.float16: "decode_f16", torch.bfloat16: "decode_bf16"}
_STORE_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + \
    [ctypes.c_void_p] + [ctypes.c_int64] * 4
_ARGTYPES = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 2 + \
    [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]

_MAX_STACK = 1 << 20           # of the 8 MiB threads get by default (OpenMP's workers too)
_PACK_BYTES = 64 << 20         # the prompt kernel's packed keys per call (one sequence may need more)


def _bind() -> dict[torch.dtype | str, ctypes._CFuncPtr]:
    """The decode kernels by dtype, "store_kv" and "scratch_bytes"; {} where they cannot be built
    (logged)."""
    found: dict[torch.dtype | str, ctypes._CFuncPtr] = {}
    lib = cpu_build.load_or_log(_SOURCE, "the torch reference's decode attention")
    if lib is None:
        return found
    for dtype, name in _SYMBOLS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        found[dtype] = fn
    lib.store_kv.argtypes, lib.store_kv.restype = _STORE_ARGTYPES, ctypes.c_int
    found["store_kv"] = lib.store_kv
    lib.scratch_bytes.argtypes, lib.scratch_bytes.restype = [ctypes.c_int64] * 3, ctypes.c_int64
    found["scratch_bytes"] = lib.scratch_bytes
    return found


_load = cpu_build.Once(_bind)                 # built on first use, once per process


def _bind_prompt() -> ctypes._CFuncPtr | None:
    """The AMX prompt kernel where it builds and this process may use AMX tiles; None otherwise."""
    lib = cpu_build.load_or_log(_PROMPT_SOURCE, "the torch reference's prompt attention")
    if lib is None or lib.prompt_ready() != 1:
        return None
    fn = lib.prompt_attention_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + \
        [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + \
        [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_load_prompt = cpu_build.Once(_bind_prompt)


def available() -> bool:
    """Whether the C kernel builds and loads on this machine (builds it on first call)."""
    return bool(_load())


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """`reference.store_kv`'s contract (k, v [T, kv_heads, head_dim] into the caches at flat slots
    [T], -1 skipped), copied by C where it takes the inputs: the rows in the caches' dtype, each
    row's heads packed (any row stride), the caches' rows packed alike, int64 slots."""
    fn = _load().get("store_kv")
    if (fn is None or not _caches_take(k, k_cache, v_cache) or v.dtype != k.dtype
            or k.stride()[1:] != v.stride()[1:] or k.stride()[1:] != k_cache.stride()[2:]
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
        return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)
    nb, bs, kvh, d = k_cache.shape
    if fn(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
          k_cache.stride(0), nb, slot_mapping.data_ptr(), slot_mapping.shape[0], bs, kvh * d, k.element_size()):
        raise ValueError(f"store_kv: slot_mapping {slot_mapping.tolist()} names a block outside the pool "
                         f"({nb} blocks of {bs})")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """`reference.paged_decode_attention`'s contract, computed by the C kernel where it takes
    the inputs (q and the caches on the CPU in one of its dtypes, each cache row contiguous)."""
    fn = _kernel(q, k_cache, v_cache)
    if fn is None:
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    b, h, d = q.shape
    out = torch.empty_like(q)                                        # [B, H, D]
    if b == 0:
        return out
    q = q.contiguous()
    tables = block_tables.to(torch.int32)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    nb, bs, kvh, _ = k_cache.shape
    bad = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), nb,
             tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(), out.data_ptr(),
             b, h, kvh, d, bs, scale, torch.get_num_threads())
    if bad:
        raise ValueError(f"paged decode attention: seq_lens {lens.tolist()} or their block ids in "
                         f"block_tables are outside the table ({tables.shape[1]} blocks of {bs}) "
                         f"or the pool ({nb} blocks)")
    return out


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, generated: torch.Tensor | None = None,
                     new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`reference.extend_attention`'s contract, except that the last `generated[b]` rows of each
    sequence b (tokens it generated: a decode in a step that also prefills, tokens relayed
    before a handoff) go to the decode kernel, each as a sequence ending at its position.  A
    generated token's attention is then the same bits whether it was decoded alone, beside a
    prefill or extended with others (the invariants of DESIGN.md); the prompts' rows, a one-token
    chunk of a prompt too, go to `_prompts` (the AMX prompt kernel or the reference) as a prompt's
    rows always do."""
    if generated is None or _kernel(q, k_cache, v_cache) is None or not bool(generated.any()):
        return _prompts(q, k_cache, v_cache, block_tables, cu_q_lens, seq_lens, scale, new_kv)
    gen = generated.long()                                                        # [B]
    first = cu_q_lens[1:].long() - gen                                            # [B] first generated row
    owner = torch.repeat_interleave(torch.arange(gen.shape[0]), gen)              # [G] sequence of each
    rank = torch.arange(owner.shape[0]) - torch.repeat_interleave(torch.cumsum(gen, 0) - gen, gen)
    rows = first[owner] + rank                                                    # [G] their rows
    out = torch.empty_like(q)                                                     # [T, H, D]
    out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, block_tables[owner],
                                       (seq_lens.long()[owner] - gen[owner] + rank + 1).to(torch.int32), scale)
    prompt = (cu_q_lens[1:] - cu_q_lens[:-1]).long() - gen                        # [B] prompt rows
    some = prompt > 0
    if bool(some.any()):
        keep = torch.ones(q.shape[0], dtype=torch.bool)
        keep[rows] = False
        rest = keep.nonzero().flatten()                                           # the prompts' rows
        cu = torch.zeros(int(some.sum()) + 1, dtype=cu_q_lens.dtype)
        torch.cumsum(prompt[some], 0, out=cu[1:])
        out[rest] = _prompts(q[rest], k_cache, v_cache, block_tables[some], cu,
                             (seq_lens.long() - gen)[some].to(seq_lens.dtype), scale,
                             None if new_kv is None else (new_kv[0][rest], new_kv[1][rest]))
    return out


def _prompts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
             cu_q_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
             new_kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`reference.extend_attention` for prompts' rows, computed by the AMX prompt kernel where it
    takes them (bfloat16 on a CPU with AMX): every row, whole prompts and chunks alike, its keys
    read from the pages; the sequences in groups whose packed keys fit `_PACK_BYTES`."""
    fn = _load_prompt() if _prompt_kernel_takes(q, k_cache, v_cache) else None
    if fn is None:
        return reference.extend_attention(q, k_cache, v_cache, block_tables, cu_q_lens, seq_lens, scale,
                                          new_kv=new_kv)
    out = torch.empty_like(q)                                                     # [T, H, D]
    cu = cu_q_lens.to(torch.int64)
    starts, counts = cu[:-1].contiguous(), (cu[1:] - cu[:-1]).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int32)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    nb, bs, kvh, d = k_cache.shape
    dp = -(-d // 32) * 32                                                         # q.k's padded head_dim
    sizes = [-(-n // 32) * 32 * 2 * kvh * (dp + d) for n in lens.tolist()]        # packed K and V bytes
    first = 0
    while first < len(sizes):
        last, size = first + 1, sizes[first]
        while last < len(sizes) and size + sizes[last] <= _PACK_BYTES:
            size += sizes[last]
            last += 1
        bad = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), nb, bs,
                 tables[first:].data_ptr(), tables.stride(0), tables.shape[1], starts[first:].data_ptr(),
                 counts[first:].data_ptr(), lens[first:].data_ptr(), last - first, q.shape[1], kvh, d, scale,
                 out.data_ptr(), torch.get_num_threads())
        if bad:
            raise ValueError(f"prompt attention: seq_lens {seq_lens.tolist()}, cu_q_lens {cu_q_lens.tolist()} or "
                             f"their block ids are outside the table ({tables.shape[1]} blocks of {bs}) or the pool "
                             f"({nb} blocks)")
        first = last
    return out


def _prompt_kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """bfloat16 on the CPU (the caches too, rows packed alike), each row's heads packed, head_dim a
    multiple of 16 up to 128, whole groups of query heads."""
    d = q.shape[2]
    return (q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16 and q.device.type == "cpu"
            and k_cache.stride() == v_cache.stride() and _rows_contiguous(k_cache) and q.stride()[1:] == (d, 1)
            and d % 16 == 0 and d <= 128 and q.shape[1] % k_cache.shape[2] == 0)


def _kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The decode kernel for these inputs, or None where it does not take them (`_caches_take`),
    or where the per-sequence scratch would not fit comfortably on a thread's stack."""
    if not _caches_take(q, k_cache, v_cache) or _stack_bytes(*q.shape[1:], k_cache.shape[1]) > _MAX_STACK:
        return None
    return _load()[q.dtype]


def _caches_take(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C code takes x with these caches: built, all on the CPU in one of its dtypes,
    the caches' rows packed alike."""
    return (x.dtype in _load() and x.device.type == "cpu" and k_cache.dtype == x.dtype
            and v_cache.dtype == x.dtype and k_cache.stride() == v_cache.stride() and _rows_contiguous(k_cache))


@functools.lru_cache(maxsize=64)
def _stack_bytes(heads: int, head_dim: int, block_size: int) -> int:
    """The float32 scratch `sequence` in cpu_attention.c keeps on its stack (asked of the library,
    which sizes it)."""
    return _load()["scratch_bytes"](heads, head_dim, block_size)


def _rows_contiguous(cache: torch.Tensor) -> bool:
    """[num_blocks, block_size, kv_heads, head_dim] with each block's rows packed (any block stride)."""
    _, bs, kvh, d = cache.shape
    return cache.stride()[1:] == (kvh * d, d, 1)
