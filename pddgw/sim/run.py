"""`pddgw sim`: run a scenario's deployments side by side on a virtual clock.

Jobs (each one simulated run, or one goodput search of several runs) are
independent, so they spread over `--jobs` processes; each is deterministic,
so the report is the same whatever the parallelism.  Wall-clock figures
(how fast the simulation ran) go to stderr and the human table, never into
the JSON: the same scenario and seed give byte-identical JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson

from pddgw.config import ConfigError
from pddgw.logs import setup_logging
from pddgw.sim import report
from pddgw.sim.clock import run_virtual
from pddgw.sim.cluster import RunResult, run_deployment, served_rps
from pddgw.sim.goodput import Probe, Prober, bisect, describe, first_fail, start_rate
from pddgw.sim.plan_bounds import Setting, attainment_bound, capacity, demand, deployment_bound
from pddgw.sim.plan_space import Candidate
from pddgw.sim.probe import run_probe
from pddgw.sim.profiles import model as model_profile
from pddgw.sim.profiles import uncalibrated, uncalibrated_line
from pddgw.sim.scenario import Scenario, deployment_config, deployment_hardware, deployment_price, load_scenario
from pddgw.sim.workload import AgenticSpec, Conversation, agentic, load_trace, shared_prefix
from pddgw.tables import format_table

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    kind: str                     # "main" | "goodput" | "bathtub"
    deployment: str
    wan_gbps: float | None
    hit: float | None = None      # bathtub point

    @property
    def label(self) -> str:
        """How the job reads in progress lines and the wall-time table."""
        return (f"{self.kind} {self.deployment}" + (f" @ {self.wan_gbps:g} Gbps" if self.wan_gbps else "")
                + (f" hit {self.hit}" if self.hit is not None else ""))


def _workload(sc: Scenario, rate: float | None = None, requests: int | None = None,
              hit: float | None = None, horizon_s: float | None = None
              ) -> tuple[list[Conversation], tuple[int, ...]]:
    wl = sc.workload
    if wl.kind == "trace":
        t = wl.trace
        return load_trace(t.path, requests or t.requests, output_cap=t.output_cap, speed=t.speed,
                          burst_s=t.burst_s, seed=sc.seed), ()
    spec: AgenticSpec = wl.agentic
    if rate is not None:
        spec = dataclasses.replace(spec, rate=rate)
    if requests is not None:
        spec = dataclasses.replace(spec, requests=requests)
    if hit is not None:
        band = sc.bathtub.band
        spec = dataclasses.replace(spec, shared_prefix_tokens=0,
                                   hit_buckets=((1.0, max(0.0, hit - band), min(1.0, hit + band)),))
    return agentic(spec, sc.seed, horizon_s), shared_prefix(spec.shared_prefix_tokens, sc.seed)


def _simulate(sc: Scenario, job: Job, rate: float | None = None, requests: int | None = None,
              horizon_s: float | None = None):
    cfg = deployment_config(sc, sc.deployment(job.deployment), job.wan_gbps)
    convs, prefix = _workload(sc, rate, requests, job.hit, horizon_s)
    return run_virtual(run_deployment(cfg, convs, prefix))


def goodput_probe(sc: Scenario, job: Job, rate: float) -> tuple[report.Window, RunResult]:
    """One probe of the SLA-goodput search of a scenario's deployment (`run_probe`)."""
    return run_probe(sc, deployment_config(sc, sc.deployment(job.deployment), job.wan_gbps), rate)


def _bounds(sc: Scenario, job: Job) -> tuple[Candidate | None, Setting]:
    """What the roofline's bounds read of a job's deployment: it as a candidate (None where the
    bounds do not hold for it, `plan_bounds.deployment_bound`) and its setting."""
    dep = sc.deployment(job.deployment)
    return deployment_bound(sc, dep, job.wan_gbps), Setting(sc, job.wan_gbps, dep.policy.rld_max_relays)


