"""Background MD alignment is bounded and shed first (pipeline/alignment.py, step 4).

On the virtual clock: the registry on its own with stand-in links (which
alignments are shed, in which order, what each shed costs: its cleanup, one
log line), then the real router and workers with cost-model engines (the
shed transfer stops, nothing leaks).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from structlog.testing import capture_logs

from pddgw.config import PolicyConfig
from pddgw.engines.types import SamplingParams
from pddgw import messages as m
from pddgw.pipeline.alignment import Alignments
from pddgw.deploy.serve import Embedded
from pddgw.pipeline.events import KvReady
from pddgw.sim.clock import run_virtual
from pddgw.sim.scenario import deployment_config, load_scenario

MD_NODE = object()


class Md:
    """MD's link: an Extend is answered when `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.extends: list[str] = []

    async def request(self, msg, timeout=None):
        self.extends.append(msg.request_id)
        await self.release.wait()
        return m.Ack(msg.request_id)


class Flight:
    """One finished request's remaining events and its release."""

    def __init__(self, rid: str, released: list[str]) -> None:
        self.rid = rid
        self.events: asyncio.Queue = asyncio.Queue()
        self._released = released

    async def cleanup(self) -> None:
        self._released.append(self.rid)


def test_the_backlog_bound_sheds_the_oldest_first_itself_last():
    async def main():
        al = Alignments(timeout=600.0, control_timeout=30.0, max_backlog_bytes=100)
        md = Md()
        released: list[str] = []
        flights = {}

        def start(rid: str, wan_bytes: int, ready: bool = False):
            fl = flights[rid] = Flight(rid, released)
            al.start(rid, None, None, md, MD_NODE, ready, (5, 6, 7), fl.events.get, fl.cleanup, wan_bytes)

        with capture_logs() as logs:
            start("a", 60)
            start("b", 30)
            await asyncio.sleep(0.001)
            steps = [(al.backlog_bytes, dict(al.counts))]
            start("c", 50)                   # 140 > 100: a (the oldest) goes, 80 is left
            await asyncio.sleep(0.001)
            steps.append((al.backlog_bytes, sorted(released)))
            start("d", 0, ready=True)        # MD has its KV: nothing to shed, it extends at once
            flights["b"].events.put_nowait(KvReady(MD_NODE))   # b's KV is in: its 30 bytes are no backlog
            await asyncio.sleep(0.001)
            steps.append((al.backlog_bytes, sorted(md.extends)))
            start("e", 120)                  # 170 > 100: c, then e itself (b and d book nothing)
            await asyncio.sleep(0.001)
            steps.append((al.backlog_bytes, sorted(released), len(al)))
            md.release.set()
            await al.drain()
        shed = [(e["request_id"], e["wan_bytes"], e["backlog_bytes"]) for e in logs
                if e["event"] == "md_alignment_shed"]
        return steps, shed, dict(al.counts), sorted(released), len(al)

    steps, shed, counts, released, left = run_virtual(main())
    assert steps[0] == (90, {"started": 2, "completed": 0, "superseded": 0, "failed": 0, "shed": 0})
    assert steps[1] == (80, ["a"])
    assert steps[2] == (50, ["b", "d"])
    assert steps[3] == (0, ["a", "c", "e"], 2)
    # One line per shed, oldest first, with the backlog it found.
    assert shed == [("a", 60, 140), ("c", 50, 170), ("e", 120, 120)]
    assert counts == {"started": 5, "completed": 2, "superseded": 0, "failed": 0, "shed": 3}
    assert released == ["a", "b", "c", "d", "e"] and left == 0


def test_an_alignment_larger_than_the_bound_is_shed_before_it_starts_and_still_released():
    async def main():
        al = Alignments(timeout=600.0, control_timeout=30.0, max_backlog_bytes=10)
        md = Md()
        released: list[str] = []
        fl = Flight("big", released)
        task = al.start("big", None, None, md, MD_NODE, False, (5,), fl.events.get, fl.cleanup, 11)
        await task
        return dict(al.counts), released, md.extends, task.cancelled()

    counts, released, extends, cancelled = run_virtual(main())
    assert counts == {"started": 1, "completed": 0, "superseded": 0, "failed": 0, "shed": 1}
    assert released == ["big"] and extends == [] and not cancelled


# ---------------------------------------------------------------------------
# The real router: two answers end on RLD before their KV reaches MD (1 Gbps)

TINY = Path(__file__).parent.parent / "sim" / "tiny.toml"
TOKENS = 1800


async def _two_alignments(bound: int):
    sc = load_scenario(TINY)
    dep = sc.deployment("pdd")
    policy = PolicyConfig(singular_max_share=0.0, alignment_max_backlog_bytes=bound)
    emb = Embedded(deployment_config(sc, dataclasses.replace(dep, policy=policy), wan_gbps=1.0))
    side = await emb.start()
    router = side.router
    loop = asyncio.get_running_loop()

    async def one(rid: str, delay: float, base: int) -> None:
        await asyncio.sleep(delay)

        async def emit(run):
            pass

        prompt = tuple(base + (i * 7919) % 30000 for i in range(TOKENS))
        await router.run(rid, prompt, SamplingParams(max_tokens=16, seed=1), emit, pipeline="P-RLD-MD")

    try:
        with capture_logs() as logs:
            await asyncio.gather(one("r1", 0.0, 1000), one("r2", 0.5, 5000))
            last_answer = loop.time()
            await router.drain()
        drain_s = loop.time() - last_answer
        leaked = sum(w.engine.stats().used_blocks for w in emb.workers.values())
        fg, bg = emb.workers["p0"].kv_sent()["md0"]
        shed = [e["request_id"] for e in logs if e["event"] == "md_alignment_shed"]
        return (dict(router.alignments.counts), shed, fg + bg, drain_s, leaked, router.kv_bytes_per_token,
                router.inflight())
    finally:
        await emb.stop()


def test_the_router_sheds_the_older_alignment_and_its_transfer_stops():
    """Each answer (16 tokens) ends on RLD within 0.3 s; each prompt's KV to MD is
    1800 x 128 KiB = 236 MB (1.9 s at 1 Gbps).  Unbounded, both align; bounded at
    300 MB, the second one's start sheds the first: P stops sending it at a frame
    boundary, and the background drain after the last answer is shorter."""
    full = run_virtual(_two_alignments(16 << 30))
    bounded = run_virtual(_two_alignments(300_000_000))
    counts, shed, md_bytes, drain_s, leaked, bpt, inflight = full
    need = TOKENS * bpt
    assert bpt == 131_072 and need == 235_929_600
    assert counts == {"started": 2, "completed": 2, "superseded": 0, "failed": 0, "shed": 0} and shed == []
    assert md_bytes == 2 * need                       # each prompt's KV crossed once, whole
    assert leaked == 0 and all(v == 0 for v in inflight.values())
    b_counts, b_shed, b_md_bytes, b_drain_s, b_leaked, _, b_inflight = bounded
    assert b_counts == {"started": 2, "completed": 1, "superseded": 0, "failed": 0, "shed": 1}
    assert b_shed == ["r1"]                           # the older one, logged once
    # r2's KV whole, and of r1's only the 8 MiB frames (64 tokens) sent before the shed.
    r1_bytes = b_md_bytes - need
    assert 0 < r1_bytes < need and r1_bytes % (64 * bpt) == 0
    assert b_drain_s < drain_s
    assert b_leaked == 0 and all(v == 0 for v in b_inflight.values())
