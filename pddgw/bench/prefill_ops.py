"""A bfloat16 prefill layer's C passes on the CPU against the torch ops they replace, side by side.

`python -m pddgw.bench.prefill_ops [--quick] [--json] [--threads N]`

Rows: RMSNorm over [T, hidden] (`cpu_pointwise.rms_norm` vs transformers' formula in torch),
RoPE over q | k [T, H + KVH, D] (`cpu_pointwise.rope` vs `x * cos2 + roll(x) * sin2`), SiLU x up
over the gate | up projection [T, 2 I] (`cpu_pointwise.silu_mul` vs `F.silu(gate).mul_(up)`), the
causal attention of whole prompts (`cpu_ops.extend_attention`, the AMX prompt kernel, vs the
torch reference: fused SDPA per prompt), at SmolLM2-135M's and Llama-3-8B's shapes.  The two
sides alternate call by call; the median is kept.  `speedup` = torch / C time; `same bits`:
the two outputs are equal (expected for the passes, not for attention, whose `max err` columns
give each side's largest difference from the float64 reference on the same values).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pddgw.engines.model import rope_tables
from pddgw.kernels import cpu_ops, cpu_pointwise, reference
from pddgw.tables import add_output_args, alternating_medians_us, emit, format_table, ratio

# (name, hidden, query heads, KV heads, head_dim, intermediate)
SHAPES = (("SmolLM2-135M", 576, 9, 3, 64, 1536), ("Llama-3-8B", 4096, 32, 8, 128, 14336))
PROMPTS = ((4, 256), (1, 2048))                   # (prompts, tokens each) of a step


@dataclass(frozen=True, slots=True)
class Row:
    op: str
    model: str
    shape: str
    c_us: float
    torch_us: float
    speedup: float | None
    same_bits: bool
    c_err: float | None             # attention only: largest difference from float64
    torch_err: float | None


@dataclass(frozen=True, slots=True)
class Report:
    threads: int
    rows: list[Row]


def _timed(op: str, model: str, shape: str, c: Callable[[], torch.Tensor], ref: Callable[[], torch.Tensor],
           calls: int, exact: torch.Tensor | None = None) -> Row:
    for _ in range(2):                                                  # warm-up, and the build
        c(), ref()
    c_us, torch_us = alternating_medians_us(c, ref, calls)
    a, b = c(), ref()

    def err(x: torch.Tensor) -> float | None:
        return None if exact is None else float((x.double() - exact).abs().max())

    return Row(op=op, model=model, shape=shape, c_us=c_us, torch_us=torch_us, speedup=ratio(torch_us, c_us),
               same_bits=torch.equal(a.view(torch.int16), b.view(torch.int16)), c_err=err(a), torch_err=err(b))


def _attention(model: str, heads: int, kv_heads: int, d: int, prompts: int, length: int, calls: int) -> Row:
    g = torch.Generator().manual_seed(0)
    t = prompts * length
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).bfloat16()      # [T, q | k | v]
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    # One page per token, in order, holding the step's K / V as the engine stores them (the kernel
    # reads the pages; the reference's whole prompts read k / v).
    k_cache, v_cache = k.clone()[:, None], v.clone()[:, None]                     # [T, 1, KVH, D]
    tables = torch.arange(t, dtype=torch.int32).view(prompts, length)
    cu = torch.arange(0, t + 1, length, dtype=torch.int32)
    lens = torch.full((prompts,), length, dtype=torch.int32)
    scale = d ** -0.5

    def side(ops) -> Callable[[], torch.Tensor]:
        return lambda: ops.extend_attention(q, k_cache, v_cache, tables, cu, lens, scale, new_kv=(k, v))

    exact = reference.extend_attention(q.double(), k_cache.double(), v_cache.double(), tables, cu, lens, scale,
                                       new_kv=(k.double(), v.double()))
    return _timed("prompt attention", model, f"{prompts} x {length}", side(cpu_ops), side(reference), calls, exact)


def _rms_norm(model: str, hidden: int, t: int, calls: int) -> Row:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, hidden, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()

    def hf() -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)

    return _timed("rms_norm", model, f"{t} x {hidden}", lambda: cpu_pointwise.rms_norm(x, w, 1e-5), hf, calls)


def _rope(model: str, heads: int, d: int, t: int, calls: int) -> Row:
    g = torch.Generator().manual_seed(2)
    qk = torch.randn(t, heads, d, generator=g).bfloat16()                        # [T, H + KVH, D]
    cos2, sin2 = rope_tables(*(torch.randn(t, d // 2, generator=g).bfloat16() for _ in range(2)))
    return _timed("rope", model, f"{t} x {heads} x {d}", lambda: cpu_pointwise.rope(qk, cos2, sin2),
                  lambda: qk * cos2 + qk.roll(d // 2, -1) * sin2, calls)


def _silu_mul(model: str, inter: int, t: int, calls: int) -> Row:
    gate_up = torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(3)).bfloat16()

    def torch_ops() -> torch.Tensor:
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate).mul_(up)

    return _timed("silu x up", model, f"{t} x 2 x {inter}", lambda: cpu_pointwise.silu_mul(gate_up), torch_ops,
                  calls)


def run(*, quick: bool) -> Report:
    calls = 10 if quick else 50
    rows: list[Row] = []
    for model, hidden, heads, kv_heads, d, inter in SHAPES[:1] if quick else SHAPES:
        for prompts, length in PROMPTS[:1] if quick else PROMPTS:
            rows += [_rms_norm(model, hidden, prompts * length, calls),
                     _rope(model, heads + kv_heads, d, prompts * length, calls),
                     _silu_mul(model, inter, prompts * length, calls),
                     _attention(model, heads, kv_heads, d, prompts, length, calls)]
    return Report(threads=torch.get_num_threads(), rows=rows)


def table(report: Report) -> str:
    def err(x: float | None) -> str:
        return "-" if x is None else f"{x:.1e}"

    return f"bfloat16 prefill passes, C vs torch  {report.threads} threads\n" + format_table(
        ["op", "model", "shape", "C us", "torch us", "speedup", "same bits", "C err", "torch err"],
        [[r.op, r.model, r.shape, r.c_us, r.torch_us, r.speedup, r.same_bits, err(r.c_err), err(r.torch_err)]
         for r in report.rows])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.prefill_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(parser)
    parser.add_argument("--quick", action="store_true", help="SmolLM2's shape, 4 prompts of 256, fewer calls")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (cpu_pointwise.available() and cpu_ops._load_prompt() is not None):
        emit({"skipped": "the C passes do not run here"}, args.json,
             "the C passes do not run here (AVX-512 BF16 and AMX, and a C compiler, are needed); nothing measured")
        return 0
    report = run(quick=args.quick)
    emit(report, args.json, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
