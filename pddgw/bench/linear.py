"""bfloat16 linear layers on the CPU: AMX tiles (`kernels/cpu_linear.py`) against oneDNN (torch's
prepacked linear, what the model used before), the same weights, side by side in one run.

`python -m pddgw.bench.linear [--quick] [--json] [--threads N]`

Each point is one forward's GEMMs at M rows: every layer's qkv, o, gate_up and down weights in
turn, then the lm_head (SmolLM2-135M: its 30 layers; Llama-3-8B: as many layers as fit in
`--max-gib` per side, no lm_head), so the weights come from memory as in a model's step.  The
two sides alternate call by call; the median is kept.  `speedup` = oneDNN / tiles time;
`GB/s` = the weights' bytes over the tiles' time; `same bits` = the tiles' output equals
oneDNN's on every GEMM of the first layer (oneDNN changes its reduction above 32 rows).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from pddgw.kernels import cpu_linear
from pddgw.tables import add_output_args, alternating_medians_us, emit, format_table, ratio

# (name, hidden, q + 2 kv columns, intermediate, layers, vocab (0: no lm_head)).
MODELS = (("SmolLM2-135M", 576, 960, 1536, 30, 49152), ("Llama-3-8B", 4096, 6144, 14336, 32, 0))
ROWS = (1, 8, 16, 32, 128, 512)


@dataclass(frozen=True, slots=True)
class Point:
    model: str
    layers: int
    rows: int
    tiles_us: float
    onednn_us: float
    speedup: float | None
    tiles_gbps: float
    same_bits: bool


@dataclass(frozen=True, slots=True)
class Report:
    threads: int
    points: list[Point]


def shapes(hidden: int, qkv: int, inter: int, layers: int, vocab: int) -> list[tuple[int, int]]:
    """[N, K] of a forward's GEMMs in order (both models' attention width is their hidden size)."""
    one = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return one * layers + ([(vocab, hidden)] if vocab else [])


def model_points(name: str, hidden: int, qkv: int, inter: int, layers: int, vocab: int, *, rows: Sequence[int],
                 max_bytes: int, calls: int) -> list[Point]:
    per_layer = 2 * (qkv * hidden + hidden * hidden + 2 * inter * hidden + hidden * inter)
    layers = max(1, min(layers, (max_bytes - 2 * vocab * hidden) // per_layer))
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16() for n, k in shapes(hidden, qkv, inter,
                                                                                               layers, vocab)]
    tiles = [cpu_linear.pack(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    moved = sum(w.numel() * 2 for w in weights)
    def by_tiles(xs: dict[int, torch.Tensor], first: int | None = None) -> list[torch.Tensor]:
        return [cpu_linear.linear(xs[p.k], p) for p in tiles[:first]]

    def by_onednn(xs: dict[int, torch.Tensor], first: int | None = None) -> list[torch.Tensor]:
        return [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights[:first], onednn)]

    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {w.shape[1] for w in weights}}
        by_tiles(xs), by_onednn(xs)                                        # warm-up
        tiles_us, onednn_us = alternating_medians_us(partial(by_tiles, xs), partial(by_onednn, xs), calls)
        same = all(torch.equal(a, b) for a, b in zip(by_tiles(xs, 4), by_onednn(xs, 4)))
        out.append(Point(model=name, layers=layers, rows=m, tiles_us=tiles_us, onednn_us=onednn_us,
                         speedup=ratio(onednn_us, tiles_us), tiles_gbps=moved / tiles_us / 1e3, same_bits=same))
    return out


def run(*, quick: bool, max_gib: float) -> Report:
    points = [p for spec in (MODELS[:1] if quick else MODELS)
              for p in model_points(*spec, rows=(1, 16) if quick else ROWS, max_bytes=int(max_gib * (1 << 30)),
                                    calls=3 if quick else 9)]
    return Report(threads=torch.get_num_threads(), points=points)


def table(report: Report) -> str:
    head = f"bfloat16 linear layers, one forward's GEMMs  {report.threads} threads"
    return head + "\n" + format_table(
        ["model", "layers", "rows", "AMX tiles us", "oneDNN us", "speedup", "tiles GB/s", "same bits"],
        [[p.model, p.layers, p.rows, p.tiles_us, p.onednn_us, p.speedup, p.tiles_gbps,
          "yes" if p.same_bits else "no"] for p in report.points])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.linear", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(parser)
    parser.add_argument("--quick", action="store_true", help="SmolLM2 at 1 and 16 rows, fewer calls")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    parser.add_argument("--max-gib", type=float, default=1.0, help="weights per side at most (fewer layers)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_linear.available():
        emit({"skipped": "no AMX-BF16 kernel here"}, args.json,
             "the AMX linear kernel is not available here (no AMX-BF16, or no C compiler); nothing measured")
        return 0
    report = run(quick=args.quick, max_gib=args.max_gib)
    emit(report, args.json, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
