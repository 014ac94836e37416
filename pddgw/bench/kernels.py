"""Attention kernels on one GPU: pddgw's Triton kernels against torch SDPA, same data.

`python -m pddgw.bench.kernels [--quick] [--json] [--dtype D] [--peak-tbps P]`

Procedure (one model shape, default Llama-3-8B attention: 32 query heads,
8 KV heads, head_dim 128, bfloat16, 16-token pages):
  1. decode  for each batch B x context L: a paged cache whose pages are a
             random permutation of the pool, B sequences of L tokens, one
             query each.  Time `paged_decode_attention`; bytes moved = the
             K and V of every token once + q + out + block tables, so
             GB/s = bytes / time and the fraction of the device's HBM peak
             (H200 4.8 TB/s) says how close to the roofline it runs.
  2. extend  for each k new tokens on a cached prefix P (one sequence): time
             `extend_attention`; FLOPs = 4 * H * D * sum over the k queries of
             the keys each sees (QK^T and PV, causal), reported as TFLOP/s.
  3. Both side by side with `torch.nn.functional.scaled_dot_product_attention`
     on the same values, K/V gathered beforehand into contiguous
     [B, KV heads, L, D] tensors (not timed), GQA via enable_gqa and the
     causal mask aligned to the end (CausalBias lower-right).  `speedup` =
     SDPA time / Triton time; `max_err` = max |Triton - SDPA|.
Timings: triton.testing.do_bench (CUDA events, L2 flushed before each run),
median of the repeats.  Without a GPU the benchmark says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    sdpa_note: str


@dataclass(frozen=True, slots=True)
class Skipped:
    skipped: str


class _Sdpa:
    """SDPA on contiguous K/V: native GQA when this torch has it, else K/V
    expanded to every query head beforehand (noted in the report)."""

    def __init__(self) -> None:
        self.note = "enable_gqa"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 causal_offset: bool) -> Callable[[], torch.Tensor]:
        """q [B, H, Tq, D], k/v [B, KVH, L, D] -> a closure computing [B, H, Tq, D]."""
        import torch.nn.functional as F

        mask = None
        if causal_offset and q.shape[2] > 1:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(q.shape[2], k.shape[2])
        if self.note == "enable_gqa":
            try:
                fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,  # noqa: E731
                                                            enable_gqa=True)
                fn()
                return fn
            except (TypeError, RuntimeError) as e:
                self.note = f"K/V expanded per query head (enable_gqa failed: {e})"[:200]
        group = q.shape[1] // k.shape[1]
        ke = k.repeat_interleave(group, dim=1)
        ve = v.repeat_interleave(group, dim=1)
        return lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)


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
    perm = torch.randperm(num_blocks, device=device, generator=gen)
    tables = perm.view(batch, nblk).to(torch.int32)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        pages = cache[tables.long()]                            # [B, nblk, bs, KVH, D]
        return pages.flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()

    return k_cache, v_cache, tables, contiguous(k_cache), contiguous(v_cache)


def _release(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


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


def run(*, sizes: Sizes, dtype_name: str, q_heads: int, kv_heads: int, head_dim: int,
        block_size: int, peak_tbps: float | None, device: str = "cuda") -> KernelReport:
    from pddgw.kernels import triton_ops as T

    dtype = _DTYPES[dtype_name]
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    peak = peak_tbps * 1e12 if peak_tbps else next(
        (p for key, p in _PEAKS.items() if key in name), None)
    scale = head_dim ** -0.5
    elt = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=device).manual_seed(0)
    sdpa = _Sdpa()

    decode: list[DecodePoint] = []
    for batch in sizes.batches:
        for ctx in sizes.contexts:
            if batch * ctx > _MAX_DECODE_TOKENS:
                continue
            k_cache, v_cache, tables, k, v = _paged(batch, ctx, kv_heads, head_dim, block_size,
                                                    dtype, gen, device)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
            ours = lambda: T.paged_decode_attention(q, k_cache, v_cache, tables,  # noqa: E731
                                                    seq_lens, scale)
            theirs = sdpa(q[:, :, None], k, v, causal_offset=False)
            t_ours, t_theirs = _bench_us(ours), _bench_us(theirs)
            err = _max_err(ours(), theirs()[:, :, 0])
            sdpa_moved = (2 * batch * ctx * kv_heads * head_dim + 2 * q.numel()) * elt
            moved = sdpa_moved + tables.numel() * 4             # + the block tables
            gbps = moved / t_ours / 1e3
            decode.append(DecodePoint(
                batch=batch, context=ctx, triton_us=t_ours, sdpa_us=t_theirs, triton_gbps=gbps,
                triton_peak_frac=ratio(gbps * 1e9, peak), sdpa_gbps=sdpa_moved / t_theirs / 1e3,
                speedup=ratio(t_theirs, t_ours), max_err=err))
            del k_cache, v_cache, tables, k, v, q
            _release(device)

    extend: list[ExtendPoint] = []
    for prefix in sizes.prefixes:
        for kq in sizes.ks:
            total = prefix + kq
            k_cache, v_cache, tables, k, v = _paged(1, total, kv_heads, head_dim, block_size,
                                                    dtype, gen, device)
            seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
            cu = torch.tensor([0, kq], dtype=torch.int32, device=device)
            q = torch.randn(kq, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
            ours = lambda: T.extend_attention(q, k_cache, v_cache, tables, cu,  # noqa: E731
                                              seq_lens, scale)
            q_sdpa = q.transpose(0, 1)[None]                    # [1, H, k, D]
            theirs = sdpa(q_sdpa, k, v, causal_offset=True)
            t_ours, t_theirs = _bench_us(ours), _bench_us(theirs)
            err = _max_err(ours(), theirs()[0].transpose(0, 1))
            keys_seen = kq * (prefix + 1) + kq * (kq - 1) // 2
            flops = 4 * q_heads * head_dim * keys_seen
            extend.append(ExtendPoint(
                k=kq, prefix=prefix, triton_us=t_ours, sdpa_us=t_theirs,
                triton_tflops=flops / t_ours / 1e6, sdpa_tflops=flops / t_theirs / 1e6,
                speedup=ratio(t_theirs, t_ours), max_err=err))
            del k_cache, v_cache, tables, k, v, q
            _release(device)

    return KernelReport(device=name, dtype=dtype_name, q_heads=q_heads, kv_heads=kv_heads,
                        head_dim=head_dim, block_size=block_size,
                        peak_gbps=None if peak is None else peak / 1e9, decode=decode,
                        extend=extend, sdpa_note=sdpa.note)


def table(report: KernelReport) -> str:
    head = (f"{report.device}  {report.dtype}  heads {report.q_heads}/{report.kv_heads}  "
            f"head_dim {report.head_dim}  page {report.block_size}  "
            f"HBM peak {report.peak_gbps or '?'} GB/s  (SDPA: {report.sdpa_note})")
    dec = format_table(
        ["decode B x L", "triton us", "GB/s", "of peak", "sdpa us", "sdpa GB/s", "speedup",
         "max err"],
        [[f"{p.batch} x {p.context}", p.triton_us, p.triton_gbps, p.triton_peak_frac, p.sdpa_us,
          p.sdpa_gbps, p.speedup, f"{p.max_err:.1e}"] for p in report.decode])
    ext = format_table(
        ["extend k @ prefix", "triton us", "TFLOP/s", "sdpa us", "sdpa TFLOP/s", "speedup",
         "max err"],
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
    if not torch.cuda.is_available():
        msg = "no CUDA device: the kernel benchmark needs a GPU; nothing measured"
        emit(Skipped(skipped=msg), args.json, msg)
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        msg = "triton is not installed: the kernel benchmark needs it; nothing measured"
        emit(Skipped(skipped=msg), args.json, msg)
        return 0
    report = run(sizes=QUICK if args.quick else FULL, dtype_name=args.dtype, q_heads=args.q_heads,
                 kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                 peak_tbps=args.peak_tbps)
    emit(report, args.json, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
