"""Helpers every benchmark shares: the --json / table output and side-by-side ratios.

A benchmark builds a frozen dataclass report (nested dataclasses, lists,
numbers, strings), then calls `emit(report, as_json, table)`: with --json the
report is printed as JSON (orjson, dataclasses natively), else the human
table.  Timings are noisy on shared machines, so benchmarks repeat
interleaved runs and keep the best (`best`), and compare only within one run
(`ratio`).  Benchmarks (and tests) that start real processes share the
loopback plumbing below: free ports, the PDD topology's `[[nodes]]`, and
what a quiet deployment's /debug/state must show.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

import orjson


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def add_torch_args(parser: argparse.ArgumentParser, device_help: str = "cpu or cuda[:N]") -> None:
    """--threads and --device, for the benchmarks that run torch (then `apply_torch_args`)."""
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    parser.add_argument("--device", default="cpu", help=device_help)


def apply_torch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a CUDA device this torch build cannot see; set torch's thread count if given."""
    import torch      # here: the loopback helpers below serve benchmarks that never load torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch build sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)


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


# ---- real deployments on loopback (benches and tests that start processes) ------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pdd_nodes_toml(p_port: int, rld_port: int, md_port: int, md_engine: str = "", p_engine: str = "") -> str:
    """The `[[nodes]]` of the PDD topology: router, p0 and rld0 in cluster A, md0 in B.

    `md_engine` / `p_engine`: TOML lines of that node's `[nodes.engine]` table ("" = none).
    """
    def engine(lines: str) -> str:
        return f"[nodes.engine]\n{lines.strip()}\n" if lines.strip() else ""

    return f'''[[nodes]]
name = "router"
role = "router"
cluster = "A"

[[nodes]]
name = "p0"
role = "prefill"
cluster = "A"
port = {p_port}
{engine(p_engine)}
[[nodes]]
name = "rld0"
role = "rld"
cluster = "A"
port = {rld_port}

[[nodes]]
name = "md0"
role = "md"
cluster = "B"
port = {md_port}
{engine(md_engine)}'''


def state_leftovers(state: dict[str, Any]) -> dict[str, Any]:
    """Everything non-zero in the router's /debug/state document that should be zero at
    rest (empty: quiet): the router's in-flight counters, and per reachable node its KV
    blocks in use and in-flight entries (a node that is down holds nothing any more)."""
    out: dict[str, Any] = {}
    router = state["router"]
    busy = {k: v for k, v in router["inflight"].items() if v}
    if router["active_requests"]:
        busy["active_requests"] = router["active_requests"]
    if busy:
        out["router"] = busy
    for name, node in state["nodes"].items():
        if not node.get("healthy", True):
            continue
        nb = {k: v for k, v in node["inflight"].items() if v}
        if node["kv_blocks_in_use"]:
            nb["kv_blocks_in_use"] = node["kv_blocks_in_use"]
        if nb:
            out[name] = nb
    return out
