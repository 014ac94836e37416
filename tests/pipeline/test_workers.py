"""P, RLD and MD workers wired directly (no transport): the PDD data paths.

Three engines on the tiny float64 model (clear margins, so extends and single
decodes agree exactly); MD uses another block size than P and RLD.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import pytest
import torch

from pddgw.config import EngineConfig
from pddgw.core.tokens import TokenRun
from pddgw.engines.async_engine import AsyncEngine
from pddgw.engines.block_manager import chain_hashes
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import SamplingParams
from pddgw.engines.weights import build_tiny
from pddgw.pipeline.decode import DecodeWorker
from pddgw.pipeline.ordering import StreamMerger
from pddgw import messages as m
from pddgw.pipeline.handoff import relay_handoff
from pddgw.pipeline.prefill import KVTarget, PrefillWorker


@pytest.fixture(scope="module")
def model():
    return build_tiny(0, torch.float64, "cpu")


def engine(model, block_size):
    cfg = EngineConfig(num_blocks=256, block_size=block_size, max_num_batched_tokens=64)
    return TorchEngine(model, model.spec, cfg, torch.float64)


def reference(model, prompt, sp):
    e = engine(model, 16)
    from pddgw.engines.types import EngineRequest
    e.add_request(EngineRequest("ref", tuple(prompt), sp))
    out = []
    while e.has_work():
        for o in e.step():
            out += o.ids
    return out


class Cluster:
    """P + RLD (block 16) and MD (block 8), each engine on its own worker thread."""

    def __init__(self, model):
        self.p_eng, self.rld_eng, self.md_eng = engine(model, 16), engine(model, 16), engine(model, 8)
        self.events: dict[str, list[TokenRun]] = {"rld": [], "md": []}
        self.p = PrefillWorker(AsyncEngine(self.p_eng, "p"), chunk_bytes=8 * 1024)
        self.rld = DecodeWorker(AsyncEngine(self.rld_eng, "rld"), functools.partial(self._emit, "rld"))
        self.md = DecodeWorker(AsyncEngine(self.md_eng, "md"), functools.partial(self._emit, "md"))
        self.finished = asyncio.Event()

    async def _emit(self, role, ev: TokenRun):
        self.events[role].append(ev)
        if ev.done:
            self.finished.set()

    def target(self, name, worker: DecodeWorker, start, decode):
        async def send(chunks):
            for c in chunks:
                await worker.import_kv(c)
            return 0.0

        return KVTarget(name, start, send, lambda t0, lp: worker.kv_done(self.rid, t0, decode, lp))

    def merged(self):
        m = StreamMerger(self.rid)
        evs = sorted(((e, r) for r in ("rld", "md") for e in self.events[r]), key=lambda x: x[0].position)
        for ev, role in evs:
            m.push(dataclasses.replace(ev, role=role))
        return [t for run in m.emitted_runs for t in run.ids] if hasattr(m, "emitted_runs") else m

    async def stop(self):
        for w in (self.p, self.rld, self.md):
            await w.aeng.stop()
        for e in (self.p_eng, self.rld_eng, self.md_eng):
            e.check_integrity()
            assert e.stats().used_blocks == 0


def tokens_of(events):
    out, pos = [], None
    for ev in events:
        if pos is not None:
            assert ev.position == pos, "gap or overlap within one node's stream"
        out += ev.ids
        pos = ev.position + len(ev.ids)
    return out


@pytest.mark.parametrize("mode,threshold", [("one-shot", 64), ("catch-up", 3)])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_p_rld_md_handoff(model, mode, threshold, temperature):
    prompt = tuple(range(40, 40 + 70))
    # Far more tokens than the 8 awaited: RLD must still be decoding when the handoff starts,
    # even if the loop stalls for ~100 steps of the tiny model on a loaded machine.
    sp = SamplingParams(max_tokens=120, temperature=temperature, seed=99)
    expected = reference(model, prompt, sp)

    async def main():
        c = Cluster(model)
        c.rid = "r1"
        rld_cached = await c.rld.open("r1", prompt, sp)
        md_cached = await c.md.open("r1", prompt, sp)
        assert (rld_cached, md_cached) == (0, 0)
        res = await c.p.prefill("r1", prompt, sp, [c.target("rld", c.rld, rld_cached, True),
                                                   c.target("md", c.md, md_cached, False)])
        assert res.first_token == expected[0]
        assert res.targets["md"].sent_bytes == len(prompt) * c.p_eng.kv_layout.bytes_per_token()
        # Let RLD make some eager tokens, then hand off by token IDs.
        while sum(len(e.ids) for e in c.events["rld"]) < 8:
            await asyncio.sleep(0.001)
        rounds = []

        async def send(start, ids, final):
            rounds.append((start, start + len(ids), final))
            await c.md.extend("r1", start, ids, final)

        # Forced: rounds go on whatever RLD's rate (the tiny model out-decodes any round trip).
        msg = m.HandOff("r1", "md", mode, threshold, max(4, threshold), 8, 0.0, forced=True)
        at = (await asyncio.wait_for(relay_handoff(c.rld, msg, send), 30)).position
        await asyncio.wait_for(c.finished.wait(), 30)
        rld = tokens_of(c.events["rld"])
        md = tokens_of(c.events["md"])
        assert c.events["md"][0].position == at and len(rld) >= at
        assert rld[:at] + md == expected
        assert rounds[-1] == (rounds[-1][0], at, True) and (len(rounds) > 1) == (mode == "catch-up")
        assert [r[0] for r in rounds] == [1] + [r[1] for r in rounds[:-1]]     # contiguous from 1
        await c.stop()

    asyncio.run(main())


def test_p_md_only_missing_blocks_cross(model):
    """MD already holds the conversation's first turn: only the new tail is sent."""
    turn1 = tuple(range(50, 50 + 40))
    prompt = turn1 + tuple(range(60, 60 + 21))
    sp = SamplingParams(max_tokens=12)
    expected = reference(model, prompt, sp)

    async def main():
        c = Cluster(model)
        # Warm MD's prefix cache with turn 1 (a finished sequence stays cached).
        c.rid = "warm"
        await c.md.open("warm", turn1, sp)
        await c.p.prefill("warm", turn1, sp, [c.target("md", c.md, 0, True)])
        await asyncio.wait_for(c.finished.wait(), 30)
        c.finished.clear()
        c.events["md"].clear()
        hit = await c.md.aeng.call(c.md_eng.match_prefix, chain_hashes(prompt, 8), "q1")
        assert hit == 5                                    # 40 tokens of turn 1, in blocks of 8
        c.rid = "r2"
        md_cached = await c.md.open("r2", prompt, sp)
        assert md_cached == 40
        await c.md.aeng.call(c.md_eng.unpin, "q1")
        res = await c.p.prefill("r2", prompt, sp, [c.target("md", c.md, md_cached, True)])
        assert res.targets["md"].sent_bytes == (len(prompt) - 40) * c.p_eng.kv_layout.bytes_per_token()
        await asyncio.wait_for(c.finished.wait(), 30)
        assert tokens_of(c.events["md"]) == expected
        await c.stop()

    asyncio.run(main())


