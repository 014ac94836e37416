"""KV import: payloads received in place (leases), commits that never wait one step per
chunk, and the AsyncEngine's output entries at every point a request can be cancelled.

The tiny model in float64 (clear margins); block size 16, so one block of the
tiny model's KV is 16 tokens x 2 layers x 2 (K, V) x 2 heads x 16 x 8 bytes = 16 KiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import threading

import pytest
import torch

from pddgw.core.tokens import TokenRun
from pddgw.engines.async_engine import AsyncEngine
from pddgw.engines.base import Engine
from pddgw.engines.kv_pool import KVPool
from pddgw.engines.paged import LeaseState
from pddgw.engines.sequence import SeqStatus
from pddgw.engines.types import EngineRequest, KVChunk, KVSpan, RequestError, SamplingParams
from pddgw.pipeline.decode import DecodeWorker

from .conftest import make_engine, req, run_to_end

BS = 16
PROMPT = [(7 * i + 3) % 300 + 20 for i in range(100)]       # 6 full blocks + 4 tokens
SP = SamplingParams(max_tokens=8)


def _source(model, prompt=PROMPT):
    """An engine holding `prompt`'s KV (retained, like P) and its first token."""
    p = make_engine(model)
    p.add_request(EngineRequest("r", tuple(prompt), SamplingParams(max_tokens=1), retain_kv=True))
    first = run_to_end(p)["r"][0]
    return p, first


def _pool_blocks(engine):
    return {b for b in range(engine.blocks.num_blocks) if engine.blocks.ref_count(b)}


def _import(engine, rid="r", prompt=PROMPT):
    engine.add_request(EngineRequest(rid, tuple(prompt), SP, kv_source="import", hold=True))
    return engine.seqs[rid]


def _land(engine, chunk: KVChunk) -> KVChunk:
    """What a link with the engine's sink does: receive the payload where import_buffer says."""
    dest = engine.import_buffer(chunk.span)
    assert dest is not None
    dest[:] = chunk.payload
    return KVChunk(chunk.span, dest)


def _is_pool(engine, view) -> bool:
    base = engine.pool.data
    addr = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    return base.data_ptr() <= addr < base.data_ptr() + base.numel() * base.element_size()


def _finish_and_decode(engine, first, rid="r"):
    engine.finish_import(rid)
    engine.append_tokens(rid, (first,), final=True)
    return [first] + run_to_end(engine)[rid]


def test_one_block_chunks_land_in_the_pool_and_decode_exactly(tiny64):
    p, first = _source(tiny64)
    expected = make_engine(tiny64)
    expected.add_request(EngineRequest("r", tuple(PROMPT), SP))
    want = run_to_end(expected)["r"]

    d = make_engine(tiny64)
    seq = _import(d)
    for a in range(0, 96, BS):
        chunk = _land(d, p.export_kv("r", a, a + BS))
        assert _is_pool(d, chunk.payload)
        assert d.accept_kv(chunk)                       # committed in place, on this thread
    assert seq.imported.find(0) == 96 and not seq.leases
    tail = p.export_kv("r", 96, 100)                    # a partial block: staged, then copied
    staged = _land(d, tail)
    assert not _is_pool(d, staged.payload) and not d.accept_kv(staged)
    d.import_kv(staged)
    assert (d.kv_bytes_landed, d.kv_bytes_copied) == (6 * 16384, 4 * 1024)
    d.finish_import("r")
    assert bytes(d.export_kv("r", 0, 100).payload) == bytes(p.export_kv("r", 0, 100).payload)
    d.append_tokens("r", (first,), final=True)
    assert [first] + run_to_end(d)["r"] == want
    d.check_integrity()


