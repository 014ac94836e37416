"""The torch engine against a naive full-recompute generator, and its KV/extend paths.

All on the tiny model in float64, so a k-token extend and k single decodes
agree exactly (clear margins, no near-ties to flip).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random

import pytest
import torch

from pddgw.engines.async_engine import AsyncEngine
from pddgw.engines.block_manager import chain_hashes
from pddgw.engines.naive import naive_greedy
from pddgw.engines.types import CapacityError, EngineRequest, RequestError, SamplingParams

from .conftest import make_engine, req, run_to_end


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    """Mixed lengths (1..120), half of them sharing long prefixes (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(32, 127) for _ in range(70)]
    out = []
    for i in range(n):
        length = rng.choice([1, 3, 15, 16, 17, 33, 64, 90, 120])
        if i % 2:
            out.append(shared[: min(length, 70)] + [rng.randrange(32, 127) for _ in range(length // 3)])
        else:
            out.append([rng.randrange(32, 127) for _ in range(length)])
    return out


def test_concurrent_batched_chunked_cached_equals_naive(tiny64):
    prompts = _prompts(24)
    engine = make_engine(tiny64, max_num_batched_tokens=48)   # forces chunked prefill

    async def main():
        aeng = AsyncEngine(engine)

        async def one(i, p):
            toks = []
            async for o in aeng.generate(req(f"r{i}", p, max_tokens=10)):
                toks += o.ids
            return toks

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await aeng.stop()

    results = asyncio.run(main())
    for p, got in zip(prompts, results):
        assert got == naive_greedy(tiny64, p, 10)
    st = engine.stats()
    assert st.prefix_hit_tokens > 0                       # shared prefixes were served from cache
    assert (st.used_blocks, st.running, st.waiting) == (0, 0, 0)
    assert st.free_blocks + st.cached_blocks == st.num_blocks
    engine.check_integrity()


def test_prefix_hit_exact_blocks(tiny64):
    engine = make_engine(tiny64, num_blocks=16, block_size=4)
    prompt = list(range(40, 50))                          # 10 tokens: 2 full blocks + 2
    engine.add_request(req("a", prompt, max_tokens=3))
    run_to_end(engine)
    # a's blocks 0..2 held tokens 0..11 (10 prompt + 2 computed outputs); full ones are cached.
    bm = engine.blocks
    hashes = chain_hashes(prompt, 4)
    assert bm.match(hashes) == [0, 1]
    assert engine.match_prefix(hashes) == 2
    # Same prompt again: 2 blocks from cache, the rest computed (never the last prompt token).
    res = engine.add_request(req("b", prompt, max_tokens=2))
    assert res.num_cached_tokens == 0                     # matched at admission, in step()
    engine.step()
    seq_b = engine.seqs["b"]
    assert seq_b.num_cached_tokens == 8 and seq_b.block_ids[:2] == [0, 1]
    run_to_end(engine)
    assert engine.stats().prefix_hit_tokens == 8
    # A prompt of exactly 2 full blocks may not take its last block from cache.
    engine.add_request(req("c", prompt[:8], max_tokens=1))
    engine.step()
    assert engine.seqs.get("c") is None                   # finished in one step
    assert engine.stats().prefix_hit_tokens == 12
    engine.check_integrity()


def test_extend_then_decode_equals_decode(tiny64):
    prompt = [random.Random(3).randrange(32, 127) for _ in range(37)]
    full = naive_greedy(tiny64, prompt, 24)
    for k in (1, 7, 20):
        engine = make_engine(tiny64)
        engine.add_request(req("x", prompt, max_tokens=24, output_token_ids=tuple(full[:k])))
        assert run_to_end(engine)["x"] == full[k:]
        engine.check_integrity()


def test_catch_up_handoff_on_hold(tiny64):
    """MD side of a catch-up: extend chunk by chunk on hold, sample only after the final one."""
    prompt = list(range(60, 90))
    full = naive_greedy(tiny64, prompt, 30)
    engine = make_engine(tiny64)
    engine.add_request(req("md", prompt, max_tokens=30, output_token_ids=(full[0],), hold=True))
    assert run_to_end(engine) == {"md": []}               # computes (progress), samples nothing
    assert engine.seqs["md"].num_computed == len(prompt)     # the held last token stays pending
    engine.append_tokens("md", full[1:9], final=False)
    assert run_to_end(engine) == {"md": []}
    assert engine.seqs["md"].num_computed == len(prompt) + 8
    engine.append_tokens("md", full[9:12], final=True)
    assert run_to_end(engine)["md"] == full[12:]
    with pytest.raises(RequestError, match="unknown request"):
        engine.append_tokens("md", [1], final=True)
    engine.check_integrity()


@pytest.mark.parametrize("split", [1, 5, 16])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_split_across_engines_with_kv_transfer(tiny64, split, temperature):
    """Generate `split` tokens on A (block 16), move the KV to B (block 8), finish on B."""
    prompt = [random.Random(split).randrange(32, 127) for _ in range(45)]
    sp = dict(max_tokens=20, temperature=temperature, seed=1234, top_p=0.95)
    ref = make_engine(tiny64)
    ref.add_request(req("r", prompt, **sp))
    expected = run_to_end(ref)["r"]

    a = make_engine(tiny64, block_size=16)
    a.add_request(req("r", prompt, retain_kv=True, **{**sp, "max_tokens": split}))
    head = run_to_end(a)["r"]
    assert head == expected[:split]
    assert a.stats().retained == 1
    b = make_engine(tiny64, block_size=8)
    b.add_request(EngineRequest("r", tuple(prompt), SamplingParams(**sp), output_token_ids=tuple(head),
                                kv_source="import"))
    # Ship the prompt KV in two layer-split, token-ranged chunks (layout independent).
    for lo, hi in ((0, 20), (20, 45)):
        b.import_kv(a.export_kv("r", lo, hi, 0, 1))
        b.import_kv(a.export_kv("r", lo, hi, 1, 2))
    b.finish_import("r")
    assert a.release("r") and not a.release("r")
    assert head + run_to_end(b)["r"] == expected
    for e in (a, b):
        e.check_integrity()
        assert e.stats().used_blocks == 0


def test_import_on_top_of_cached_prefix_and_dtype_conversion(tiny64):
    """MD holds the first blocks; only the missing range is imported (in float32)."""
    prompt = list(range(33, 33 + 40))
    md = make_engine(tiny64, block_size=8)
    md.add_request(req("warm", prompt[:24] + [100], max_tokens=1))
    run_to_end(md)
    hashes = chain_hashes(prompt, 8)
    assert md.match_prefix(hashes, pin_key="t1") == 3     # 24 tokens held and pinned
    p = make_engine(tiny64, block_size=16)
    p.add_request(req("r", prompt, max_tokens=1, retain_kv=True))
    t0 = run_to_end(p)["r"]
    res = md.add_request(req("r", prompt, max_tokens=12, output_token_ids=tuple(t0), kv_source="import"))
    assert res.num_cached_tokens == 24
    assert md.unpin("t1")
    chunk = p.export_kv("r", 24, 40)
    f32 = torch.frombuffer(bytearray(chunk.payload), dtype=torch.float64).to(torch.float32)
    from pddgw.engines.kv_pool import tensor_to_buffer
    from pddgw.engines.types import KVChunk
    span32 = dataclasses.replace(chunk.span, dtype="float32")
    md.import_kv(KVChunk(span32, tensor_to_buffer(f32)))
    # A payload of the wrong size never becomes a chunk: the engine cannot be handed one.
    with pytest.raises(ValueError, match=f"payload has 10 bytes, span needs {span32.nbytes}"):
        KVChunk(span32, memoryview(b"\0" * 10))
    md.finish_import("r")
    got = t0 + run_to_end(md)["r"]
    # float32 transport rounds the KV; the tiny model's margins keep greedy tokens identical.
    assert got == naive_greedy(tiny64, prompt, 12)
    md.check_integrity()


def test_finish_import_requires_every_token(tiny64):
    e = make_engine(tiny64)
    src = make_engine(tiny64)
    prompt = list(range(50, 90))
    src.add_request(req("r", prompt, max_tokens=1, retain_kv=True))
    run_to_end(src)
    e.add_request(req("r", prompt, max_tokens=4, kv_source="import"))
    e.import_kv(src.export_kv("r", 0, 30))
    with pytest.raises(RequestError, match="prompt token 30 never arrived"):
        e.finish_import("r")
    assert e.abort("r")
    assert e.stats().used_blocks == 0
    e.check_integrity()


def test_a_cancelled_import_keeps_its_complete_leading_blocks(tiny64):
    """Tokens [0, 30) of 40 arrived (block size 8): blocks 0-2 are whole and go to the
    prefix cache when the import is dropped; the half-filled block 3 does not."""
    e = make_engine(tiny64, block_size=8)
    src = make_engine(tiny64, block_size=8)
    prompt = list(range(50, 90))
    src.add_request(req("r", prompt, max_tokens=1, retain_kv=True))
    run_to_end(src)
    e.add_request(req("r", prompt, max_tokens=4, kv_source="import"))
    e.import_kv(src.export_kv("r", 0, 30))
    assert e.abort("r")
    st = e.stats()
    assert (st.used_blocks, st.cached_blocks) == (0, 3)
    assert e.match_prefix(chain_hashes(prompt, 8)) == 3
    # The next turn imports on top of them: only tokens [24, 40) are needed.
    assert e.add_request(req("r2", prompt, max_tokens=4, kv_source="import")).num_cached_tokens == 24
    e.check_integrity()


def test_preemption_under_block_pressure_keeps_outputs_exact(tiny64):
    prompts = [[random.Random(i).randrange(32, 127) for _ in range(30)] for i in range(6)]
    engine = make_engine(tiny64, num_blocks=12, block_size=8, max_num_batched_tokens=64)
    for i, p in enumerate(prompts):
        engine.add_request(req(f"r{i}", p, max_tokens=25))
    out = run_to_end(engine)
    assert engine.stats().preemptions > 0
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == naive_greedy(tiny64, p, 25)
    engine.check_integrity()
    assert engine.stats().used_blocks == 0


def test_bad_requests_are_rejected_without_side_effects(tiny64):
    engine = make_engine(tiny64, num_blocks=8, block_size=16)   # 128-token context
    assert engine.max_model_len == 128
    with pytest.raises(RequestError, match="context length 128"):
        engine.add_request(req("long", [1] * 128))
    with pytest.raises(RequestError, match="empty prompt"):
        engine.add_request(req("empty", []))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request(req("bad", [1, 100000]))
    with pytest.raises(RequestError, match=r"max_tokens must be an integer in \[1, "):
        SamplingParams(max_tokens=0)
    engine.add_request(req("ok", [1, 2, 3]))
    with pytest.raises(RequestError, match="already exists"):
        engine.add_request(req("ok", [1, 2, 3]))
    big = make_engine(tiny64, num_blocks=8, block_size=16)
    big.add_request(req("hog", list(range(32, 132)), max_tokens=1, retain_kv=True))
    run_to_end(big)
    with pytest.raises(CapacityError, match="import needs") as full:
        big.add_request(req("imp", list(range(40, 100)), kv_source="import"))
    assert str(full.value) == "request 'imp': import needs 4 KV blocks, 1 allocatable"
    assert big.release("hog")
    for e in (engine, big):
        e.abort("ok")
        e.check_integrity()
        assert e.stats().used_blocks == 0


def test_async_cancel_frees_blocks(tiny64):
    engine = make_engine(tiny64)

    async def main():
        aeng = AsyncEngine(engine)
        got = []
        stream = aeng.generate(req("c", list(range(40, 100)), max_tokens=200))
        async with contextlib.aclosing(stream):
            async for o in stream:
                got += o.ids
                if len(got) == 3:
                    break                                 # closing the stream aborts
        st = await aeng.call(engine.stats)
        await aeng.stop()
        return got, st

    got, st = asyncio.run(main())
    assert len(got) == 3
    assert (st.used_blocks, st.running, st.waiting) == (0, 0, 0)
    engine.check_integrity()


def test_async_task_cancellation_aborts(tiny64):
    engine = make_engine(tiny64)

    async def main():
        aeng = AsyncEngine(engine)
        seen = asyncio.Event()

        async def consume():
            async for _ in aeng.generate(req("c", list(range(40, 100)), max_tokens=500)):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        st = await aeng.call(engine.stats)
        await aeng.stop()
        return st

    st = asyncio.run(main())
    assert (st.used_blocks, st.running) == (0, 0)
    engine.check_integrity()


def test_handed_off_tokens_that_complete_the_request_finish_it(tiny64):
    prompt = list(range(60, 80))
    full = naive_greedy(tiny64, prompt, 6)
    engine = make_engine(tiny64)
    # max_tokens reached by the handoff itself: finishes without sampling.
    engine.add_request(req("a", prompt, max_tokens=3, output_token_ids=(full[0],), hold=True))
    engine.append_tokens("a", full[1:3], final=True)
    outs = engine.step()
    assert [(o.request_id, o.ids, o.position, o.done, o.reason) for o in outs] == [
        ("a", (), 3, True, "length")]
    # A stop token as the last handed-off token.
    engine.add_request(req("b", prompt, max_tokens=10, hold=True, stop_token_ids=(full[1],)))
    engine.append_tokens("b", full[:2], final=True)
    assert [(o.request_id, o.reason) for o in engine.step()] == [("b", "stop")]
    with pytest.raises(RequestError, match="exceeds max_tokens"):
        engine.add_request(req("c", prompt, max_tokens=2, hold=True))
        engine.append_tokens("c", full[:3], final=True)
    engine.abort("c")
    assert engine.stats().used_blocks == 0
    engine.check_integrity()


def test_engine_registry_by_name():
    from pddgw.config import Config, EngineConfig
    from pddgw.engines.base import create_engine
    from pddgw.engines.torch_engine import TorchEngine

    engine, tok = create_engine(Config(engine=EngineConfig(num_blocks=8)))
    assert isinstance(engine, TorchEngine) and engine.kv_layout.block_size == 16
    assert tok.decode(tok.encode("hi")) == "hi"
    with pytest.raises(ValueError, match=r"unknown engine 'sglang' \(known: costmodel, torch, vllm\)"):
        create_engine(Config(engine=EngineConfig(implementation="sglang")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_config_error():
    from pddgw.config import Config, ConfigError, EngineConfig
    from pddgw.engines.base import create_engine

    with pytest.raises(ConfigError, match="engine.device = 'cuda'"):
        create_engine(Config(engine=EngineConfig(device="cuda")))


def test_retained_prefills_get_all_their_blocks_at_admission_and_are_never_preempted(tiny64):
    """P streams KV as it is computed: a second prompt waits for blocks instead of evicting the first."""
    eng = make_engine(tiny64, num_blocks=8, max_num_batched_tokens=32)
    for rid, base in (("a", 0), ("b", 100)):
        eng.add_request(EngineRequest(rid, tuple(range(base, base + 100)), SamplingParams(max_tokens=1),
                                      retain_kv=True))
    eng.step()
    a, b = eng.seqs["a"], eng.seqs["b"]
    assert len(a.block_ids) == 7 and b.block_ids == []          # 100 tokens -> 7 blocks of 16, all at once
    exported = []
    for _ in range(10):                                          # 100 tokens at 32 per step, then a token
        eng.step()
        exported.append(eng.export_kv("a", 0, a.num_computed).num_tokens)
    assert exported[:4] == [64, 96, 100, 100] and eng.stats().preemptions == 0
    assert eng.seqs["b"].block_ids == []                         # still waiting: a holds its KV for its targets
    eng.release("a")
    while eng.has_work():
        eng.step()
    assert eng.export_kv("b", 0, 100).num_tokens == 100 and eng.stats().preemptions == 0
    eng.check_integrity()


def test_output_interval_hands_sampled_tokens_out_in_runs(tiny64):
    """output_interval = 4 (vLLM's --stream-interval in the engine): the first sampled token in its
    own step's output, then runs of four (each in the output of the step that sampled its last
    token, the steps between returning nothing and saying they held tokens back), the rest with
    the finish; the same tokens and logprobs as one output per token."""
    prompt = list(range(60, 90))
    sampling = SamplingParams(max_tokens=15, temperature=0.8, seed=3, logprobs=2)

    def outputs(interval: int):
        engine = make_engine(tiny64)
        engine.add_request(EngineRequest("a", tuple(prompt), sampling, output_token_ids=(7,),
                                         output_interval=interval))
        got = []
        while engine.has_work():
            step = engine.step()
            got += [(len(o.ids), o.ids, o.position, o.done, len(o.logprobs)) for o in step if o.ids]
            if not step:
                assert engine.held_last_step()
        engine.check_integrity()
        return got, engine

    one, _ = outputs(1)
    runs, engine = outputs(4)
    # Position 0 is the handed-off token: 14 sampled, at positions 1..14.
    assert [(n, pos, done, lps) for n, _, pos, done, lps in runs] == [
        (1, 1, False, 1), (4, 2, False, 4), (4, 6, False, 4), (4, 10, False, 4), (1, 14, True, 1)]
    assert [t for _, ids, *_ in runs for t in ids] == [t for _, ids, *_ in one for t in ids]
    assert engine.held_last_step() is False
    with pytest.raises(RequestError, match="output_interval 0 outside 1..1024"):
        make_engine(tiny64).add_request(EngineRequest("b", tuple(prompt), sampling, output_interval=0))


def test_output_interval_logprobs_match_one_output_per_token(tiny64):
    prompt = list(range(40, 75))
    sampling = SamplingParams(max_tokens=11, temperature=0.7, seed=9, logprobs=3)

    def logprobs(interval: int) -> list:
        engine = make_engine(tiny64)
        engine.add_request(EngineRequest("a", tuple(prompt), sampling, output_interval=interval))
        out = []
        while engine.has_work():
            out += [lp for o in engine.step() for lp in o.logprobs]
        return out

    assert logprobs(5) == logprobs(1) and len(logprobs(1)) == 11