def test_p_cuts_each_targets_chunks_at_its_own_blocks(model):
    """A target whose blocks are twice P's gets chunks of its blocks, whole ones only until the
    prompt is complete, whatever P's steps computed (48 tokens a step); P's own size by default."""
    cfg = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=48)
    p_eng = TorchEngine(model, model.spec, cfg, torch.float64)
    # One P block a chunk: the chunk size alone would cut every target's at 16 tokens.
    p = PrefillWorker(AsyncEngine(p_eng, "p"), chunk_bytes=16 * p_eng.kv_layout.bytes_per_token())
    cut: dict[str, list[tuple[int, int]]] = {"rld": [], "md": []}

    def target(name, block_size):
        async def send(chunks):
            cut[name] += [(c.token_start, c.token_end) for c in chunks]
            return 0.0

        async def done(first, lp):
            pass

        return KVTarget(name, 0, send, done, block_size=block_size)

    async def main():
        await p.prefill("r", tuple(range(40, 190)), SamplingParams(max_tokens=4),
                        [target("rld", 0), target("md", 32)])
        await p.aeng.stop()

    asyncio.run(main())
    assert cut["rld"] == [(a, min(a + 16, 150)) for a in range(0, 150, 16)]
    assert cut["md"] == [(0, 32), (32, 64), (64, 96), (96, 128), (128, 150)]
    assert p_eng.stats().used_blocks == 0


@pytest.mark.parametrize("stop_first", [False, True])
def test_p_tells_the_first_token_before_any_target_has_its_kv(model, stop_first):
    """`on_first` gets the first token (and its logprobs) as P samples it, before any target's
    `done`; not when it ends the request (a stop token): the decoder emits it with the end."""
    prompt = tuple(range(30, 30 + 150))                   # three steps of 64 on P
    sp = SamplingParams(max_tokens=6, logprobs=2)
    expected = reference(model, prompt, sp)
    if stop_first:
        sp = dataclasses.replace(sp, stop_token_ids=(expected[0],))

    async def main():
        c = Cluster(model)
        c.rid = "f"
        await c.md.open("f", prompt, sp)
        seen: list[tuple] = []
        target = c.target("md", c.md, 0, True)
        done = target.done

        async def logged_done(first, lp):
            seen.append(("done", first, lp))
            await done(first, lp)

        async def on_first(first, lp):
            seen.append(("first", first, lp))

        target.done = logged_done
        res = await c.p.prefill("f", prompt, sp, [target], on_first)
        await asyncio.wait_for(c.finished.wait(), 30)
        lp = res.first_logprobs
        assert lp is not None and len(lp.top_ids) == 2
        told = [] if stop_first else [("first", expected[0], lp)]
        assert seen == told + [("done", expected[0], lp)]
        assert tokens_of(c.events["md"]) == (expected[:1] if stop_first else expected)
        await c.stop()

    asyncio.run(main())


