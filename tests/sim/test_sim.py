"""`pddgw sim`: the virtual clock, determinism, the same tokens on every path, goodput, scenarios."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from pddgw.config import ConfigError, NetConfig, PolicyConfig, ShapingConfig
from pddgw.sim.costmodel_engine import CostModelEngine
from pddgw import messages as m
from pddgw.net.inproc import InProcNetwork, wire_size
from pddgw.sim import clock, report
from pddgw.sim.clock import run_virtual
from pddgw.sim.cluster import run_deployment, token_digest
from pddgw.sim.report import bisection_rates
from pddgw.sim.run import _overrides, simulate
from pddgw.sim.run import parser as sim_parser
from pddgw.sim.scenario import TraceSpec, deployment_config, deployment_price, load_scenario
from pddgw.sim.workload import agentic, load_trace, shared_prefix

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
TINY = HERE / "tiny.toml"


def test_a_ten_second_shaped_transfer_takes_ten_virtual_seconds_and_no_wall_time(monkeypatch):
    shape = ShapingConfig(name="wan", gbps=0.008, latency_ms=20.0)       # 8 Mbit/s, 20 ms one way
    span = m.KVSpan("r", 0, 1, 0, 1000, "bfloat16", (1, 2, 1000, 5, 500), virtual=True)   # 10 MB of KV
    chunk = m.KVChunk(span, b"", last=True)

    async def main() -> float:
        net = InProcNetwork(NetConfig(links=(shape,)))
        got: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        async def handler(link, msg):
            got.set_result(asyncio.get_running_loop().time())

        net.listen("b", handler)
        link = await net.connect("a", "b", shaping="wan")
        t0 = asyncio.get_running_loop().time()
        await link.send(chunk)
        arrived = await got - t0
        await net.close()
        return arrived

    # No wall time: the loop never waits in the real selector (with nothing but its self-pipe
    # registered it does not poll it at all; any poll would be non-blocking).
    waits: list[float | None] = []
    real_select = clock._VirtualSelector.__bases__[0].select

    def select(self, timeout=None):
        waits.append(timeout)
        return real_select(self, timeout)

    monkeypatch.setattr(clock._VirtualSelector.__bases__[0], "select", select)
    arrived = run_virtual(main())
    assert set(waits) <= {0}
    assert span.nbytes == 10_000_000
    # Serialization of every wire byte at 8 Mbit/s, then the one-way latency (1 us clock).
    assert arrived == pytest.approx(wire_size(chunk) * 8 / 8e6 + 0.020, abs=2e-6)
    assert 10.0 < arrived < 10.03


def test_links_sharing_a_wan_wire_queue_behind_each_other():
    shape = ShapingConfig(name="wan", gbps=0.008, shared=True)
    span = m.KVSpan("r", 0, 1, 0, 100, "bfloat16", (1, 2, 100, 5, 500), virtual=True)   # 1 MB

    async def main() -> list[float]:
        net = InProcNetwork(NetConfig(links=(shape,)))
        times: list[float] = []

        async def handler(link, msg):
            times.append(round(asyncio.get_running_loop().time(), 3))

        net.listen("b1", handler)
        net.listen("b2", handler)
        l1 = await net.connect("a1", "b1", shaping="wan", groups=("A", "B"))
        l2 = await net.connect("a2", "b2", shaping="wan", groups=("A", "B"))
        await asyncio.gather(l1.send(m.KVChunk(span, b"")), l2.send(m.KVChunk(span, b"")))
        while len(times) < 2:
            await asyncio.sleep(0.1)
        util = net.shapers[("wan", "A", "B")].bytes_booked
        await net.close()
        return [*times, util]

    t1, t2, booked = run_virtual(main())
    assert (t1, t2) == (1.0, 2.0)       # one 8 Mbit/s wire: the second MB waits for the first
    # The two chunks, and a few heartbeat frames.
    assert 0 <= booked - 2 * wire_size(m.KVChunk(span, b"")) < 1000


def test_same_scenario_and_seed_give_identical_json_across_processes(tmp_path):
    outs = []
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        proc = subprocess.run([sys.executable, "-m", "pddgw.cli", "sim", "--scenario", str(TINY), "--json",
                               "--jobs", "1"], capture_output=True, env=env, cwd=ROOT, timeout=240)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        outs.append(proc.stdout)
        assert b"requests per wall-clock second" in proc.stderr
    assert outs[0] == outs[1]
    rep = orjson.loads(outs[0])
    deps = rep["variants"][0]["deployments"]
    assert set(deps) == {"same-dc", "pdd"}
    for d in deps.values():
        assert d["requests"] == 12 and d["failed"] == 0
        assert d["leaked_blocks"] == 0 and d["leaked_pins"] == 0
        assert d["output_tokens"] == 12 * 24
    assert deps["same-dc"]["pipeline_share"] == {"P-MD": 1.0} and deps["same-dc"]["wan_kv_gb"] == 0.0
    assert deps["pdd"]["cost_vs_baseline"] == pytest.approx((2 * 3.00 + 3.75) / (2 * 3.00), abs=1e-4)


@pytest.mark.parametrize("pipeline,handoff", [("P-MD", "auto"), ("P-RLD-MD", "one-shot"),
                                              ("P-RLD-MD", "catch-up"), ("P-RLD", "auto")])
def test_every_path_gives_the_same_tokens(pipeline, handoff):
    sc = load_scenario(TINY)
    dep = dataclasses.replace(sc.deployment("pdd"), policy=PolicyConfig(
        pipeline=pipeline, handoff_mode=handoff, catchup_threshold=4, catchup_threshold_md_loaded=2,
        catchup_max_chunk=8))
    # A 100 Gbps WAN: MD has the prompt KV (~270 MB) while RLD is still decoding, so handoffs happen.
    cfg = deployment_config(sc, dep, wan_gbps=100.0)
    convs = agentic(sc.workload.agentic, sc.seed)
    run = run_virtual(run_deployment(cfg, convs, shared_prefix(512, sc.seed)))
    model = CostModelEngine.from_config(cfg, cfg.engine_for(cfg.nodes[1]))[0]
    assert len(run.requests) == 12
    for r in run.requests:
        seed = convs[r.conversation].seed + r.turn
        assert r.error is None and r.pipeline == pipeline
        assert r.output_digest == token_digest([model.token_at(seed, i) for i in range(24)])
        if pipeline == "P-RLD-MD":
            assert r.rld_tokens + r.md_tokens == 24
    assert run.leaked_blocks == 0 and run.leaked_pins == 0
    if pipeline == "P-RLD-MD":
        assert any(r.handoff_mode == handoff for r in run.requests)


def test_goodput_bisection_finds_the_highest_passing_rate():
    probed = []

    def probe(rate: float) -> float:
        probed.append(rate)
        return 1.0 if rate <= 3.0 else 0.5

    goodput, points = report.sla_goodput(probe, 0.9, 1.0, 16.0, 6)
    # 4 geometric bisections of [1, 16]: 4 (fail), 2 (pass), 2.83 (pass), 3.36 (fail); neither end
    # is probed, a midpoint having passed and one failed (the answer of probing lo first, hi second).
    assert [round(r, 4) for r in probed] == [4.0, 2.0, 2.8284, 3.3636]
    assert round(goodput, 4) == 2.8284 and len(points) == 4
    # Every midpoint fails: lo last, and 0.0 when it fails too.
    assert [round(r, 4) for r, _ in report.sla_goodput(lambda r: 0.0, 0.9, 1.0, 16.0, 6)[1]] == [
        4.0, 2.0, 1.4142, 1.1892, 1.0]
    assert report.sla_goodput(lambda r: 0.0, 0.9, 1.0, 16.0, 6)[0] == 0.0
    assert report.sla_goodput(lambda r: float(r < 1.1), 0.9, 1.0, 16.0, 6)[0] == 1.0
    # Every midpoint passes: hi last, and it is the answer when it passes too.
    assert [r for r, _ in report.sla_goodput(lambda r: 1.0, 0.9, 1.0, 16.0, 4)[1]] == [4.0, 8.0, 16.0]
    assert report.sla_goodput(lambda r: 1.0, 0.9, 1.0, 16.0, 4)[0] == 16.0
    assert report.sla_goodput(lambda r: float(r < 10), 0.9, 1.0, 16.0, 4)[0] == 8.0
    # Whatever the order, a monotone attainment's answer is the highest passing rate of the grid.
    grid = bisection_rates(1.0, 16.0, 6)
    for passing in [0.5, *grid, *(r * 1.01 for r in grid), 99.0]:
        assert report.sla_goodput(lambda r: float(r <= passing), 0.9, 1.0, 16.0, 6)[0] == max(  # noqa: B023
            (r for r in grid if r <= passing), default=0.0)
    assert report.bcr(11.5, 95.5, 9.0, 100.0) == pytest.approx((11.5 / 95.5) / (9.0 / 100.0))


def test_nearest_rank_percentiles():
    xs = [float(i) for i in range(1, 101)]
    assert (report.percentile(xs, 50), report.percentile(xs, 90), report.percentile(xs, 99)) == (50.0, 90.0, 99.0)
    assert report.percentile([], 50) is None


def test_agentic_prompts_keep_the_drawn_share_of_the_previous_turn():
    sc = load_scenario(TINY)
    from pddgw.sim.workload import PromptBuilder

    conv = agentic(sc.workload.agentic, 1)[0]
    pb = PromptBuilder(conv, shared_prefix(512, 1))
    p0 = pb.prompt(0)
    assert len(p0) == 2048 and p0[:512] == shared_prefix(512, 1)
    answer = tuple(range(40000, 40024))
    pb.answered(p0, answer)
    p1 = pb.prompt(1)
    keep = int(conv.turns[1].hit * 2048)
    assert len(p1) == 2048 and p1[:keep] == (p0 + answer)[:keep] and p1[keep] != (p0 + answer)[keep]


def test_a_simulated_prompt_comes_with_its_hashes_and_id_bounds(monkeypatch):
    """With a block size the builder notes each prompt's chained hashes (those kept of the
    previous turn's, then the rest chained on) and bounds its ids: exactly what hashing and
    scanning the prompt afresh give, without either."""
    from pddgw.core import ids
    from pddgw.engines import prompt_hashes as ph
    from pddgw.engines.block_manager import chain_hashes
    from pddgw.sim.workload import PromptBuilder

    sc = load_scenario(TINY)
    conv = agentic(sc.workload.agentic, 1)[0]
    pb = PromptBuilder(conv, shared_prefix(512, 1), block_size=16)
    answer = tuple(range(40000, 40030))
    for k in range(len(conv.turns)):
        p = pb.prompt(k)
        assert ph.MEMO.holds(p, tag=16) and ids.MEMO.holds(p)
        assert ph.prompt_hashes(p, 16) == tuple(chain_hashes(p, 16))
        ok, lo, hi = ids.id_facts(p)
        assert ok and lo <= min(p) and hi >= max(p) and hi <= 40029
        pb.answered(p, answer)
    assert len(conv.turns) >= 2
    # A noted bound looser than a limit is decided on the values themselves.
    assert ids.in_range(p, 40000) is (max(p) < 40000)
    # Without a block size (a client over WebSocket: its prompts are hashed where they land) nothing is noted.
    plain = PromptBuilder(conv, shared_prefix(512, 1)).prompt(0)
    assert not ph.MEMO.holds(plain, tag=16) and not ids.MEMO.holds(plain)


def test_mooncake_trace_blocks_share_prefixes():
    trace = ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl.gz"
    convs = load_trace(trace, 3)
    assert [c.start_s for c in convs] == [0.0, 0.0, 0.04]
    assert [len(c.turns[0].prompt) for c in convs] == [40160, 36640, 23769]
    assert [c.turns[0].max_tokens for c in convs] == [6, 4, 3]


def test_a_burst_trace_gathers_each_span_at_its_start(tmp_path):
    """`burst_s` moves every request of a span to the span's start (after `speed`); nothing else."""
    trace = tmp_path / "t.jsonl"
    stamps_ms = [0, 900, 1000, 2500, 3999, 4000]
    trace.write_bytes(b"".join(orjson.dumps({"timestamp": t, "input_length": 600, "output_length": 2,
                                            "hash_ids": [i, 99]}) + b"\n" for i, t in enumerate(stamps_ms)))
    plain = load_trace(trace)
    assert [c.start_s for c in plain] == [0.0, 0.9, 1.0, 2.5, 3.999, 4.0]
    assert [c.start_s for c in load_trace(trace, burst_s=2.0)] == [0.0, 0.0, 0.0, 2.0, 2.0, 4.0]
    assert [c.start_s for c in load_trace(trace, speed=2.0, burst_s=1.0)] == [0.0, 0.0, 0.0, 1.0, 1.0, 2.0]
    assert [c.turns for c in load_trace(trace, burst_s=2.0)] == [c.turns for c in plain]
    sc = _overrides(load_scenario(TINY), sim_parser().parse_args(
        ["--scenario", str(TINY), "--trace", str(trace), "--trace-burst-s", "30", "--trace-speed", "4"]))
    assert (sc.workload.kind, sc.workload.trace.burst_s, sc.workload.trace.speed) == ("trace", 30.0, 4.0)
    with pytest.raises(ValueError, match="burst_s must be >= 0"):
        TraceSpec(path="t", burst_s=-1.0)

    # A bad value from the command line names its flag as well as the field.
    for flags, message in ((["--trace-burst-s", "-3"], "--trace-burst-s -3.0: burst_s must be >= 0"),
                           (["--trace-speed", "0"], "--trace-speed 0.0: speed must be > 0"),
                           (["--rate", "-2"], "--rate -2.0: requests must be >= 1 and rate > 0"),
                           (["--rate", "0"], "--rate 0.0: requests must be >= 1 and rate > 0"),
                           (["--requests", "0"], "--requests 0: requests must be >= 1 and rate > 0")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            _overrides(load_scenario(TINY), sim_parser().parse_args(["--scenario", str(TINY), *flags]))


def test_scenario_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("rate = 2.0", "rate = 2.0\nbogus = 1"))
    with pytest.raises(ConfigError, match=r"bad.toml: workload.agentic.bogus: unknown key"):
        load_scenario(bad)
    bad.write_text(TINY.read_text().replace('hardware = "H200-SXM"', 'hardware = "B300"'))
    with pytest.raises(ConfigError, match=r"deployments\[1\].nodes\[2\].*hardware 'B300'"):
        load_scenario(bad)


