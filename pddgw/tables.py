"""Human tables and JSON reports: what the benchmarks and `pddgw sim` print.

A report is a frozen dataclass (nested dataclasses, lists, numbers,
strings); `emit(report, as_json, table)` prints it as JSON (orjson,
dataclasses natively) with --json (`add_output_args`), else the human table
(`format_table`).  A benchmark's options are fields of its dataclasses
(`option`: default and help said once; `add_options` puts them on a parser,
`from_options` builds the dataclass from what it parsed).  Progress goes to
stderr (`to_stderr`), so stdout stays the report alone.  Timings are noisy on shared machines, so benchmarks repeat
interleaved runs and keep the best (`best`), and compare only within one run
(`ratio`).

Where it sits: below everything that prints a report; it imports nothing of
pddgw.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import Field, field, fields, is_dataclass
from typing import Any, TextIO

import orjson


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def option(value: Any, help_text: str | None = None, **argparse_kw: Any) -> Any:
    """A dataclass field that is also the option `--name` (a trailing `_s` dropped); type and default
    come from `value` (False: a switch) unless `argparse_kw` for add_argument says otherwise."""
    return field(default=value, metadata={"help": help_text, **argparse_kw})


def _options(cls: type) -> Iterator[Field[Any]]:
    for f in fields(cls):
        if is_dataclass(f.default):
            yield from _options(type(f.default))
        elif f.metadata:
            yield f


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """An option for each `option` field of `cls` and of the dataclasses it nests, in field order."""
    for f in _options(cls):
        kw = {"action": "store_true"} if f.default is False else {"type": type(f.default), "default": f.default}
        parser.add_argument("--" + f.name.removesuffix("_s").replace("_", "-"), **{**kw, **f.metadata})


def from_options(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """`cls` with its `option` fields (those of the dataclasses it nests too) from `args`; `given` as given."""
    kw: dict[str, Any] = {}
    for f in fields(cls):
        if is_dataclass(f.default):
            kw[f.name] = from_options(type(f.default), args)
        elif f.metadata:
            kw[f.name] = getattr(args, f.name.removesuffix("_s"))
    return cls(**{**kw, **given})


def to_stderr(message: str) -> None:
    """A progress line: stderr, so stdout stays the report alone."""
    print(message, file=sys.stderr, flush=True)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, None when either is missing or theirs is zero."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def best(values: Iterable[float]) -> float:
    """The smallest of repeated timings: noise only ever adds time."""
    return min(values)


def alternating_medians_us(fn: Callable[[], object], other: Callable[[], object], calls: int) -> tuple[float, float]:
    """Median microseconds of `fn` and `other`, called alternately `calls` times each (a noisy
    machine's drift falls on both sides alike)."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(calls):
        for f, out in ((fn, a), (other, b)):
            t = time.perf_counter()
            f()
            out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(a), statistics.median(b)


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
