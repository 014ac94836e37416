"""Fidelity of the simulator: one deployment and one workload, simulated and in real time.

`python -m pddgw.bench.fidelity [--json] [--requests N] [--conversations N] [--keep DIR]`

One config.toml (router, P and RLD in cluster A, MD in B; cost-model engines; a shaped WAN
link) runs simulated (`run_virtual(run_deployment(...))`) and as four `pddgw serve` processes
over real links, the engines sleeping each step's modeled time, while `pddgw.harness.replay`
plays the same conversations in real time.  Compared (real / sim, within 15 % by default):
TTFT P50/P99, RLD's token share, mean E2E, the P-RLD-MD share; every request's output ids
must be equal (tokens depend on (seed, i) alone), and no KV block or pin may be left.
Timing-dependent pipeline choices may differ; the report counts the requests that agree.
`run_fidelity(...)` is the entry point for tests.  Results: docs/results/fidelity.md.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pddgw.config import load_config
from pddgw.harness.cluster import ClusterToml, free_ports, toml_lines
from pddgw.harness.replay import SideResult, Workload, serve_and_play
from pddgw.logs import setup_logging
from pddgw.sim.clock import run_virtual
from pddgw.sim.cluster import run_deployment
from pddgw.sim.report import percentile
from pddgw.sim.workload import AgenticSpec, agentic, shared_prefix
from pddgw.tables import add_options, add_output_args, emit, format_table, from_options, option, ratio

TOLERANCE = 0.15


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """The small deployment both sides run (one config.toml)."""

    model: str = option("qwen3-32b")         # pddgw.sim.profiles.MODELS, or a shipped config.json
    a_hardware: str = "H100-SXM"             # P and RLD (cluster A)
    b_hardware: str = "H200-SXM"             # MD (cluster B)
    # Every instance's shape (config.CostModelConfig): a MoE such as deepseek-v4-flash needs several GPUs.
    tensor_parallel: int = option(1)
    data_parallel: int = option(1)
    expert_parallel: int = option(0)         # 0: all of the instance's GPUs
    wan_gbps: float = option(10.0)
    wan_latency_ms: float = option(15.0)     # one way
    p_md_max_transfer_ms: float = 200.0
    block_size: int = option(16)
    max_num_seqs: int = option(64)
    max_num_batched_tokens: int = option(2048, "tokens per engine step (the prefill chunk)")
    # Large frames: a virtual KV chunk carries no bytes, but each frame is a message through Python.
    kv_frame_bytes: int = 64 << 20

    def engine(self, hardware: str) -> str:
        """An [engine] table's body: cost-model engines of `hardware`, in this shape."""
        return toml_lines(implementation="costmodel", num_blocks=0, block_size=self.block_size,
                          max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                          enable_prefix_caching=True) + (
            f'\ncostmodel = {{ hardware = "{hardware}", tensor_parallel = {self.tensor_parallel}, '
            f'data_parallel = {self.data_parallel}, expert_parallel = {self.expert_parallel}, '
            f'gpu_memory_utilization = 0.9 }}')

    def toml(self) -> ClusterToml:
        return ClusterToml(
            header="pddgw.bench.fidelity: the same deployment simulated and served by real processes.",
            model=toml_lines(profile=self.model), engine=self.engine(self.a_hardware),
            server=toml_lines(request_timeout_s=300), log=toml_lines(level="warning"),
            net=toml_lines(kv_frame_bytes=self.kv_frame_bytes, max_frame_bytes=self.kv_frame_bytes,
                           inbound_buffer_bytes=max(self.kv_frame_bytes, 64 << 20), heartbeat_s=1.0,
                           dead_after_s=10.0, request_timeout_s=30.0),
            wan=toml_lines(gbps=self.wan_gbps, latency_ms=self.wan_latency_ms),
            policy=toml_lines(p_md_max_transfer_ms=self.p_md_max_transfer_ms),
            md_engine=self.engine(self.b_hardware))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Agentic conversations of `requests // conversations` turns each, sharing half the context.

    Follow-up turns keep 95-100 % of the previous context (a tail of tens
    of tokens crosses the WAN: P-MD) or, one time in three, 25-50 % (a
    thousand-plus missing tokens, far over the P-MD budget: P-RLD-MD).
    """

    requests: int = option(48)
    conversations: int = option(8)
    rate: float = option(1.0, "requests per second once conversations overlap")
    output_tokens: int = option(48)
    context_tokens: int = option(2048)
    seed: int = option(0)

    def workload(self) -> Workload:
        turns = max(1, self.requests // self.conversations)
        prefix = self.context_tokens // 2
        spec = AgenticSpec(requests=turns * self.conversations, rate=self.rate, context_tokens=self.context_tokens,
                           output_tokens=self.output_tokens, shared_prefix_tokens=prefix, turns_min=turns,
                           turns_max=turns, think_s_min=0.5, think_s_max=2.0,
                           hit_buckets=((2.0, 0.95, 1.0), (1.0, 0.25, 0.5)))
        return Workload(agentic(spec, self.seed), shared_prefix(prefix, self.seed))


# ---- comparison ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    sim: float | None
    real: float | None
    ratio: float | None                 # real / sim
    within: bool


@dataclass(frozen=True, slots=True)
class FidelityReport:
    model: str
    hardware: str
    wan: str
    requests: int
    completed_sim: int
    completed_real: int
    same_output_ids: int                # requests whose output ids agree on both sides
    same_pipeline: int
    leaked_sim: int                     # KV blocks + pins left in use once idle (must be 0)
    leaked_real: int
    tolerance: float
    metrics: list[Metric]
    sim_wall_s: float
    real_wall_s: float

    def metric(self, name: str) -> Metric:
        return next(m for m in self.metrics if m.name == name)


@dataclass(slots=True)
class FidelityRun:
    report: FidelityReport
    sim: SideResult
    real: SideResult


def _stats(side: SideResult) -> dict[str, float | None]:
    ok = [r for r in side.requests if r.error is None]
    ttft_ms = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    rld = sum(r.rld_tokens for r in ok)
    return {"TTFT P50 (ms)": percentile(ttft_ms, 50), "TTFT P99 (ms)": percentile(ttft_ms, 99),
            "RLD token share": ratio(rld, rld + sum(r.md_tokens for r in ok)),
            "mean E2E (s)": ratio(sum(e2e), len(e2e)),
            "P-RLD-MD share": ratio(sum(r.pipeline == "P-RLD-MD" for r in ok), len(ok))}


def _agree(sim: float | None, real: float | None, tol: float) -> bool:
    if sim is None or real is None or sim == 0:
        return sim == real
    return abs(real / sim - 1.0) <= tol


def compare(spec: DeploymentSpec, sim: SideResult, real: SideResult, tol: float = TOLERANCE) -> FidelityReport:
    def r4(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    a, b = _stats(sim), _stats(real)
    metrics = [Metric(k, r4(a[k]), r4(b[k]), r4(ratio(b[k], a[k])), _agree(a[k], b[k], tol)) for k in a]
    dp = f" x DP {spec.data_parallel}" if spec.data_parallel > 1 else ""
    ep = f", EP {spec.expert_parallel}" if spec.expert_parallel else ""
    by_rid = {r.rid: r for r in real.requests}
    pairs = [(s, by_rid[s.rid]) for s in sim.requests if s.rid in by_rid]
    same_pipeline = sum(s.pipeline is not None and s.pipeline == r.pipeline for s, r in pairs)
    same_ids = sum(s.error is None and s.output_digest == r.output_digest for s, r in pairs)
    return FidelityReport(
        model=spec.model, hardware=f"A {spec.a_hardware}, B {spec.b_hardware} (TP {spec.tensor_parallel}{dp}{ep})",
        wan=f"{spec.wan_gbps:g} Gbps, {2 * spec.wan_latency_ms:g} ms RTT",
        requests=len(sim.requests), completed_sim=sum(r.error is None for r in sim.requests),
        completed_real=sum(r.error is None for r in real.requests), same_output_ids=same_ids,
        same_pipeline=same_pipeline, leaked_sim=sim.leaked_blocks + sim.leaked_pins,
        leaked_real=real.leaked_blocks + real.leaked_pins, tolerance=tol, metrics=metrics,
        sim_wall_s=round(sim.wall_s, 2), real_wall_s=round(real.wall_s, 2))


def run_fidelity(workload: Workload, spec: DeploymentSpec = DeploymentSpec(), *, directory: Path | None = None,
                 tolerance: float = TOLERANCE, **play_kw) -> FidelityRun:
    """Write the config, simulate (on a virtual clock), serve for real and replay, compare; `directory`
    keeps the config and the node logs (default: a temporary directory, removed afterwards)."""
    d = directory if directory is not None else Path(tempfile.mkdtemp(prefix="pddgw-fidelity-"))
    d.mkdir(parents=True, exist_ok=True)
    try:
        ports = free_ports()
        path = spec.toml().write(d / "config.toml", ports)
        cfg = load_config(path)
        t0 = time.perf_counter()
        run = run_virtual(run_deployment(cfg, workload.conversations, workload.shared_prefix))
        sim = SideResult(run.requests, time.perf_counter() - t0, run.leaked_blocks, run.leaked_pins)
        real = serve_and_play(path, ports, workload, d, **play_kw)
        return FidelityRun(compare(spec, sim, real, tolerance), sim, real)
    finally:
        if directory is None:
            shutil.rmtree(d, ignore_errors=True)


def table(rep: FidelityReport) -> str:
    rows = [(m.name, m.sim, m.real, m.ratio, m.within) for m in rep.metrics]
    head = (f"{rep.model} on {rep.hardware}; WAN {rep.wan}; {rep.requests} requests "
            f"(completed: sim {rep.completed_sim}, real {rep.completed_real}; same output ids "
            f"{rep.same_output_ids}/{rep.requests}; same pipeline {rep.same_pipeline}/{rep.requests})")
    tail = (f"KV blocks + pins left in use: simulated {rep.leaked_sim}, real {rep.leaked_real}; "
            f"wall time: simulated {rep.sim_wall_s:.1f} s, real {rep.real_wall_s:.1f} s")
    return "\n".join([head, "", format_table(
        ["metric", "simulated", "real", "real/sim", f"within {rep.tolerance:.0%}"], rows), "", tail])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(p)
    add_options(p, WorkloadSpec)
    add_options(p, DeploymentSpec)
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--keep", type=Path, help="keep config.toml and the node logs in this directory")
    args = p.parse_args(argv)
    setup_logging("warning")
    workload = from_options(WorkloadSpec, args).workload()
    rep = run_fidelity(workload, from_options(DeploymentSpec, args), directory=args.keep,
                       tolerance=args.tolerance).report
    emit(rep, args.json, table(rep))
    sound = (rep.completed_sim == rep.completed_real == rep.same_output_ids == rep.requests
             and not rep.leaked_sim and not rep.leaked_real)
    return 0 if sound and all(m.within for m in rep.metrics) else 1


if __name__ == "__main__":
    raise SystemExit(main())