def test_the_dense_contrast_scenario_prices_pdd_below_same_dc_pd():
    sc = load_scenario(ROOT / "scenarios" / "dense70b.toml")
    assert (sc.name, sc.model) == ("dense70b", "llama3.1-70b")
    same, same_gpus = deployment_price(sc, sc.deployment("same-dc-pd"))
    pdd, pdd_gpus = deployment_price(sc, sc.deployment("pdd"))
    assert (same_gpus, pdd_gpus) == (88, 76)
    assert 0.929 <= pdd / same <= 0.965          # the paper: 3.5-7.1 % cheaper
    cfg = deployment_config(sc, sc.deployment("pdd"), 100.0)
    assert [n.role for n in cfg.nodes].count("md") == 4
    assert next(s for s in cfg.net.links if s.name == "wan").gbps == 100.0


@pytest.mark.parametrize("affinity", [True, False])
def test_prefix_affinity_sends_each_turn_where_its_prefix_is_cached(affinity):
    """Two MDs, P-MD: with affinity every follow-up turn hits exactly the blocks it kept."""
    sc = load_scenario(TINY)
    dep = sc.deployment("pdd")
    nodes = tuple(dataclasses.replace(g, count=2) if g.role == "md" else g for g in dep.nodes)
    dep = dataclasses.replace(dep, nodes=nodes, policy=PolicyConfig(pipeline="P-MD", prefix_affinity=affinity))
    cfg = deployment_config(sc, dep, wan_gbps=100.0)
    convs = agentic(sc.workload.agentic, sc.seed)
    run = run_virtual(run_deployment(cfg, convs, shared_prefix(512, sc.seed)))
    follow = [r for r in run.requests if r.turn > 0]
    exact = [r.md_cached_tokens == int(r.target_hit * 2048) // 16 * 16 for r in follow]
    assert len(follow) == 8 and run.leaked_blocks == 0 and run.leaked_pins == 0
    if affinity:
        assert all(exact)
    else:
        assert not all(exact)        # least-loaded choice sends some turns to the other MD


def test_plots_are_png_files(tmp_path):
    from pddgw.sim.plots import write_plots

    sc = load_scenario(TINY)
    sc = dataclasses.replace(sc, workload=dataclasses.replace(
        sc.workload, agentic=dataclasses.replace(sc.workload.agentic, requests=4)))
    rep, private = simulate(sc, jobs=1)
    paths = write_plots(rep, private, tmp_path)
    assert [p.name for p in paths] == ["ttft_cdf_configured.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_router_knows_each_nodes_dp_ranks():
    """The P choice spreads a P's backlog over its DP ranks (policy.prefill_wait_tokens): the
    router's handle of each node carries its engine's ranks."""
    sc = load_scenario(TINY)
    dep = sc.deployment("same-dc")
    nodes = tuple(dataclasses.replace(g, count=2, data_parallel=4 if g.role == "prefill" else 2)
                  for g in dep.nodes)
    cfg = deployment_config(sc, dataclasses.replace(dep, nodes=nodes))
    got: dict[str, int] = {}

    async def main() -> None:
        from pddgw.deploy.serve import Embedded

        emb = Embedded(cfg)
        side = await emb.start()
        got.update({n.role + "/" + name: n.dp_ranks for name, n in side.router.nodes.items()})
        await emb.stop()

    run_virtual(main())
    assert sorted(got.values()) == [2, 2, 4, 4] and all(v == 4 for k, v in got.items() if k.startswith("prefill"))


def test_prefix_queries_leave_no_pins_behind_while_requests_decode():
    """Two Ps and two MDs asked per request: losers are released at once, the chosen P after its prefill."""
    sc = load_scenario(TINY)
    dep = sc.deployment("same-dc")
    nodes = tuple(dataclasses.replace(g, count=2) for g in dep.nodes)
    cfg = deployment_config(sc, dataclasses.replace(dep, nodes=nodes))
    seen: list[int] = []

    async def main() -> None:
        from pddgw.deploy.serve import Embedded

        emb = Embedded(cfg)
        side = await emb.start()
        from pddgw.engines.types import SamplingParams

        async def emit(run):
            if run.position == 10:       # mid-decode: P is done, MD decodes
                seen.append(sum(w.engine.stats().pins for w in emb.workers.values()))

        prompt = tuple(range(1000, 1000 + 600))
        await side.router.run("r1", prompt, SamplingParams(max_tokens=24), emit)
        await emb.stop()

    run_virtual(main())
    assert seen == [0]


def test_goodput_search_and_one_run_per_same_dc_deployment():
    sc = load_scenario(TINY)
    from pddgw.sim.scenario import GoodputSpec

    sc = dataclasses.replace(sc, wan_gbps=(1.0, 100.0),
                             goodput=GoodputSpec(seconds=4.0, warmup_s=1.0, rate_min=0.5, rate_max=4.0, probes=3))
    rep, private = simulate(sc, jobs=1)
    # main + goodput for same-dc once; for pdd once per WAN.
    assert sorted(name for name, _, _ in private["runs"]) == [
        "goodput pdd @ 1 Gbps", "goodput pdd @ 100 Gbps", "goodput same-dc",
        "main pdd @ 1 Gbps", "main pdd @ 100 Gbps", "main same-dc"]
    v1, v100 = (v["deployments"] for v in rep["variants"])
    assert v1["same-dc"] == v100["same-dc"]
    for d in (v1["same-dc"], v1["pdd"], v100["pdd"]):
        probes = d["goodput_probes"]
        # The midpoint, then rate_max if it passed, else rate_min (report.sla_goodput).
        rates = [p["rate"] for p in probes]
        assert rates[:1] == [1.4142] and rates[1:] in ([0.5], [4.0])
        assert all(p["achieved_rps"] > 0 for p in probes)
        # Each probe's window is the 4 s of arrivals after a 1 s warm-up; within SLO <= arrived.
        assert all(p["slo_rps"] <= p["arrival_rps"] and p["slo_rps"] == pytest.approx(
            p["attainment"] * p["arrival_rps"], abs=1e-3) for p in probes)
        passing = [p for p in probes if p["attainment"] >= 0.9]
        best = max(passing, key=lambda p: p["rate"]) if passing else None
        assert d["goodput_offered_rps"] == (best["rate"] if best else 0.0)
        assert d["goodput_rps"] == (best["slo_rps"] if best else 0.0)
    assert v1["same-dc"]["bcr_vs_baseline"] in (1.0, None)