def _goodput_job(sc: Scenario, job: Job, progress: bool) -> dict[str, Any]:
    """The SLA-goodput bisection of one deployment (`goodput.bisect`), started at
    `goodput.start_rate`, skipping probes the roofline proves out of reach as `pddgw plan` does;
    a deployment the bounds cannot read starts at the grid's midpoint, every probe simulated.
    """
    g = sc.goodput
    cand, at = _bounds(sc, job)
    prof = model_profile(sc.model)
    sims: list[tuple[int, float]] = []                # per simulated probe: (requests simulated, wall s)
    start = None if cand is None else start_rate(g, lambda r: capacity(at, prof, cand, demand(sc, r)).rate)
    most = g.probes + (2 if start is not None else 0)   # the start and its neighbour: 2 more

    def simulate(rate: float) -> tuple[report.Window, float, bool]:
        w, run = goodput_probe(sc, job, rate)
        sims.append((len(run.requests), run.wall_s))
        return w, served_rps(run), run.decided

    def bound(rate: float) -> float:
        return attainment_bound(at, prof, cand, demand(sc, rate)) if cand is not None else 1.0

    seen = 0

    def say(p: Probe) -> None:
        nonlocal seen
        seen += 1
        if not progress:
            return
        what = describe(p)
        if p.window is not None:
            what += f"; {sims[-1][0]} requests simulated in {sims[-1][1]:.1f} s"
        print(f"pddgw sim: {job.label}: probe {seen} of at most {most} at {p.rate:.4g} req/s: {what}",
              file=sys.stderr, flush=True)

    goodput, offered, probes = bisect(g, Prober(sc.slo.attainment, simulate, bound, on_probe=say), start)
    return {"goodput_rps": round(goodput, 4), "goodput_offered_rps": round(offered, 4),
            "goodput_fail": first_fail(probes, offered), "probes": [p.json() for p in probes],
            "_wall_s": sum(w for _, w in sims), "_requests": sum(n for n, _ in sims)}


def run_job(sc: Scenario, job: Job, progress: bool = False) -> dict[str, Any]:
    """One job -> its JSON-able result (plus `_ttft`/`_wall_s`, kept out of the report).  With
    `progress`, each goodput probe prints one line to stderr as it ends.
    """
    if job.kind == "goodput":
        return _goodput_job(sc, job, progress)
    if job.kind == "bathtub":
        run = _simulate(sc, job, sc.bathtub.rate, sc.bathtub.requests)
    else:
        run = _simulate(sc, job)
    return {**report.summarize(run, sc.slo),
            "_ttft": sorted(r.ttft_s for r in run.requests if r.ttft_s is not None),
            "_wall_s": run.wall_s, "_requests": len(run.requests)}


def _job(sc: Scenario, kind: str, name: str, wan: float | None, hit: float | None = None) -> Job:
    """A job; a deployment inside one cluster is the same job whatever the WAN."""
    return Job(kind, name, wan if sc.uses_wan(sc.deployment(name)) else None, hit)


def _jobs(sc: Scenario) -> list[Job]:
    kinds = ["main"] + (["goodput"] if sc.goodput.enabled else [])
    jobs = list(dict.fromkeys(_job(sc, k, d.name, w) for k in kinds for w in sc.variants() for d in sc.deployments))
    if sc.bathtub.enabled:
        jobs += [_job(sc, "bathtub", name, sc.bathtub_wan(), h) for h in sc.bathtub.hits
                 for name in (sc.bathtub.deployment, sc.bathtub.baseline)]
    return jobs


def _longest_first(sc: Scenario, job: Job) -> tuple[bool, float, int]:
    """A sort key, longest jobs first: goodput searches, by the highest rate the roofline lets the
    deployment carry, then by node count.
    """
    if job.kind != "goodput":
        return True, 0.0, 0
    cand, at = _bounds(sc, job)
    g = sc.goodput
    rate = g.rate_max if cand is None else min(
        g.rate_max, capacity(at, model_profile(sc.model), cand, demand(sc, g.rate_min)).rate)
    return False, -rate, -sum(n.count for n in sc.deployment(job.deployment).nodes)


def init_worker() -> None:
    """A simulation worker process: warnings only (a run logs per request at info)."""
    setup_logging("warning")