def test_p_exports_straight_into_the_receivers_blocks(tiny64):
    """`export_kv_into` the receiver's `import_buffer` (what P does in-process): each whole block
    is gathered into the decoder's pool block, its one copy, and commits in place; the tail goes
    through staging; the decode is exact.  Any range, any pool layout, the base class's way (export,
    then copy) alike; a buffer of the wrong size or read-only is refused."""
    p, first = _source(tiny64)
    expected = make_engine(tiny64)
    expected.add_request(EngineRequest("r", tuple(PROMPT), SP))
    want = run_to_end(expected)["r"]
    d = make_engine(tiny64)
    _import(d)
    for a, b in [(a, a + BS) for a in range(0, 96, BS)] + [(96, 100)]:
        dest = d.import_buffer(p.kv_layout.span("r", (a, b)))
        chunk = p.export_kv_into("r", a, b, dest)
        assert chunk.payload is dest and chunk.span == p.export_kv("r", a, b).span
        assert _is_pool(d, dest) == (b - a == BS) == d.accept_kv(chunk)
        if b - a < BS:
            d.import_kv(chunk)
    assert (d.kv_bytes_landed, d.kv_bytes_copied) == (6 * 16384, 4 * 1024)
    assert _finish_and_decode(d, first) == want

    s = tiny64.spec
    layer_major = make_engine(tiny64)
    layer_major.pool = KVPool(s.num_layers, 128, BS, s.num_kv_heads, s.head_dim, torch.float64, "cpu",
                              block_major=False)
    layer_major.add_request(EngineRequest("r", tuple(PROMPT), SamplingParams(max_tokens=1), retain_kv=True))
    run_to_end(layer_major)
    for engine in (p, layer_major):
        for export in (type(engine).export_kv_into, Engine.export_kv_into):
            into = memoryview(bytearray(50 * 1024))                 # tokens [20, 70): four blocks
            assert bytes(export(engine, "r", 20, 70, into).payload) == bytes(p.export_kv("r", 20, 70).payload)
    with pytest.raises(ValueError, match="needs a writable contiguous byte view of 16384 bytes, got 1024"):
        p.export_kv_into("r", 0, 16, memoryview(bytearray(1024)))
    with pytest.raises(ValueError, match="readonly=True"):
        p.export_kv_into("r", 0, 16, memoryview(bytes(16384)))
    with pytest.raises(RequestError, match=r"tokens \[96, 120\) not in computed range \[0, 100\)"):
        p.export_kv_into("r", 96, 120, memoryview(bytearray(24 * 1024)))


def test_a_layer_major_pool_stages_and_copies_the_same_kv(tiny64):
    """The device layout (one K and V tensor per layer), here on CPU: no block is one run, so
    every payload is staged and copied; the KV and the outputs are the same."""
    p, first = _source(tiny64)
    expected = make_engine(tiny64)
    expected.add_request(EngineRequest("r", tuple(PROMPT), SP))
    want = run_to_end(expected)["r"]
    d = make_engine(tiny64)
    s = tiny64.spec
    d.pool = KVPool(s.num_layers, 128, BS, s.num_kv_heads, s.head_dim, torch.float64, "cpu", block_major=False)
    _import(d)
    for a, b in [(0, 16), (16, 48), (48, 100)]:
        chunk = _land(d, p.export_kv("r", a, b))
        assert not _is_pool_tensor(d, chunk.payload) and not d.accept_kv(chunk)
        d.import_kv(chunk)
    d.finish_import("r")
    assert bytes(d.export_kv("r", 0, 100).payload) == bytes(p.export_kv("r", 0, 100).payload)
    assert bytes(d.export_kv("r", 20, 70, 1, 2).payload) == bytes(p.export_kv("r", 20, 70, 1, 2).payload)
    d.append_tokens("r", (first,), final=True)
    assert [first] + run_to_end(d)["r"] == want
    d.check_integrity()


def _is_pool_tensor(engine, view) -> bool:
    addr = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    return any(t.data_ptr() <= addr < t.data_ptr() + t.numel() * t.element_size()
               for kv in engine.pool.caches for t in kv)


