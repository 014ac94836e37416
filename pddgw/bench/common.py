"""Helpers every benchmark shares: the --json / table output and side-by-side ratios.

A benchmark builds a frozen dataclass report (nested dataclasses, lists,
numbers, strings), then calls `emit(report, as_json, table)`: with --json the
report is printed as JSON (orjson, dataclasses natively), else the human
table.  Timings are noisy on shared machines, so benchmarks repeat
interleaved runs and keep the best (`best`), and compare only within one run
(`ratio`).  Benchmarks that start real processes take their deployment,
fault proxy, leak check and reference from `pddgw.harness`; those that run
the TorchEngine, its sizing (`engine_config`) and prompts (`random_prompts`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

import orjson

from pddgw.config import EngineConfig

BLOCK_SIZE = 16      # the engine benchmarks' KV block (tokens)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def add_torch_args(parser: argparse.ArgumentParser, device_help: str = "cpu or cuda[:N]") -> None:
    """--threads and --device, for the benchmarks that run torch (then `parse_torch_args`)."""
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    parser.add_argument("--device", default="cpu", help=device_help)


def parse_torch_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                     nonnegative: Sequence[str] = ("threads",)) -> argparse.Namespace:
    """Parse; refuse negative `nonnegative` counts and unseen CUDA; set torch's threads if given."""
    import torch      # here: most benchmarks never load torch

    args = parser.parse_args(argv)
    if any(getattr(args, n) < 0 for n in nonnegative):
        flags = [f"--{n.replace('_', '-')}" for n in nonnegative]
        parser.error(" and ".join(filter(None, (", ".join(flags[:-1]), flags[-1]))) + " must be >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch build sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def to_stderr(message: str) -> None:
    """The benchmarks' progress lines: stderr, so stdout stays the report alone."""
    print(message, file=sys.stderr, flush=True)


def random_prompts(seed: int, count: int, length: int | tuple[int, int],
                   ids: tuple[int, int]) -> list[list[int]]:
    """`count` prompts of token ids in [ids[0], ids[1]), from one generator seeded `seed`: each
    `length` long, or (lo, hi): lengths drawn in [lo, hi] first, then the ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = ([length] * count if isinstance(length, int)
            else torch.randint(length[0], length[1] + 1, (count,), generator=g).tolist())
    return [torch.randint(ids[0], ids[1], (n,), generator=g).tolist() for n in lens]


def engine_config(max_num_seqs: int, longest: int, device: str, max_num_batched_tokens: int = 0,
                  **overrides: Any) -> EngineConfig:
    """A TorchEngine config whose pool holds `max_num_seqs` sequences of `longest` tokens (plus
    the spare block), so no run preempts; by default all their tokens fit one step."""
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=max_num_seqs * -(-longest // BLOCK_SIZE) + 1,
                        max_num_seqs=max_num_seqs, device=device,
                        max_num_batched_tokens=max_num_batched_tokens or max_num_seqs * longest,
                        **overrides)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, None when either is missing or theirs is zero."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def best(values: Iterable[float]) -> float:
    """The smallest of repeated timings: noise only ever adds time."""
    return min(values)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10:
            return f"{value:.2f}"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.1f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns aligned: the first left-aligned (labels), the rest right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def to_json(report: Any) -> str:
    return orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()


def emit(report: Any, as_json: bool, table: str, out: TextIO | None = None) -> None:
    """Print the report as JSON or the human table (with a trailing newline)."""
    stream = sys.stdout if out is None else out
    stream.write((to_json(report) if as_json else table) + "\n")
    stream.flush()
