"""How fast `pddgw sim` simulates: simulated requests per wall-clock second, variants side by side.

`python -m pddgw.bench.simspeed [--json] [--requests N] [--repeat R] [--against DIR] [--cases a,b] [--calls]`

Cases (fixed, deterministic; PDD at 10 Gbps unless named): `paper` (per-step costs weigh
most), `paper-batched` (per-token costs), `dense70b` (long KV transfers over the shaped WAN),
`paper-probe` (same-DC PD at 19 req/s: a goodput probe's load).  Variants, interleaved, each
run in a fresh process through `sim.clock.run_virtual`: `lean loop` (`VirtualClockLoop`, what
`pddgw sim` runs), `stock loop` (`ReferenceVirtualLoop`) and, with `--against DIR`, the
`pddgw` package under DIR.

Per case and variant: best wall and CPU time, simulated requests per second, the CPU-time
speed-up over the baseline (CPU, since wall time on a shared machine measures the neighbours
too), and whether the requests are identical to the baseline's (a speed-up that changes
results is a bug).  `--calls`: a cProfile count of Python calls, exact where noise drowns 10 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pddgw
from pddgw.tables import add_output_args, best, emit, format_table, ratio

WAN_GBPS = 10.0

# One measured run, in a fresh interpreter: only APIs present since the simulator's first
# version (load_scenario, deployment_config, the workload builder, run_deployment), so an
# older tree given by --against runs it too.  Prints one JSON line.
_ONE = r"""
import asyncio, cProfile, dataclasses, hashlib, inspect, json, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["tree"])      # ahead of the working directory and any installed pddgw
from pddgw.logs import setup_logging
setup_logging("warning")
import pddgw
from pddgw.sim import clock, run as simrun
from pddgw.sim.cluster import run_deployment
from pddgw.sim.scenario import deployment_config, load_scenario
sc = load_scenario(args["scenario"])
over = dict(args["agentic"])
if "rate_per_request" in over:
    over["rate"] = over.pop("rate_per_request") * args["requests"]
spec = dataclasses.replace(sc.workload.agentic, requests=args["requests"], **over)
sc = dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, agentic=spec))
dep = sc.deployment(args["deployment"])
cfg = deployment_config(sc, dep, args["wan_gbps"] if sc.uses_wan(dep) else None)
convs, prefix = simrun._workload(sc)
factory = getattr(clock, args["loop"])
prof = cProfile.Profile() if args["calls"] else None
if prof is not None:
    prof.enable()
t0, c0 = time.perf_counter(), time.process_time()
rv = getattr(clock, "run_virtual", None)
if rv is not None and "loop_factory" in inspect.signature(rv).parameters:
    res = rv(run_deployment(cfg, convs, prefix), factory)
else:
    with asyncio.Runner(loop_factory=factory) as runner:
        res = runner.run(run_deployment(cfg, convs, prefix))
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
if prof is not None:
    prof.disable()
h = hashlib.blake2b(digest_size=12)
for r in res.requests:
    pipeline = r.pipeline and str(r.pipeline)            # an enum member or a plain str: its value
    h.update(repr((r.rid, r.arrival_s, r.output_tokens, r.output_digest, r.ttft_s, r.e2e_s, pipeline,
                   r.handoff_mode, r.rld_tokens, r.md_tokens, r.error, tuple(r.itl_s))).encode())
h.update(repr((res.duration_s, res.drain_s, res.wan_kv_bytes)).encode())
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "requests": len(res.requests), "digest": h.hexdigest(),
                  "calls": None if prof is None else sum(e.callcount for e in prof.getstats()),
                  "package": pddgw.__file__}))
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    name: str
    tree: str               # the directory holding its `pddgw/`
    loop: str               # the loop class of pddgw.sim.clock it runs on


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    variant: str
    wall_s: float           # best of the repeats
    cpu_s: float            # the process's CPU seconds, best of the repeats
    requests: int
    requests_per_wall_s: float
    requests_per_cpu_s: float
    speedup: float | None   # over the baseline variant, in CPU seconds
    same_results: bool      # digest equal to the baseline's
    # With --calls: Python function calls of one profiled run (exact, unlike times: the
    # interpreter work a change removed, whatever the machine's load) and their ratio.
    calls: int | None
    calls_ratio: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """A workload to simulate and, in a report, its cells."""

    case: str
    scenario: str           # relative to --root
    deployment: str
    # Overrides of the scenario's [workload.agentic]; "rate_per_request" sets rate to that x
    # the request count (every conversation arrives within about as many seconds).
    agentic: dict[str, float] = dataclasses.field(default_factory=dict)
    cells: list[Cell] = dataclasses.field(default_factory=list)
    scale: int = 1          # requests a run: --requests x this


CASES = (
    Case("paper", "scenarios/paper.toml", "pdd"),
    # Tens of requests decoding at once, as in the goodput search's probes: conversations of
    # two turns that all arrive within ~2 s, so an engine step carries many requests' tokens.
    Case("paper-batched", "scenarios/paper.toml", "pdd", {"turns_min": 2, "turns_max": 2, "rate_per_request": 0.5}),
    Case("dense70b", "scenarios/dense70b.toml", "pdd"),
    Case("paper-probe", "scenarios/paper.toml", "same-dc-pd", {"rate": 19.0}, scale=30),
)


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    requests: int
    repeat: int
    baseline: str
    cases: list[Case]


