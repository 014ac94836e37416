"""Paged decode attention on the CPU: the C kernel (`kernels/cpu_ops.py`) against the torch
reference (page gather + fused SDPA), same pool, side by side in one run.

`python -m pddgw.bench.cpu_attention [--quick] [--json] [--dtype D] [--threads N]`

Each point is one decode layer: B sequences of L tokens, one query each, pages a random
permutation of a block-major pool (the engine's CPU layout) of `--layers` layers, and every
timed call reads the next layer, so the pages come from memory as in a model's step, not
from a warm cache.  The two sides alternate call by call; the median of the calls is kept.
`speedup` = reference / kernel time; `max err` is each side's largest difference from the
float64 reference on the same values.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pddgw.engines.kv_pool import KVPool
from pddgw.kernels import cpu_ops, reference
from pddgw.tables import add_output_args, alternating_medians_us, emit, format_table, ratio

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# (name, query heads, KV heads, head_dim): SmolLM2-135M (the README's model) and Llama-3-8B.
SHAPES = (("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B", 32, 8, 128))
_POOL_BYTES = 1 << 30             # fewer layers where the pool would be larger (at least 2)


@dataclass(frozen=True, slots=True)
class Point:
    model: str
    batch: int
    context: int
    kernel_us: float
    reference_us: float
    speedup: float | None
    kernel_gbps: float            # K and V of every token once, over the kernel's time
    kernel_err: float
    reference_err: float


@dataclass(frozen=True, slots=True)
class Report:
    dtype: str
    threads: int
    block_size: int
    points: list[Point]


def point(model: str, heads: int, kv_heads: int, head_dim: int, batch: int, context: int, *,
          dtype: torch.dtype, layers: int, block_size: int, calls: int) -> Point:
    gen = torch.Generator().manual_seed(0)
    nblk = -(-context // block_size)
    per_layer = 2 * batch * nblk * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    layers = max(2, min(layers, _POOL_BYTES // per_layer))
    pool = KVPool(layers, batch * nblk, block_size, kv_heads, head_dim, dtype, "cpu")
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen).to(dtype))
    tables = torch.randperm(batch * nblk, generator=gen).view(batch, nblk).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    layer = iter(range(1 << 62))

    def side(fn) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            k, v = pool.caches[next(layer) % layers]
            return fn(q, k, v, tables, lens, scale)
        return call

    for _ in range(3):                                                   # warm-up, and the build
        side(cpu_ops.paged_decode_attention)()
        side(reference.paged_decode_attention)()
    kernel_us, reference_us = alternating_medians_us(side(cpu_ops.paged_decode_attention),
                                         side(reference.paged_decode_attention), calls)
    k, v = pool.caches[0]
    exact = reference.paged_decode_attention(q.double(), k.double(), v.double(), tables, lens, scale)

    def err(fn) -> float:
        return float((fn(q, k, v, tables, lens, scale).double() - exact).abs().max())

    moved = 2 * batch * context * kv_heads * head_dim * pool.data.element_size()
    return Point(model=model, batch=batch, context=context, kernel_us=kernel_us, reference_us=reference_us,
                 speedup=ratio(reference_us, kernel_us), kernel_gbps=moved / kernel_us / 1e3,
                 kernel_err=err(cpu_ops.paged_decode_attention), reference_err=err(reference.paged_decode_attention))


def run(*, dtype_name: str, quick: bool, layers: int, block_size: int) -> Report:
    points = [point(name, h, kvh, d, b, ctx, dtype=_DTYPES[dtype_name], layers=layers, block_size=block_size,
                    calls=20 if quick else 100)
              for name, h, kvh, d in (SHAPES[:1] if quick else SHAPES)
              for b, ctx in ((1, 320), (16, 320)) + (() if quick else ((16, 2048), (64, 1024)))]
    return Report(dtype=dtype_name, threads=torch.get_num_threads(), block_size=block_size, points=points)


def table(report: Report) -> str:
    head = f"decode attention, one layer  {report.dtype}  {report.threads} threads  page {report.block_size}"
    return head + "\n" + format_table(
        ["model", "B x L", "C kernel us", "reference us", "speedup", "kernel GB/s", "kernel err", "ref err"],
        [[p.model, f"{p.batch} x {p.context}", p.kernel_us, p.reference_us, p.speedup, p.kernel_gbps,
          f"{p.kernel_err:.1e}", f"{p.reference_err:.1e}"] for p in report.points])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.cpu_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(parser)
    parser.add_argument("--quick", action="store_true", help="SmolLM2's shape only, fewer calls")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    parser.add_argument("--layers", type=int, default=30,
                        help="layers in the pool, read in turn (fewer where it would pass 1 GiB)")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_ops.available():
        emit({"skipped": "the CPU kernel does not build here"}, args.json,
             "the CPU kernel does not build here (a C compiler with OpenMP is needed); nothing measured")
        return 0
    report = run(dtype_name=args.dtype, quick=args.quick, layers=args.layers, block_size=args.block_size)
    emit(report, args.json, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