def simulate(sc: Scenario, jobs: int = 1, progress: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run every job of the scenario -> (report, private: wall-clock figures and TTFT samples).
    With `progress`, stderr gets a line per goodput probe and, on a terminal, a bar of jobs."""
    todo = _jobs(sc)
    wall0 = time.perf_counter()
    results: dict[Job, dict[str, Any]] = {}
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=len(todo), desc=f"pddgw sim {sc.name}", unit="job", file=sys.stderr)
    if jobs <= 1:
        for job in todo:
            results[job] = run_job(sc, job, progress)
            if bar is not None:
                bar.update()
    else:
        with concurrent.futures.ProcessPoolExecutor(jobs, initializer=init_worker) as pool:
            # Longest first, so that no long job starts last and sets the wall time alone (the
            # report is the same in any order).
            order = sorted(todo, key=lambda j: _longest_first(sc, j))
            futures = {pool.submit(run_job, sc, job, progress): job for job in order}
            for fut in concurrent.futures.as_completed(futures):
                results[futures[fut]] = fut.result()
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - wall0
    simulated = sum(r["_requests"] for r in results.values())
    runs = [(j.label, r.pop("_requests"), round(r.pop("_wall_s"), 1)) for j, r in results.items()]
    private = {"wall_s": round(wall, 2), "simulated_requests": simulated,
               "sim_requests_per_wall_s": round(simulated / max(wall, 1e-9), 1), "runs": runs, "ttft": {}}
    return _assemble(sc, results, private), private


def _assemble(sc: Scenario, results: dict[Job, dict[str, Any]], private: dict[str, Any]) -> dict[str, Any]:
    ttfts = {job: r.pop("_ttft") for job, r in results.items() if "_ttft" in r}
    variants = []
    for w in sc.variants():
        deps: dict[str, Any] = {}
        for d in sc.deployments:
            price, gpus = deployment_price(sc, d)
            job = _job(sc, "main", d.name, w)
            private["ttft"][(w, d.name)] = ttfts[job]
            entry: dict[str, Any] = {"gpus": gpus, "price_per_hour": round(price, 2), **results[job]}
            gp = results.get(_job(sc, "goodput", d.name, w))
            if gp is not None:
                entry["goodput_rps"] = gp["goodput_rps"]
                entry["goodput_offered_rps"] = gp["goodput_offered_rps"]
                entry["goodput_fail"] = gp["goodput_fail"]
                entry["goodput_probes"] = gp["probes"]
            deps[d.name] = entry
        base = deps[sc.baseline_name]
        for entry in deps.values():
            entry["cost_vs_baseline"] = round(entry["price_per_hour"] / base["price_per_hour"], 4)
            if "goodput_rps" in entry:
                b = report.bcr(entry["goodput_rps"], entry["price_per_hour"], base["goodput_rps"],
                               base["price_per_hour"])
                entry["bcr_vs_baseline"] = None if b is None else round(b, 4)
                entry["goodput_vs_baseline"] = (round(entry["goodput_rps"] / base["goodput_rps"], 4)
                                                if base["goodput_rps"] else None)
        variants.append({"wan_gbps": w, "deployments": deps})
    prof = model_profile(sc.model)
    out: dict[str, Any] = {"scenario": sc.name, "seed": sc.seed, "model": sc.model, "model_name": prof.name,
                           # The regime's yardstick (docs/architecture.md): the KV of 80 concurrent 64K-token requests.
                           "kv_gb_80x64k": round(80 * prof.kv_bytes(65536) / 1e9, 3),
                           "baseline": sc.baseline_name, "slo": dataclasses.asdict(sc.slo), "variants": variants}
    guessed = uncalibrated(h for d in sc.deployments for h in deployment_hardware(d))
    if guessed:
        out["uncalibrated_hardware"] = guessed
    if sc.bathtub.enabled:
        bt = sc.bathtub
        points = []
        for h in bt.hits:
            a = results[_job(sc, "bathtub", bt.deployment, sc.bathtub_wan(), h)]
            b = results[_job(sc, "bathtub", bt.baseline, sc.bathtub_wan(), h)]

            def benefit(q: str) -> float | None:
                x, y = a["ttft_s"][q], b["ttft_s"][q]  # noqa: B023
                return None if x is None or not y else round(1.0 - x / y, 4)

            points.append({"hit": h, "md_prefix_hit_mean": a["md_prefix_hit_mean"],
                           "ttft_p50_s": [a["ttft_s"]["p50"], b["ttft_s"]["p50"]],
                           "ttft_p90_s": [a["ttft_s"]["p90"], b["ttft_s"]["p90"]],
                           "benefit_p50": benefit("p50"), "benefit_p90": benefit("p90"),
                           "rld_token_share": a["rld_token_share"]})
        out["bathtub"] = {"deployment": bt.deployment, "baseline": bt.baseline, "wan_gbps": sc.bathtub_wan(),
                          "rate": bt.rate, "points": points}
    if sc.published:
        out["published"] = [{"metric": k, "published": v, "ours": [_lookup(var, k) for var in variants]}
                            for k, v in sc.published.items()]
    return out


def _lookup(variant: dict[str, Any], key: str) -> Any:
    """'deployment.path.to.value' in one variant's results (None when absent)."""
    name, _, path = key.partition(".")
    node: Any = variant["deployments"].get(name)
    for part in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def format_report(rep: dict[str, Any], private: dict[str, Any]) -> str:
    lines = [f"pddgw sim: scenario {rep['scenario']} (model {rep['model_name']}: {rep['kv_gb_80x64k']:g} GB of KV "
             f"for 80 x 64K-token requests; seed {rep['seed']}); "
             f"SLO ttft <= {rep['slo']['ttft_s']} s, tpot <= {rep['slo']['tpot_ms']} ms, "
             f">= {rep['slo']['attainment']:.0%} of requests"]
    metrics = [("GPUs", "gpus"), ("cost / h (USD)", "price_per_hour"), ("cost vs baseline", "cost_vs_baseline"),
               ("requests", "requests"), ("failed", "failed"),
               ("TTFT P50 (s)", "ttft_s.p50"), ("TTFT P90 (s)", "ttft_s.p90"), ("TTFT P99 (s)", "ttft_s.p99"),
               ("TPOT P50 (ms)", "tpot_ms.p50"), ("TPOT P99 (ms)", "tpot_ms.p99"),
               ("ITL P50 (ms)", "itl_ms.p50"), ("ITL P99 (ms)", "itl_ms.p99"),
               ("E2E P50 (s)", "e2e_s.p50"), ("E2E P99 (s)", "e2e_s.p99"),
               ("SLO attainment", "slo_attainment"), ("throughput (req/s)", "throughput_rps"),
               ("within SLO (req/s)", "slo_rps"),
               ("SLA goodput (req/s in SLO)", "goodput_rps"), ("  at offered (req/s)", "goodput_offered_rps"),
               ("  fails at offered (req/s)", "goodput_fail.offered_rps"),
               ("  misses there, by SLO", "goodput_fail.misses"),
               ("goodput vs baseline", "goodput_vs_baseline"),
               ("BCR vs baseline", "bcr_vs_baseline"),
               ("RLD token share", "rld_token_share"), ("pipelines", "pipeline_share"),
               ("MD prefix hit (mean)", "md_prefix_hit_mean"), ("WAN KV (GB)", "wan_kv_gb"),
               ("link utilisation", "link_utilisation"), ("handoffs", "handoff_modes"),
               ("handoff stall P50 (ms)", "handoff_stall_ms.p50"), ("handoff stall P99 (ms)", "handoff_stall_ms.p99"),
               ("handoff stall max (ms)", "handoff_stall_ms.max"),
               ("catch-up rounds (median)", "catchup_rounds.median"),
               ("MD alignments", "alignments"), ("RLD full -> P-MD", "rld_full"),
               ("WAN QoS (GB; bg ahead of fg)", "wan_qos"), ("re-drives", "redrives"), ("preemptions", "preemptions"),
               ("background drain (s)", "drain_s"),
               ("engine busy", "engine_busy"), ("leaked blocks", "leaked_blocks")]
    for var in rep["variants"]:
        names = list(var["deployments"])
        rows = [[label] + [_lookup(var, f"{n}.{key}") for n in names] for label, key in metrics]
        rows = [[r[0]] + [_short(v) for v in r[1:]] for r in rows]
        wan = f"WAN {var['wan_gbps']:g} Gbps" if var["wan_gbps"] is not None else "links as configured"
        lines += ["", f"== {wan} ==", format_table(["metric", *names], rows)]
    if "bathtub" in rep:
        bt = rep["bathtub"]
        lines += ["", f"== bathtub: {bt['deployment']} vs {bt['baseline']} (TTFT benefit = 1 - ours/theirs), "
                      f"{bt['rate']} req/s ==",
                  format_table(["target hit", "MD hit", "TTFT P50 (s)", "TTFT P90 (s)", "benefit P50",
                                "benefit P90", "RLD share"],
                               [[p["hit"], p["md_prefix_hit_mean"], _short(p["ttft_p50_s"]), _short(p["ttft_p90_s"]),
                                 p["benefit_p50"], p["benefit_p90"], p["rld_token_share"]] for p in bt["points"]])]
    if "published" in rep:
        heads = ["metric", "paper"] + [f"ours @ {v['wan_gbps']:g} Gbps" if v["wan_gbps"] is not None else "ours"
                                       for v in rep["variants"]]
        lines += ["", "== the paper's numbers next to ours ==",
                  format_table(heads, [[p["metric"], p["published"], *p["ours"]] for p in rep["published"]])]
    mains = [r for r in private["runs"] if r[0].startswith("main ")]
    if "uncalibrated_hardware" in rep:
        lines += ["", uncalibrated_line(rep["uncalibrated_hardware"])]
    lines += ["", f"simulated {private['simulated_requests']} requests in {private['wall_s']} s of wall time: "
                  f"{private['sim_requests_per_wall_s']} requests per wall-clock second"]
    lines += [f"  {name}: {n} requests in {wall} s of wall time" for name, n, wall in mains]
    return "\n".join(lines)


def _short(v: Any) -> Any:
    if isinstance(v, dict):
        return " ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    if isinstance(v, list):
        return " / ".join(_fmt(x) for x in v)
    return v


def _fmt(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def sim_parser(prog: str, description: str, toml_flag: str, toml_help: str, trace_help: str
               ) -> argparse.ArgumentParser:
    """The flags `pddgw sim` and `pddgw plan` share: the TOML, a trace, processes and JSON output."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument(toml_flag, required=True, help=toml_help)
    p.add_argument("--trace", help=trace_help)
    p.add_argument("--jobs", type=int, default=2, help="parallel processes (default 2)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def parser() -> argparse.ArgumentParser:
    """`pddgw sim`'s flags."""
    p = sim_parser("pddgw sim", "Run a scenario on a virtual clock with cost-model engines; deployments side "
                   "by side.", "--scenario", "scenario TOML (e.g. scenarios/paper.toml)",
                   "replay this Mooncake-format trace instead of the scenario's workload")
    p.add_argument("--trace-speed", type=float, help="divide the trace's timestamps by this")
    p.add_argument("--trace-burst-s", type=float,
                   help="every trace request of each span of this many seconds arrives at its start")
    p.add_argument("--requests", type=int, help="override the workload's request count")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--rate", type=float, help="override the agentic workload's request rate (req/s)")
    p.add_argument("--wan-gbps", type=float, nargs="+", help="override the scenario's WAN variants")
    p.add_argument("--no-goodput", action="store_true", help="skip the SLA goodput search")
    p.add_argument("--no-bathtub", action="store_true", help="skip the bathtub sweep")
    p.add_argument("--json-out", help="also write the JSON report to this file")
    p.add_argument("--plots", help="write PNG plots into this directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging("warning")
    try:
        sc = load_scenario(args.scenario)
        sc = _overrides(sc, args)
    except (ConfigError, ValueError) as e:
        print(f"pddgw sim: {e}", file=sys.stderr)
        return 2
    rep, private = simulate(sc, max(1, args.jobs), progress=True)
    print(f"pddgw sim: {private['simulated_requests']} requests simulated in {private['wall_s']} s of wall "
          f"time ({private['sim_requests_per_wall_s']} requests per wall-clock second)", file=sys.stderr)
    if args.plots:
        from pddgw.sim.plots import write_plots
        for path in write_plots(rep, private, Path(args.plots)):
            print(f"pddgw sim: wrote {path}", file=sys.stderr)
    data = orjson.dumps(rep, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
    if args.json_out:
        Path(args.json_out).write_bytes(data)
    if args.json:
        sys.stdout.buffer.write(data)
    else:
        print(format_report(rep, private))
    return 0


def _flag(flag: str, value: Any, make: Callable[[], _T]) -> _T:
    """make() with a bad value's error naming the flag that gave it (the specs check their own
    numbers, and a spec's message names its field, not the command line's)."""
    try:
        return make()
    except ValueError as e:
        raise ValueError(f"{flag} {value}: {e}") from None


def _overrides(sc: Scenario, args: argparse.Namespace) -> Scenario:
    wl = sc.workload
    if args.trace:
        wl = dataclasses.replace(wl, kind="trace", trace=dataclasses.replace(wl.trace, path=args.trace))
    for flag, key, value in (("--trace-speed", "speed", args.trace_speed),
                             ("--trace-burst-s", "burst_s", args.trace_burst_s)):
        if value is not None:
            wl = _flag(flag, value, lambda: dataclasses.replace(
                wl, trace=dataclasses.replace(wl.trace, **{key: value})))  # noqa: B023
    if args.requests is not None:
        wl = _flag("--requests", args.requests, lambda: dataclasses.replace(
            wl, agentic=dataclasses.replace(wl.agentic, requests=args.requests),
            trace=dataclasses.replace(wl.trace, requests=args.requests)))
    if args.rate is not None:
        wl = _flag("--rate", args.rate, lambda: dataclasses.replace(
            wl, agentic=dataclasses.replace(wl.agentic, rate=args.rate)))
    sc = dataclasses.replace(sc, workload=wl, seed=sc.seed if args.seed is None else args.seed)
    if args.wan_gbps:
        sc = dataclasses.replace(sc, wan_gbps=tuple(args.wan_gbps))
    if args.no_goodput:
        sc = dataclasses.replace(sc, goodput=dataclasses.replace(sc.goodput, enabled=False))
    if args.no_bathtub:
        sc = dataclasses.replace(sc, bathtub=dataclasses.replace(sc.bathtub, enabled=False))
    return sc
