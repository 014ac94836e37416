"""Attention kernels on one GPU: pddgw's Triton kernels against torch SDPA, same data.

`python -m pddgw.bench.kernels [--quick] [--json] [--dtype D] [--peak-tbps P]`

One attention shape (default Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128, bf16,
16-token pages), pages a random permutation of the pool:
  1. decode  B sequences x L tokens, one query each: `paged_decode_attention`'s GB/s (K and V
             of every token once + q + out + block tables) and its share of the HBM peak.
  2. extend  k new tokens on a cached prefix P: `extend_attention`'s TFLOP/s, FLOPs =
             4 * H * D * sum over the k queries of the keys each sees.
  3. SDPA on the same values gathered into contiguous [B, KV heads, L, D] (not timed),
     causal mask aligned to the end: `speedup` = SDPA / Triton time, `max_err`.
Timings: triton.testing.do_bench (L2 flushed), median of the repeats.  Without a GPU the
benchmark says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from pddgw.tables import add_output_args, emit, format_table, ratio

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Vendor HBM peaks (bytes/s) by device-name substring; --peak-tbps overrides.
_PEAKS = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
# Skip decode points whose K/V (paged + the contiguous SDPA copy) would not fit comfortably.
_MAX_DECODE_TOKENS = 2 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class DecodePoint:
    batch: int
    context: int
    triton_us: float
    sdpa_us: float | None
    triton_gbps: float
    triton_peak_frac: float | None
    sdpa_gbps: float | None
    speedup: float | None
    max_err: float | None


@dataclass(frozen=True, slots=True)
class ExtendPoint:
    k: int
    prefix: int
    triton_us: float
    sdpa_us: float | None
    triton_tflops: float
    sdpa_tflops: float | None
    speedup: float | None
    max_err: float | None


P = TypeVar("P", DecodePoint, ExtendPoint)


@dataclass(frozen=True, slots=True)
class KernelReport:
    device: str
    dtype: str
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    peak_gbps: float | None
    decode: list[DecodePoint]
    extend: list[ExtendPoint]
    sdpa_note: str               # how SDPA handles GQA (torch >= 2.5: natively, enable_gqa)


@dataclass(frozen=True, slots=True)
class Skipped:
    skipped: str


@dataclass(frozen=True, slots=True)
class Sizes:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    ks: tuple[int, ...]
    prefixes: tuple[int, ...]


FULL = Sizes(batches=(1, 8, 32, 128), contexts=(1024, 4096, 16384, 65536), ks=(1, 16, 64, 512),
             prefixes=(4096, 16384, 65536))
QUICK = Sizes(batches=(1, 32), contexts=(4096, 32768), ks=(1, 16, 64, 512),
              prefixes=(4096, 32768))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """q [B, H, Tq, D], k/v [B, KVH, L, D] -> a closure computing [B, H, Tq, D], the Tq queries
    the last positions of the L (causal, aligned to the end)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2]) if q.shape[2] > 1 else None
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _bench_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def _paged(batch: int, seq_len: int, kv_heads: int, head_dim: int, block_size: int,
           dtype: torch.dtype, gen: torch.Generator, device: str):
    """Random paged K/V for `batch` sequences of `seq_len` tokens, pages shuffled.

    -> k_cache, v_cache [num_blocks, bs, KVH, D], block_tables [B, nblk] int32,
       and the same K/V contiguous [B, KVH, L, D] for SDPA.
    """
    nblk = -(-seq_len // block_size)
    num_blocks = batch * nblk
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch, nblk).to(torch.int32)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        pages = cache[tables.long()]                            # [B, nblk, bs, KVH, D]
        return pages.flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()

    return k_cache, v_cache, tables, contiguous(k_cache), contiguous(v_cache)


def _time_both(ours: Callable[[], torch.Tensor], theirs: Callable[[], torch.Tensor],
               as_ours: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, float, float]:
    """(Triton us, SDPA us, max |Triton - SDPA|), SDPA's output brought to Triton's layout by `as_ours`."""
    t_ours, t_theirs = _bench_us(ours), _bench_us(theirs)
    return t_ours, t_theirs, float((ours().float() - as_ours(theirs()).float()).abs().max())