def test_what_gets_no_pool_view(tiny64):
    p, _ = _source(tiny64)
    d = make_engine(tiny64)
    # A finished import leaves its blocks cached: the next request's first 4 blocks are a hit.
    _import(d, "warm")
    for a, b in [*((a, a + BS) for a in range(0, 96, BS)), (96, 100)]:
        c = p.export_kv("r", a, b)
        d.import_kv(dataclasses.replace(c, span=dataclasses.replace(c.span, request_id="warm")))
    d.finish_import("warm")
    d.abort("warm")
    seq = _import(d, "x", PROMPT[:64] + [5] * 36)
    assert seq.num_cached_tokens == 64
    s = tiny64.spec
    assert p.export_kv("r", 0, BS).span == KVSpan.of("r", tokens=(0, BS), layers=(0, s.num_layers),
                                                     num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                                     dtype="float64")

    def view(request_id="x", tokens=(0, BS), layers=(0, s.num_layers), num_kv_heads=s.num_kv_heads,
             dtype="float64"):
        return d.import_buffer(KVSpan.of(request_id, tokens=tokens, layers=layers, num_kv_heads=num_kv_heads,
                                         head_dim=s.head_dim, dtype=dtype))

    views = {
        "cached prefix": view(),
        "two blocks": view(tokens=(64, 96)),
        "unaligned": view(tokens=(68, 84)),
        "one layer": view(tokens=(64, 80), layers=(0, 1)),
        "other dtype": view(tokens=(64, 80), dtype="float32"),
    }
    for what, v in views.items():            # staging buffers the import copies from
        assert v is not None and not _is_pool(d, v), what
    first = view(tokens=(64, 80))
    assert _is_pool(d, first)
    assert not _is_pool(d, view(tokens=(64, 80)))     # never two writers for one block
    assert view(num_kv_heads=3) is None      # refused: import_kv reports it
    assert view(request_id="nobody") is None
    d.abort("x")
    del first
    gc.collect()
    d.check_integrity()
    assert d.stats().used_blocks == 0


def test_finish_import_waits_for_open_leases_and_a_lost_payload_can_come_again(tiny64):
    p, first = _source(tiny64)
    d = make_engine(tiny64)
    seq = _import(d)
    for a, b in [(0, 16), (16, 32), (48, 64), (64, 80), (80, 96), (96, 100)]:
        d.import_kv(p.export_kv("r", a, b))
    lost = d.import_buffer(p.export_kv("r", 32, 48).span)
    assert _is_pool(d, lost) and 2 in seq.leases
    with pytest.raises(RequestError, match=r"tokens \[32, 48\) is still arriving"):
        d.finish_import("r")
    del lost                                  # its connection died mid-frame: nobody can write now
    gc.collect()
    with pytest.raises(RequestError, match="token 32 never arrived"):
        d.finish_import("r")
    chunk = _land(d, p.export_kv("r", 32, 48))
    assert d.accept_kv(chunk)
    assert _finish_and_decode(d, first)[0] == first
    d.check_integrity()


def test_an_abort_parks_blocks_a_payload_may_still_be_landing_in(tiny64):
    p, _ = _source(tiny64)
    d = make_engine(tiny64)
    _import(d)
    d.import_kv(p.export_kv("r", 0, BS))
    arriving = _land(d, p.export_kv("r", BS, 2 * BS))   # received, not yet delivered
    undelivered = d.import_buffer(p.export_kv("r", 2 * BS, 3 * BS).span)
    leased = {lease.block_id for lease in d.seqs["r"].leases.values()}
    assert len(leased) == 2
    assert d.abort("r")
    # Only the leased blocks stay held (the first, complete one is cached, evictable).
    assert _pool_blocks(d) == leased and d.stats().used_blocks == 2
    d.check_integrity()
    assert all(lease.state == LeaseState.PARKED for lease in d._parked)
    assert d.accept_kv(arriving)                # the late frame: its block goes back
    del undelivered                             # the other one's connection was lost
    gc.collect()
    st = d.stats()
    assert (st.used_blocks, st.free_blocks + st.cached_blocks) == (0, st.num_blocks)
    d.check_integrity()