def test_rld_finishes_locally_without_handoff(model):
    prompt = tuple(range(70, 100))
    sp = SamplingParams(max_tokens=15, temperature=0.7, seed=5)
    expected = reference(model, prompt, sp)

    async def main():
        c = Cluster(model)
        c.rid = "s"
        await c.rld.open("s", prompt, sp)
        await c.md.open("s", prompt, sp)
        await c.p.prefill("s", prompt, sp, [c.target("rld", c.rld, 0, True), c.target("md", c.md, 0, False)])
        await asyncio.wait_for(c.finished.wait(), 30)
        assert tokens_of(c.events["rld"]) == expected
        assert c.events["rld"][-1].reason == "length"
        assert await c.md.cancel("s")                      # MD never got the handoff: freed
        await c.stop()

    asyncio.run(main())


def test_redrive_from_emitted_tokens(model):
    prompt = tuple(range(33, 63))
    sp = SamplingParams(max_tokens=20, temperature=0.8, seed=3)
    expected = reference(model, prompt, sp)

    async def main():
        c = Cluster(model)
        c.rid = "d"
        await c.md.open_compute("d", prompt, sp, hold=True)
        await c.md.extend("d", 0, tuple(expected[:7]), True)
        await asyncio.wait_for(c.finished.wait(), 30)
        assert c.events["md"][0].position == 7
        assert tokens_of(c.events["md"]) == expected[7:]
        await c.stop()

    asyncio.run(main())


def test_every_sampling_field_crosses_the_wire():
    """A request's sampling parameters reach P and the decoders whole (min_p once got lost)."""
    from pddgw.net import frames
    from pddgw import messages as m

    sp = SamplingParams(max_tokens=9, temperature=0.7, top_k=5, top_p=0.9, seed=11, stop_token_ids=(3, 4),
                        ignore_eos=True, min_p=0.05, logprobs=2)
    for msg in (m.Submit(request_id="r", kv="import", hold=False, prompt=(1, 2), sampling=sp),
                m.Prefill(request_id="r", targets=("md0",), starts=(0,), prompt=(1, 2), holds=(False,),
                           sampling=sp)):
        assert frames.decode(frames.encode_bytes(msg)).msg.sampling == sp
    with pytest.raises(ValueError, match=r"min_p must be a number in \[0, 1\]"):
        SamplingParams(min_p=1.5)


@pytest.mark.parametrize("path", ["emit_now", "emit_many"])
def test_one_emission_per_engine_step_carries_every_requests_tokens(model, path):
    """The decode worker reads a step's outputs in one pass: one emission per step with each
    request's tokens of that step (at most one event each), in order, the same tokens as alone."""
    prompts = {"a": tuple(range(40, 70)), "b": tuple(range(90, 131))}
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=5)
    expected = {rid: reference(model, p, sp) for rid, p in prompts.items()}

    async def main():
        calls: list[list[TokenRun]] = []
        done = asyncio.Event()

        def record(events):
            calls.append(list(events))
            if sum(ev.done for evs in calls for ev in evs) == len(prompts):
                done.set()

        async def many(events):
            record(events)

        def now(events):
            record(events)
            return []                   # all sent within the call

        async def single(ev):
            raise AssertionError("every step's events go through the batched paths")

        aeng = AsyncEngine(engine(model, 16), "d")
        dec = DecodeWorker(aeng, single, many, now if path == "emit_now" else None)
        for rid, p in prompts.items():
            await dec.open_compute(rid, p, sp, hold=False)
        await asyncio.wait_for(done.wait(), 60)
        await aeng.stop()
        return calls

    calls = asyncio.run(main())
    for rid in prompts:
        assert tokens_of([ev for evs in calls for ev in evs if ev.request_id == rid]) == expected[rid]
    assert all(len({ev.request_id for ev in evs}) == len(evs) for evs in calls)
    assert any(len(evs) == 2 for evs in calls)      # both requests decoded in one step, emitted together
