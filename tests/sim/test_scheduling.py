"""Scheduling rules in the paper's regime, on the virtual clock (exact, no wall-clock windows).

The real router, policy, workers and shaped in-process links run with
cost-model engines (`pddgw.sim`), so times are exact and repeatable.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from pddgw.config import PolicyConfig
from pddgw.engines.types import SamplingParams
from pddgw.deploy.serve import Embedded
from pddgw.sim.clock import run_virtual
from pddgw.sim.scenario import deployment_config, load_scenario

TINY = Path(__file__).parent / "tiny.toml"


def pdd_config(policy: PolicyConfig, wan_gbps: float = 1.0, rld_count: int = 1):
    sc = load_scenario(TINY)
    dep = sc.deployment("pdd")
    nodes = tuple(dataclasses.replace(g, count=rld_count) if g.role == "rld" else g for g in dep.nodes)
    return deployment_config(sc, dataclasses.replace(dep, nodes=nodes, policy=policy), wan_gbps=wan_gbps)


def prompt(n: int, base: int = 1000) -> tuple[int, ...]:
    return tuple(base + (i * 7919) % 30000 for i in range(n))


async def serve(cfg, requests, gap_s: float = 0.0):
    """Run `requests` [(rid, prompt, max_tokens)] `gap_s` apart -> (outcomes by rid, router, embedded)."""
    emb = Embedded(cfg)
    side = await emb.start()
    out = {}

    async def one(i, rid, p, n):
        await asyncio.sleep(i * gap_s)

        async def emit(run):
            pass

        out[rid] = await side.router.run(rid, p, SamplingParams(max_tokens=n, seed=i), emit)

    try:
        await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
        await side.router.drain()
        leaked = sum(w.engine.stats().used_blocks for w in emb.workers.values())
        return out, side.router, emb, leaked
    finally:
        await emb.stop()


def state_ms(rec, name: str) -> float:
    return next(t for s, t, _ in rec.states if s == name)


def test_one_wan_round_trip_before_prefill_starts():
    """MD's open is its prefix answer: P starts one RTT (30 ms) after the request arrives."""
    cfg = pdd_config(PolicyConfig())

    async def main():
        out, router, emb, leaked = await serve(cfg, [("r1", prompt(1500), 16)])
        return out["r1"].record, leaked

    rec, leaked = run_virtual(main())
    # One 30 ms round trip to MD plus the serialization of the small control frames.
    assert state_ms(rec, "PREFILLING") == pytest.approx(30.0, abs=0.5)
    assert rec.pipeline == "P-RLD-MD" and leaked == 0


def test_a_full_rld_sends_the_next_request_over_the_wan():
    """One relay slot: the first long miss takes it (P-RLD-MD), the second waits for the WAN."""
    cfg = pdd_config(PolicyConfig(rld_max_relays=1))

    async def main():
        out, router, emb, leaked = await serve(cfg, [("a", prompt(1800), 24), ("b", prompt(1800, 5000), 24)],
                                               gap_s=0.05)
        return {k: (v.record.pipeline, v.record.route_reason) for k, v in out.items()}, leaked

    got, leaked = run_virtual(main())
    assert got == {"a": ("P-RLD-MD", "transfer_over_budget"), "b": ("P-MD", "rld_full")}
    assert leaked == 0


def test_the_relay_slot_is_free_again_after_the_handoff():
    cfg = pdd_config(PolicyConfig(rld_max_relays=1), wan_gbps=10.0)

    async def main():
        out, router, emb, leaked = await serve(cfg, [("a", prompt(1800), 64), ("b", prompt(1800, 5000), 24)],
                                               gap_s=3.0)
        rld = router.nodes["rld0"]
        return ({k: v.record.pipeline for k, v in out.items()}, out["a"].record.handoff_position,
                (rld.relays, rld.relay_tokens), leaked)

    pipelines, handed_at, relays, leaked = run_virtual(main())
    assert pipelines == {"a": "P-RLD-MD", "b": "P-RLD-MD"}
    assert handed_at is not None and 0 < handed_at < 64
    assert relays == (0, 0) and leaked == 0