def test_accept_kv_runs_off_the_engine_thread_while_a_step_runs(tiny64):
    """The loop commits a landed chunk while the engine thread is inside a step."""
    p, _ = _source(tiny64)
    d = make_engine(tiny64)
    d.add_request(req("busy", list(range(40, 90)), max_tokens=50))
    _import(d)
    chunk = _land(d, p.export_kv("r", 0, BS))
    inside, release = threading.Event(), threading.Event()
    step = d._forward

    def gated(chunks):
        inside.set()
        release.wait()
        return step(chunks)

    d._forward = gated
    t = threading.Thread(target=d.step)
    t.start()
    inside.wait()
    assert d.accept_kv(chunk)                   # no engine thread involved
    assert d.seqs["r"].imported.find(0) == BS
    release.set()
    t.join()
    d.abort("r")
    d.abort("busy")
    d.check_integrity()


def test_a_readded_request_does_not_get_the_old_ones_abort(tiny64):
    d = make_engine(tiny64)
    d.add_request(req("r", PROMPT))
    d.abort("r")
    d.add_request(req("r", PROMPT, max_tokens=3))
    outs = d.step()
    assert not any(o.reason == "abort" for o in outs)
    assert len(run_to_end(d)["r"]) + sum(len(o.ids) for o in outs) == 3


# ---- AsyncEngine: one owner of a request's output entry --------------------------------------


async def _quiet(aeng: AsyncEngine):
    """Pending entries and engine blocks once the engine thread has caught up."""
    for _ in range(100):                        # a bounded number of engine round trips
        st = await aeng.call(aeng.engine.stats)
        if not aeng.pending and st.used_blocks == 0:
            break
        await asyncio.sleep(0)
    await aeng.call(aeng.engine.check_integrity)
    return aeng.pending, st.used_blocks


def test_async_entries_end_at_every_lifecycle_point(tiny64):
    async def main():
        aeng = AsyncEngine(make_engine(tiny64), "t")
        try:
            # added, never streamed, aborted
            await aeng.add(req("a", PROMPT))
            assert aeng.pending == 1
            await aeng.abort("a")
            # an import added, never streamed, aborted
            await aeng.add(EngineRequest("b", tuple(PROMPT), SP, kv_source="import"))
            await aeng.abort("b")
            # streamed, never iterated, closed
            await aeng.add(req("c", PROMPT))
            await aeng.stream("c").aclose()
            # streamed to the end
            await aeng.add(req("d", PROMPT, max_tokens=2))
            assert len([o async for o in aeng.stream("d")]) >= 1
            # aborted while a stream reads it: the stream gets the abort and ends
            await aeng.add(req("e", PROMPT, max_tokens=500))
            s = aeng.stream("e")
            await s.__anext__()
            await aeng.abort("e")
            assert [o.reason async for o in s][-1] == "abort"
            # the reading task cancelled
            await aeng.add(req("f", PROMPT, max_tokens=500))

            async def read():
                async for _ in aeng.stream("f"):
                    pass

            # (A stream nobody reads or closes, or a request nobody streams or aborts, stays:
            # its owner must close it.  The task here reads from its first step on.)

            task = asyncio.create_task(read())
            while aeng.engine.seqs["f"].num_computed == 0:      # reading (its prefill has run)
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # a duplicate add leaves the live request alone
            await aeng.add(req("g", PROMPT, max_tokens=2))
            with pytest.raises(RequestError, match="already exists"):
                await aeng.add(req("g", PROMPT))
            assert len([o async for o in aeng.stream("g")]) >= 1
            with pytest.raises(RequestError, match="not registered"):
                aeng.stream("g")
            assert await _quiet(aeng) == (0, 0)
        finally:
            await aeng.stop()

    asyncio.run(main())