def run_one(case: Case, variant: Variant, requests: int, root: Path, calls: bool = False) -> dict:
    """One simulated run in a fresh interpreter -> {wall_s, cpu_s, requests, digest, calls, package};
    `calls`: profiled, counting Python function calls (then its times are the profiler's)."""
    arg = json.dumps({"tree": variant.tree, "loop": variant.loop, "calls": calls, "requests": requests * case.scale,
                      "scenario": case.scenario, "deployment": case.deployment, "wan_gbps": WAN_GBPS,
                      "agentic": case.agentic})
    out = subprocess.run([sys.executable, "-c", _ONE, arg], cwd=root, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{case.case} / {variant.name} failed:\n{out.stderr[-4000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(got["package"]).resolve().is_relative_to(Path(variant.tree).resolve()):
        raise RuntimeError(f"{variant.name}: ran {got['package']}, not the tree under {variant.tree}")
    return got


def _cell(variant: str, runs: list[dict], ref: list[dict]) -> Cell:
    """A variant's runs of a case against the baseline's (`ref`, `runs` itself for the baseline)."""
    wall, cpu = best(r["wall_s"] for r in runs), best(r["cpu_s"] for r in runs)
    n = runs[0]["requests"]
    calls, ref_calls = (next((r["calls"] for r in rs if r["calls"] is not None), None) for rs in (runs, ref))
    is_base = runs is ref
    return Cell(variant, round(wall, 3), round(cpu, 3), n, round(n / wall, 2), round(n / cpu, 2),
                None if is_base else round(ratio(best(r["cpu_s"] for r in ref), cpu) or 0.0, 3),
                all(r["digest"] == ref[0]["digest"] for r in runs), calls,
                None if is_base or calls is None else round(calls / ref_calls, 3))


def measure(cases: list[Case], variants: list[Variant], requests: int, repeat: int, root: Path,
            calls: bool = False) -> Report:
    pairs = [(c, v) for c in cases for v in variants]
    runs: dict[tuple[str, str], list[dict]] = {(c.case, v.name): [] for c, v in pairs}
    for _ in range(repeat):
        for c, v in pairs:            # interleaved: machine noise spreads over every variant
            runs[c.case, v.name].append(run_one(c, v, requests, root))
    for c, v in pairs if calls else ():
        # The profiled run's digest counts, its times (the profiler's) do not.
        got = run_one(c, v, requests, root, calls=True)
        runs[c.case, v.name].append({**got, "wall_s": float("inf"), "cpu_s": float("inf")})
    base = variants[-1].name
    return Report(requests, repeat, base, [
        dataclasses.replace(c, cells=[_cell(v.name, runs[c.case, v.name], runs[c.case, base]) for v in variants])
        for c in cases])


def table(rep: Report) -> str:
    rows = [[c.case, cell.variant, cell.requests, cell.wall_s, cell.requests_per_wall_s, cell.cpu_s,
             cell.requests_per_cpu_s, "-" if cell.speedup is None else f"{cell.speedup:.2f}x",
             cell.same_results, cell.calls, cell.calls_ratio]
            for c in rep.cases for cell in c.cells]
    scaled = "".join(f", {c.case} x{c.scale}" for c in rep.cases if c.scale > 1)
    head = (f"pddgw sim speed: {rep.requests} requests a case{scaled}, best of {rep.repeat}; "
            f"speed-up and identity against '{rep.baseline}'")
    return head + "\n" + format_table(["case", "variant", "requests", "wall s", "req / wall s", "CPU s",
                                       "req / CPU s", "speed-up", "same results", "calls", "calls ratio"], rows)


def main(argv: list[str] | None = None) -> int:
    known = {c.case: c for c in CASES}
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40, help="requests a case (default 40)")
    p.add_argument("--repeat", type=int, default=1, help="runs per case and variant; the best counts")
    p.add_argument("--against", help="also run the pddgw package under this directory (the baseline)")
    p.add_argument("--cases", default=",".join(known), help=f"comma-separated subset of: {', '.join(known)}")
    p.add_argument("--calls", action="store_true",
                   help="also count Python function calls (one profiled run per case and variant)")
    p.add_argument("--root", default=".", help="the directory the scenario paths are relative to")
    add_output_args(p)
    args = p.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        p.error(f"--cases: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(known)}")
    if args.requests < 1 or args.repeat < 1:
        p.error("--requests and --repeat must be at least 1")
    if args.against and not (Path(args.against) / "pddgw" / "__init__.py").is_file():
        p.error(f"--against {args.against}: no pddgw package there")
    here = str(Path(pddgw.__file__).resolve().parent.parent)     # the tree this module runs from
    variants = [Variant("lean loop", here, "VirtualClockLoop"), Variant("stock loop", here, "ReferenceVirtualLoop")]
    if args.against:
        variants.append(Variant(f"against {args.against}", str(Path(args.against).resolve()), "VirtualClockLoop"))
    rep = measure([known[n] for n in names], variants, args.requests, args.repeat, Path(args.root).resolve(),
                  args.calls)
    emit(rep, args.json, table(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