def test_the_next_turn_supersedes_a_pending_alignment_and_keeps_what_arrived():
    """Turn 1's answer ends on RLD long before its KV reaches MD (1 Gbps); turn 2
    arrives mid-alignment: the alignment is dropped, and MD keeps the blocks that
    had arrived, so turn 2 finds them cached."""
    cfg = pdd_config(PolicyConfig(singular_max_share=0.0))
    turn1 = prompt(1800)

    async def main():
        emb = Embedded(cfg)
        side = await emb.start()
        router = side.router
        out = []

        async def emit(run):
            out.extend(run.ids)

        try:
            r1 = await router.run("t1", turn1, SamplingParams(max_tokens=16, seed=1), emit)
            pending = len(router.alignments)
            await asyncio.sleep(1.0)                    # about half of turn 1's KV is on MD by now
            turn2 = turn1 + tuple(out) + prompt(50, 9000)
            r2 = await router.run("t2", turn2, SamplingParams(max_tokens=16, seed=2), emit)
            await router.drain()
            leaked = sum(w.engine.stats().used_blocks for w in emb.workers.values())
            return r1, r2, pending, dict(router.alignments.counts), leaked
        finally:
            await emb.stop()

    r1, r2, pending, counts, leaked = run_virtual(main())
    assert (r1.record.pipeline, r1.record.tokens_by_role) == ("P-RLD-MD", (("rld", 16),))
    assert pending == 1
    # Turn 2's own alignment (its answer also ends on RLD) completes during the drain.
    assert counts == {"started": 2, "completed": 1, "superseded": 1, "failed": 0, "shed": 0}
    assert 0 < r2.cached_tokens < 1800 and r2.cached_tokens % 16 == 0
    assert leaked == 0


def test_foreground_never_waits_behind_background_on_the_wan():
    """A whole run with alignments in flight: the shared WAN wire's own accounting
    shows background bytes, and none serialized while a foreground frame waited."""
    from pddgw.sim import report
    from pddgw.sim.cluster import run_deployment
    from pddgw.sim.workload import agentic, shared_prefix

    sc = load_scenario(TINY)
    cfg = deployment_config(sc, sc.deployment("pdd"))
    run = run_virtual(run_deployment(cfg, agentic(sc.workload.agentic, sc.seed), shared_prefix(512, sc.seed)))
    qos = report.summarize(run, sc.slo)["wan_qos"]
    assert qos["bg_gb"] > 0 and qos["fg_gb"] > 0
    assert qos["bg_ahead_of_fg"] == 0
    assert run.leaked_blocks == 0 and run.leaked_pins == 0


def test_an_md_without_room_is_skipped_before_routing():
    """md0's pool cannot hold the prompt: its open (step 1, before routing) is refused for
    capacity, and the request opens on md1 instead, with a legal timeline."""
    sc = load_scenario(TINY)
    dep = sc.deployment("pdd")
    nodes = tuple(dataclasses.replace(g, count=2) if g.role == "md" else g for g in dep.nodes)
    cfg = deployment_config(sc, dataclasses.replace(dep, nodes=nodes, policy=PolicyConfig()), wan_gbps=1.0)
    small = dataclasses.replace(cfg.engine_for(cfg.nodes[-2]), num_blocks=8)
    cfg = dataclasses.replace(cfg, nodes=tuple(dataclasses.replace(n, engine=small) if n.name == "md0" else n
                                               for n in cfg.nodes))

    async def main():
        out, router, emb, leaked = await serve(cfg, [("r1", prompt(1500), 16)])
        return out["r1"], router.counts.redrives, leaked

    outcome, redrives, leaked = run_virtual(main())
    rec = outcome.record
    assert (rec.pipeline, rec.final_state.name, rec.output_tokens, rec.redrives) == ("P-RLD-MD", "FINISHED", 16, ())
    assert [s for s, _, _ in rec.states][:2] == ["RECEIVED", "ROUTED"]
    assert redrives == 1 and leaked == 0


def test_requests_refused_for_room_do_not_wake_each_other_without_end():
    """Three P-RLD requests, an RLD pool of one: a fits, b and c wait.  A refused request lets go
    of its P slot without waking the queue (it took that slot in the same attempt), so b and c
    do not retry each other in turn while a decodes: each retries when a request ends or after
    `retry_s`, and every one is served."""
    cfg = pdd_config(PolicyConfig(pipeline="P-RLD"))
    small = dataclasses.replace(cfg.engine_for(cfg.nodes[2]), num_blocks=200)     # 3,200 tokens
    cfg = dataclasses.replace(cfg, nodes=tuple(dataclasses.replace(n, engine=small) if n.role == "rld" else n
                                               for n in cfg.nodes))

    async def main():
        reqs = [(rid, prompt(1800, base), n) for rid, base, n in (("a", 1000, 400), ("b", 5000, 24), ("c", 9000, 24))]
        out, router, emb, leaked = await serve(cfg, reqs)
        return ({k: (v.record.pipeline, v.record.output_tokens) for k, v in out.items()},
                router.room.waited, router.counts.redrives, leaked)

    served, waits, redrives, leaked = run_virtual(main())
    assert served == {"a": ("P-RLD", 400), "b": ("P-RLD", 24), "c": ("P-RLD", 24)}
    # The head retries every retry_s (0.5 s) while a decodes its 400 tokens: 16 waits in all
    # (b and c waking each other, as before, made 112).
    assert (waits, redrives, leaked) == (16, 0, 0)