def test_an_add_cancelled_while_the_engine_admits_it_is_undone(tiny64):
    async def main():
        engine = make_engine(tiny64)
        inside, release = threading.Event(), threading.Event()
        add = engine.add_request

        def gated(request):
            inside.set()
            release.wait()
            return add(request)

        engine.add_request = gated
        aeng = AsyncEngine(engine, "t")
        try:
            task = asyncio.create_task(aeng.add(EngineRequest("r", tuple(PROMPT), SP, kv_source="import")))
            await asyncio.to_thread(inside.wait)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            release.set()
            assert await _quiet(aeng) == (0, 0)
            assert not engine.seqs
        finally:
            release.set()
            await aeng.stop()

    asyncio.run(main())


def test_stop_ends_entries_nobody_streams(tiny64):
    async def main():
        aeng = AsyncEngine(make_engine(tiny64), "t")
        await aeng.add(req("a", PROMPT))
        await aeng.stop()
        assert aeng.pending == 0

    asyncio.run(main())


# ---- DecodeWorker: cancel at each point; commits never one per step -------------------------


class _Decoder:
    def __init__(self, model):
        self.engine = make_engine(model)
        self.aeng = AsyncEngine(self.engine, "d")
        self.events: list[TokenRun] = []
        self.dec = DecodeWorker(self.aeng, self._emit)

    async def _emit(self, ev):
        self.events.append(ev)

    async def quiet(self):
        return await _quiet(self.aeng)


def _wire(chunk: KVChunk, dest) -> KVChunk:
    dest[:] = chunk.payload
    return KVChunk(chunk.span, dest)


@pytest.mark.parametrize("point", ["opened", "mid_import", "landing", "holding", "decoding_unstarted",
                                   "decoding", "compute", "during_open"])
def test_cancel_at_each_point_leaves_no_entry_and_no_block(tiny64, point):
    p, first = _source(tiny64)

    async def main():
        d = _Decoder(tiny64)
        try:
            if point == "during_open":
                task = asyncio.create_task(d.dec.open("r", tuple(PROMPT), SP))
                await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                assert await d.quiet() == (0, 0)
                return
            if point == "compute":
                await d.dec.open_compute("r", tuple(PROMPT), SamplingParams(max_tokens=500), hold=False)
            else:
                await d.dec.open("r", tuple(PROMPT), SamplingParams(max_tokens=500))
            late = None
            if point in ("mid_import", "landing", "holding", "decoding_unstarted", "decoding"):
                for a in range(0, 96, BS):
                    chunk = p.export_kv("r", a, a + BS)
                    dest = d.dec.kv_destination(chunk.span)
                    assert _is_pool(d.engine, dest)
                    if point == "landing" and a == 80:    # on its way into the pool at the cancel
                        late = _wire(chunk, dest)
                        continue
                    await d.dec.import_kv(_wire(chunk, dest))
                if point not in ("mid_import", "landing"):
                    await d.dec.import_kv(p.export_kv("r", 96, 100))
            if point == "holding":
                await d.dec.kv_done("r", first, decode=False)
            if point in ("decoding_unstarted", "decoding"):
                await d.dec.kv_done("r", first, decode=True)
                if point == "decoding":
                    while len(d.events) < 3:
                        await asyncio.sleep(0)
            assert d.aeng.pending == 1
            assert await d.dec.cancel("r")
            assert "r" not in d.dec.sessions
            if late is not None:
                assert (await d.aeng.call(d.engine.stats)).used_blocks == 1     # parked
                d.dec.drop_kv(late)       # the frame arrives after the cancel (node: _cancelled)
            assert await d.quiet() == (0, 0)
        finally:
            await d.aeng.stop()

    asyncio.run(main())