def run(*, sizes: Sizes, dtype_name: str, q_heads: int, kv_heads: int, head_dim: int,
        block_size: int, peak_tbps: float | None, device: str = "cuda") -> KernelReport:
    from pddgw.kernels import triton_ops as T

    dtype = _DTYPES[dtype_name]
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    peak = peak_tbps * 1e12 if peak_tbps else next((p for key, p in _PEAKS.items() if key in name), None)
    scale = head_dim ** -0.5
    elt = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=device).manual_seed(0)
    i32 = dict(dtype=torch.int32, device=device)

    def paged(batch: int, seq_len: int):
        return _paged(batch, seq_len, kv_heads, head_dim, block_size, dtype, gen, device)

    def query(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, q_heads, head_dim, device=device, dtype=dtype, generator=gen)

    def decode_point(batch: int, ctx: int) -> DecodePoint:
        k_cache, v_cache, tables, k, v = paged(batch, ctx)
        seq_lens = torch.full((batch,), ctx, **i32)
        q = query(batch)                                        # [B, H, D]
        t_ours, t_theirs, err = _time_both(
            lambda: T.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale),
            _sdpa(q[:, :, None], k, v), lambda o: o[:, :, 0])
        sdpa_moved = (2 * batch * ctx * kv_heads * head_dim + 2 * q.numel()) * elt
        gbps = (sdpa_moved + tables.numel() * 4) / t_ours / 1e3          # + the block tables
        return DecodePoint(batch=batch, context=ctx, triton_us=t_ours, sdpa_us=t_theirs, triton_gbps=gbps,
                           triton_peak_frac=ratio(gbps * 1e9, peak), sdpa_gbps=sdpa_moved / t_theirs / 1e3,
                           speedup=ratio(t_theirs, t_ours), max_err=err)

    def extend_point(prefix: int, kq: int) -> ExtendPoint:
        k_cache, v_cache, tables, k, v = paged(1, prefix + kq)
        seq_lens, cu = torch.tensor([prefix + kq], **i32), torch.tensor([0, kq], **i32)
        q = query(kq)                                           # [k, H, D]
        t_ours, t_theirs, err = _time_both(
            lambda: T.extend_attention(q, k_cache, v_cache, tables, cu, seq_lens, scale),
            _sdpa(q.transpose(0, 1)[None], k, v), lambda o: o[0].transpose(0, 1))
        flops = 4 * q_heads * head_dim * (kq * (prefix + 1) + kq * (kq - 1) // 2)   # over the keys each sees
        return ExtendPoint(k=kq, prefix=prefix, triton_us=t_ours, sdpa_us=t_theirs,
                           triton_tflops=flops / t_ours / 1e6, sdpa_tflops=flops / t_theirs / 1e6,
                           speedup=ratio(t_theirs, t_ours), max_err=err)

    def freed(point: P) -> P:
        """`point`, its tensors gone with the call that made them: the allocator's cache back too."""
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        return point

    decode = [freed(decode_point(b, ctx)) for b in sizes.batches for ctx in sizes.contexts
              if b * ctx <= _MAX_DECODE_TOKENS]
    extend = [freed(extend_point(prefix, kq)) for prefix in sizes.prefixes for kq in sizes.ks]
    return KernelReport(device=name, dtype=dtype_name, q_heads=q_heads, kv_heads=kv_heads,
                        head_dim=head_dim, block_size=block_size,
                        peak_gbps=None if peak is None else peak / 1e9, decode=decode,
                        extend=extend, sdpa_note="enable_gqa")


def table(report: KernelReport) -> str:
    head = (f"{report.device}  {report.dtype}  heads {report.q_heads}/{report.kv_heads}  "
            f"head_dim {report.head_dim}  page {report.block_size}  "
            f"HBM peak {report.peak_gbps or '?'} GB/s  (SDPA: {report.sdpa_note})")
    dec = format_table(
        ["decode B x L", "triton us", "GB/s", "of peak", "sdpa us", "sdpa GB/s", "speedup", "max err"],
        [[f"{p.batch} x {p.context}", p.triton_us, p.triton_gbps, p.triton_peak_frac, p.sdpa_us,
          p.sdpa_gbps, p.speedup, f"{p.max_err:.1e}"] for p in report.decode])
    ext = format_table(
        ["extend k @ prefix", "triton us", "TFLOP/s", "sdpa us", "sdpa TFLOP/s", "speedup", "max err"],
        [[f"{p.k} @ {p.prefix}", p.triton_us, p.triton_tflops, p.sdpa_us, p.sdpa_tflops,
          p.speedup, f"{p.max_err:.1e}"] for p in report.extend])
    return "\n\n".join([head, dec, ext])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(parser)
    parser.add_argument("--quick", action="store_true", help="fewer points (under 3 minutes)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--peak-tbps", type=float, default=None,
                        help="HBM peak in TB/s (default: by device name, H200 = 4.8)")
    args = parser.parse_args(argv)
    why = ("no CUDA device: the kernel benchmark needs a GPU" if not torch.cuda.is_available() else
           "triton is not installed: the kernel benchmark needs it" if importlib.util.find_spec("triton") is None
           else "")
    if why:
        emit(Skipped(skipped=f"{why}; nothing measured"), args.json, f"{why}; nothing measured")
        return 0
    report = run(sizes=QUICK if args.quick else FULL, dtype_name=args.dtype, q_heads=args.q_heads,
                 kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                 peak_tbps=args.peak_tbps)
    emit(report, args.json, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
