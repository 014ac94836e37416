"""Fidelity of the simulator: one deployment and one workload, simulated and in real time.

`python -m pddgw.bench.fidelity [--json] [--requests N] [--conversations N] [--keep DIR]`

The simulator's claim (DESIGN.md §8) is that it runs the real router,
policy, state machine and workers, only on a virtual clock.  Checked end to
end: one config.toml (router, P and RLD in cluster A, MD in cluster B;
cost-model engines of a real model shape on H100/H200 profiles; a shaped
`[[net.links]] name = "wan"`) runs (1) simulated, `run_virtual(
run_deployment(...))`, and (2) as four `python -m pddgw serve` processes
over real WebSocket links, the engines sleeping each step's modeled time,
while a client replays the same `pddgw.sim.workload` conversations in real
time (`pddgw.harness.replay`, after one warm-up request on an unrelated
prompt) and records what `pddgw.sim.cluster` records.  Compared: TTFT
P50/P99, RLD's share of output tokens, mean E2E and the P-RLD-MD share
(real / sim, within the tolerance, 15 % by default); every request's output
ids (by `token_digest`: the cost-model engine draws token i from (seed, i)
alone, so any difference is a bug); no KV block or pin left once idle.

The numbers can agree because what the user waits for is modeled time
(steps of a 32B model, tens of ms; WAN latency and serialization) and the
real run only adds Python, loopback sockets and scheduling (~0.1-1 ms a hop).
Pipeline choices that depend on timing (a request arriving while another's
KV is on the WAN sees a backlog) may differ; the report counts the requests
whose pipeline agrees.  `run_fidelity(...)` is the entry point for tests
(tests/sim/test_fidelity.py runs a CI-sized version).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pddgw.config import load_config
from pddgw.harness.cluster import ClusterToml, free_ports, toml_lines
from pddgw.harness.replay import SideResult, serve_and_play
from pddgw.logs import setup_logging
from pddgw.sim.clock import run_virtual
from pddgw.sim.cluster import run_deployment
from pddgw.sim.report import percentile
from pddgw.sim.workload import AgenticSpec, Conversation, agentic, shared_prefix
from pddgw.tables import add_output_args, emit, format_table, ratio

TOLERANCE = 0.15


# ---- the deployment -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """The small deployment both sides run (one config.toml)."""

    model: str = "qwen3-32b"                 # pddgw.sim.profiles.MODELS, or a shipped config.json
    a_hardware: str = "H100-SXM"             # P and RLD (cluster A)
    b_hardware: str = "H200-SXM"             # MD (cluster B)
    # Every instance's shape (config.CostModelConfig): a MoE such as deepseek-v4-flash needs
    # several GPUs to hold its weights.
    tensor_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: int = 0                 # 0: all of the instance's GPUs
    wan_gbps: float = 10.0
    wan_latency_ms: float = 15.0             # one way
    p_md_max_transfer_ms: float = 200.0
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Large frames: a virtual KV chunk carries no bytes, but each frame is one
    # message through Python on both ends.
    kv_frame_bytes: int = 64 << 20


def _engine_toml(spec: DeploymentSpec, hardware: str) -> str:
    return toml_lines(implementation="costmodel", num_blocks=0, block_size=spec.block_size,
                      max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                      enable_prefix_caching=True) + (
        f'\ncostmodel = {{ hardware = "{hardware}", tensor_parallel = {spec.tensor_parallel}, '
        f'data_parallel = {spec.data_parallel}, expert_parallel = {spec.expert_parallel}, '
        f'gpu_memory_utilization = 0.9 }}')


def write_config(directory: Path, spec: DeploymentSpec) -> tuple[Path, dict[str, int]]:
    """config.toml for `spec` in `directory`, on free loopback ports -> (path, ports by node)."""
    ports = free_ports()
    toml = ClusterToml(
        header="pddgw.bench.fidelity: the same deployment simulated and served by real processes.",
        model=toml_lines(profile=spec.model), engine=_engine_toml(spec, spec.a_hardware),
        server=toml_lines(request_timeout_s=300), log=toml_lines(level="warning"),
        net=toml_lines(kv_frame_bytes=spec.kv_frame_bytes, max_frame_bytes=spec.kv_frame_bytes,
                       inbound_buffer_bytes=max(spec.kv_frame_bytes, 64 << 20), heartbeat_s=1.0,
                       dead_after_s=10.0, request_timeout_s=30.0),
        wan=toml_lines(gbps=spec.wan_gbps, latency_ms=spec.wan_latency_ms),
        policy=toml_lines(p_md_max_transfer_ms=spec.p_md_max_transfer_ms),
        md_engine=_engine_toml(spec, spec.b_hardware))
    return toml.write(directory / "config.toml", ports), ports


# ---- the workload -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: list[Conversation]
    shared_prefix: tuple[int, ...]


def default_workload(requests: int = 48, conversations: int = 8, seed: int = 0, *, rate: float = 1.0,
                     context_tokens: int = 2048, output_tokens: int = 48,
                     shared_prefix_tokens: int = 1024) -> Workload:
    """Agentic conversations of `requests // conversations` turns each.

    Follow-up turns keep 95-100 % of the previous context (a tail of tens
    of tokens crosses the WAN: P-MD) or, one time in three, 25-50 % (a
    thousand-plus missing tokens, far over the P-MD budget: P-RLD-MD).
    """
    turns = max(1, requests // conversations)
    spec = AgenticSpec(requests=turns * conversations, rate=rate, context_tokens=context_tokens,
                       output_tokens=output_tokens, shared_prefix_tokens=shared_prefix_tokens,
                       turns_min=turns, turns_max=turns, think_s_min=0.5, think_s_max=2.0,
                       hit_buckets=((2.0, 0.95, 1.0), (1.0, 0.25, 0.5)))
    return Workload(agentic(spec, seed), shared_prefix(shared_prefix_tokens, seed))


# ---- simulated --------------------------------------------------------------------------


def simulate(config_path: Path, workload: Workload) -> SideResult:
    """The workload on the deployment of `config_path`, on a virtual clock."""
    cfg = load_config(config_path)
    t0 = time.perf_counter()
    run = run_virtual(run_deployment(cfg, workload.conversations, workload.shared_prefix))
    return SideResult(run.requests, time.perf_counter() - t0, run.leaked_blocks, run.leaked_pins)


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
    directory: Path


def _stats(side: SideResult) -> dict[str, float | None]:
    ok = [r for r in side.requests if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    rld = sum(r.rld_tokens for r in ok)
    out = rld + sum(r.md_tokens for r in ok)
    mix = Counter(r.pipeline for r in ok)
    p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
    return {
        "TTFT P50 (ms)": None if p50 is None else p50 * 1e3,
        "TTFT P99 (ms)": None if p99 is None else p99 * 1e3,
        "RLD token share": rld / out if out else None,
        "mean E2E (s)": sum(e2e) / len(e2e) if e2e else None,
        "P-RLD-MD share": mix["P-RLD-MD"] / len(ok) if ok else None,
    }


def _agree(sim: float | None, real: float | None, tol: float) -> bool:
    if sim is None or real is None:
        return sim is None and real is None
    if sim == 0:
        return real == 0
    return abs(real / sim - 1.0) <= tol


def compare(spec: DeploymentSpec, sim: SideResult, real: SideResult, tol: float = TOLERANCE) -> FidelityReport:
    a, b = _stats(sim), _stats(real)
    def r4(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    metrics = [Metric(k, r4(a[k]), r4(b[k]), r4(ratio(b[k], a[k])), _agree(a[k], b[k], tol)) for k in a]
    by_rid = {r.rid: r for r in real.requests}
    same_pipeline = sum(1 for r in sim.requests if r.rid in by_rid and r.pipeline is not None
                        and by_rid[r.rid].pipeline == r.pipeline)
    same_ids = sum(1 for r in sim.requests if r.rid in by_rid and r.error is None
                   and by_rid[r.rid].output_digest == r.output_digest)
    return FidelityReport(
        model=spec.model, hardware=f"A {spec.a_hardware}, B {spec.b_hardware} ({_shape(spec)})",
        wan=f"{spec.wan_gbps:g} Gbps, {2 * spec.wan_latency_ms:g} ms RTT",
        requests=len(sim.requests), completed_sim=sum(r.error is None for r in sim.requests),
        completed_real=sum(r.error is None for r in real.requests), same_output_ids=same_ids,
        same_pipeline=same_pipeline, leaked_sim=sim.leaked_blocks + sim.leaked_pins,
        leaked_real=real.leaked_blocks + real.leaked_pins, tolerance=tol, metrics=metrics,
        sim_wall_s=round(sim.wall_s, 2), real_wall_s=round(real.wall_s, 2))


def _shape(spec: DeploymentSpec) -> str:
    dp = f" x DP {spec.data_parallel}" if spec.data_parallel > 1 else ""
    ep = f", EP {spec.expert_parallel}" if spec.expert_parallel else ""
    return f"TP {spec.tensor_parallel}{dp}{ep}"


def run_fidelity(workload: Workload, spec: DeploymentSpec = DeploymentSpec(), *, directory: Path | None = None,
                 tolerance: float = TOLERANCE, **play_kw) -> FidelityRun:
    """Write the config, simulate, serve for real, replay, compare.

    `directory` keeps the config and the node logs (default: a temporary
    directory, removed afterwards).
    """
    owned = directory is None
    d = Path(tempfile.mkdtemp(prefix="pddgw-fidelity-")) if owned else directory
    d.mkdir(parents=True, exist_ok=True)
    try:
        path, ports = write_config(d, spec)
        sim = simulate(path, workload)
        real = serve_and_play(path, ports, workload, d, **play_kw)
        return FidelityRun(compare(spec, sim, real, tolerance), sim, real, d)
    finally:
        if owned:
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
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second once conversations overlap")
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    dflt = DeploymentSpec()
    p.add_argument("--model", default=dflt.model)
    p.add_argument("--tensor-parallel", type=int, default=dflt.tensor_parallel)
    p.add_argument("--data-parallel", type=int, default=dflt.data_parallel)
    p.add_argument("--expert-parallel", type=int, default=dflt.expert_parallel)
    p.add_argument("--wan-gbps", type=float, default=dflt.wan_gbps)
    p.add_argument("--wan-latency-ms", type=float, default=dflt.wan_latency_ms)
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--keep", type=Path, help="keep config.toml and the node logs in this directory")
    args = p.parse_args(argv)
    setup_logging("warning")
    spec = DeploymentSpec(model=args.model, tensor_parallel=args.tensor_parallel, data_parallel=args.data_parallel,
                          expert_parallel=args.expert_parallel, wan_gbps=args.wan_gbps,
                          wan_latency_ms=args.wan_latency_ms)
    wl = default_workload(args.requests, args.conversations, args.seed, rate=args.rate,
                          context_tokens=args.context_tokens, output_tokens=args.output_tokens,
                          shared_prefix_tokens=args.context_tokens // 2)
    run = run_fidelity(wl, spec, directory=args.keep, tolerance=args.tolerance)
    emit(run.report, args.json, table(run.report))
    rep = run.report
    sound = (rep.completed_sim == rep.completed_real == rep.same_output_ids == rep.requests
             and not rep.leaked_sim and not rep.leaked_real)
    return 0 if sound and all(m.within for m in rep.metrics) else 1


if __name__ == "__main__":
    raise SystemExit(main())