def test_chunks_that_arrive_during_a_step_commit_together_right_after_it(tiny64):
    """A busy decoder: chunks that need a copy are committed in one engine call after the step
    in progress; chunks that landed in the pool are committed at once, step or no step."""
    p, first = _source(tiny64)

    async def main():
        d = _Decoder(tiny64)
        eng = d.engine
        inside, release = threading.Event(), threading.Event()
        step = eng._forward
        seen: list[int] = []                    # tokens present when each step starts

        def gated(chunks):
            seq = eng.seqs.get("r")
            seen.append(-1 if seq is None or seq.imported is None else
                        (len(seq.imported) if seq.imported.find(0) == -1 else seq.imported.find(0)))
            inside.set()
            release.wait()
            return step(chunks)

        eng._forward = gated
        drains = []
        drain = d.dec._drain_imports

        def counted():
            drains.append(len(d.dec._imports))
            drain()

        d.dec._drain_imports = counted
        try:
            await d.dec.open("r", tuple(PROMPT), SP)
            await d.aeng.add(req("busy", list(range(40, 90)), max_tokens=200))
            busy = d.aeng.stream("busy")
            await asyncio.to_thread(inside.wait)          # the engine thread is inside a step
            landed = p.export_kv("r", 0, BS)
            await d.dec.import_kv(_wire(landed, d.dec.kv_destination(landed.span)))
            assert eng.seqs["r"].imported.find(0) == BS   # committed with the step still running
            for a in range(BS, 96, BS):                   # link-allocated: need a copy
                await d.dec.import_kv(p.export_kv("r", a, a + BS))
            await d.dec.import_kv(p.export_kv("r", 96, 100))
            assert len(d.dec._imports) == 6 and drains == []
            inside.clear()
            release.set()
            await asyncio.to_thread(inside.wait)          # the next step has started
            assert drains == [6]                          # one engine call took all six...
            assert seen[-1] == len(PROMPT)                # ...before the next step
            await d.dec.kv_done("r", first, decode=False)
            await d.dec.cancel("r")
            await busy.aclose()
            assert await d.quiet() == (0, 0)
        finally:
            release.set()
            await d.aeng.stop()

    asyncio.run(main())


def test_imported_requests_wait_ready_for_a_place_in_the_batch(tiny64):
    """max_num_seqs = 2 bounds the batch, imported requests included: a third whose KV is in
    waits READY (counted as waiting) and runs when one ends; one on hold with nothing to
    compute (MD waiting for its handoff) takes no place.  Every output is the one-node one."""
    prompts = {f"r{i}": [(7 * i + 5 * j + 3) % 300 + 20 for j in range(40 + 8 * i)] for i in range(4)}
    lengths = {"r0": 3, "r1": 6, "r2": 4, "r3": 2}
    d = make_engine(tiny64, max_num_seqs=2)
    want, first = {}, {}
    for rid, prompt in prompts.items():
        expected = make_engine(tiny64)
        expected.add_request(req(rid, prompt, lengths[rid]))
        want[rid] = run_to_end(expected)[rid]
        p = make_engine(tiny64)
        p.add_request(EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=1), retain_kv=True))
        first[rid] = run_to_end(p)[rid][0]
        d.add_request(EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=lengths[rid]),
                                    kv_source="import", hold=True))
        d.import_kv(p.export_kv(rid, 0, len(prompt)))
    for rid in ("r3", "r0", "r1", "r2"):            # r3's import finishes first, but it stays on hold
        d.finish_import(rid)
    for rid in ("r0", "r1", "r2"):
        d.append_tokens(rid, (first[rid],), final=True)
    st = d.stats()
    assert (st.running, st.waiting, st.importing) == (0, 4, 0)
    got = {rid: [first[rid]] for rid in ("r0", "r1", "r2")}
    batches = []
    while d.has_work():
        stepped = [o for o in d.step() if o.ids]
        batches.append({o.request_id for o in stepped})
        for o in stepped:
            got[o.request_id] += o.ids
        if len(batches) == 1:
            st = d.stats()
            assert (st.running, st.waiting) == (2, 2)
    assert batches[0] == {"r0", "r1"}               # r3 on hold took no place; r2 waits
    assert max(len(b) for b in batches) == 2 and "r2" in batches[2]     # r0 ended in step 2
    assert got == {rid: want[rid] for rid in ("r0", "r1", "r2")}
    assert d.seqs["r3"].status == SeqStatus.READY and not d.has_work()
    d.append_tokens("r3", (first["r3"],), final=True)
    assert [first["r3"]] + run_to_end(d)["r3"] == want["r3"]
    d.check_integrity()
