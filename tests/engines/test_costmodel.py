"""The cost-model engine: the real bookkeeping, the roofline's time, position-keyed tokens, virtual KV."""

from __future__ import annotations

import asyncio

import pytest

from pddgw.config import Config, ConfigError, CostModelConfig, EngineConfig, ModelConfig
from pddgw.engines.async_engine import AsyncEngine
from pddgw.engines.base import create_engine
from pddgw.sim.costmodel_engine import CostModelEngine
from pddgw.engines.sampler import position_uniform
from pddgw.engines.types import EngineRequest, KVChunk, KVSpan, RequestError, SamplingParams
from pddgw.pipeline.prefill import KVTarget, PrefillWorker
from pddgw.sim import profiles
from pddgw.sim.clock import run_virtual
from pddgw.sim.roofline import Parallel, SeqWork, max_kv_tokens, step_cost

L70 = profiles.model("llama3.1-70b")
H100 = profiles.hardware("H100-SXM")


def engine(num_blocks: int = 64, tp: int = 8, **kw) -> CostModelEngine:
    cfg = EngineConfig(implementation="costmodel", block_size=16, num_blocks=num_blocks, max_num_batched_tokens=64,
                       max_num_seqs=8, costmodel=CostModelConfig(hardware="H100-SXM", tensor_parallel=tp), **kw)
    return CostModelEngine(L70, H100, cfg)


def expected_tokens(seed: int, n: int) -> list[int]:
    """Uniform over the vocabulary without EOS (128001 for Llama-3.1), from (seed, position) alone."""
    out = []
    for i in range(n):
        k = int(position_uniform(seed, i) * (128256 - 1))
        out.append(k + 1 if k >= 128001 else k)
    return out


def test_step_times_are_the_roofline_of_each_scheduled_batch():
    eng = engine()
    eng.add_request(EngineRequest("a", tuple(range(1000, 1100)), SamplingParams(max_tokens=3, seed=5)))
    seen = []
    while eng.has_work():
        outs = eng.step()
        seen.append((eng.step_seconds(), [(o.request_id, o.ids) for o in outs]))
    # 100 prompt tokens at a budget of 64: a 64-token chunk, then 36 on top of them (sampling the
    # first token), then two decodes at contexts 100 and 101.
    batches = [[SeqWork(64, 0)], [SeqWork(36, 64)], [SeqWork(1, 100)], [SeqWork(1, 101)]]
    assert [s for s, _ in seen] == [step_cost(L70, H100, 8, b).seconds for b in batches]
    toks = expected_tokens(5, 3)
    # The first chunk reports progress (P streams KV as it grows), no token.
    assert [o for _, o in seen] == [[("a", ())], [("a", (toks[0],))], [("a", (toks[1],))], [("a", (toks[2],))]]
    assert eng.busy_s == pytest.approx(sum(s for s, _ in seen), rel=1e-12)
    # Idle steps take no time.
    assert eng.step() == [] and eng.step_seconds() == 0.0
    eng.check_integrity()


def test_batched_decodes_share_one_step():
    eng = engine()
    for i, n in enumerate((16, 40)):
        eng.add_request(EngineRequest(f"r{i}", tuple(range(2000, 2000 + n)), SamplingParams(max_tokens=2, seed=i)))
    eng.step()                                          # both prompts in one 56-token step
    assert eng.step_seconds() == step_cost(L70, H100, 8, [SeqWork(16, 0), SeqWork(40, 0)]).seconds
    eng.step()
    assert eng.step_seconds() == step_cost(L70, H100, 8, [SeqWork(1, 16), SeqWork(1, 40)]).seconds


def test_batch_limits_are_per_dp_rank_and_a_sequence_chunks_on_its_own_rank():
    """tp 2 x dp 4 with max_num_seqs 2 and max_num_batched_tokens 64, as vLLM reads them with
    --data-parallel-size 4: the instance runs 8 sequences and 256 tokens a step, one
    sequence's chunk at most 64 tokens."""
    eng = CostModelEngine(L70, H100, EngineConfig(
        implementation="costmodel", block_size=16, num_blocks=256, max_num_batched_tokens=64, max_num_seqs=2,
        costmodel=CostModelConfig(hardware="H100-SXM", tensor_parallel=2, data_parallel=4)))
    for i, n in enumerate((150, 40, 100, 30, 20, 10, 10, 10, 10)):
        eng.add_request(EngineRequest(f"r{i}", tuple(range(3000 + 200 * i, 3000 + 200 * i + n)),
                                      SamplingParams(max_tokens=2, seed=i)))
    eng.step()
    # 64 + 40 + 64 + 30 + 20 + 10 + 10 + 10 = 248 <= 256 tokens; r8 waits: 8 sequences run.
    done = {r: s.num_computed for r, s in eng.seqs.items()}
    assert done == {"r0": 64, "r1": 40, "r2": 64, "r3": 30, "r4": 20, "r5": 10, "r6": 10, "r7": 10, "r8": 0}
    work = [SeqWork(64, 0), SeqWork(40, 0), SeqWork(64, 0), SeqWork(30, 0), SeqWork(20, 0)] + [SeqWork(10, 0)] * 3
    par = Parallel(tp=2, dp=4)
    assert eng.step_seconds() == step_cost(L70, H100, par, work).seconds
    eng.step()
    assert eng.seqs["r0"].num_computed == 128 and eng.seqs["r2"].num_computed == 100
    assert eng.seqs["r8"].num_computed == 0          # the batch is still full
    while eng.has_work():
        eng.step()
    eng.check_integrity()


def test_tokens_depend_on_seed_and_position_only_and_never_end_early():
    a, b = engine(), engine()
    a.add_request(EngineRequest("x", tuple(range(5000, 5030)), SamplingParams(max_tokens=40, seed=9)))
    b.add_request(EngineRequest("y", tuple(range(7000, 7070)), SamplingParams(max_tokens=40, seed=9, temperature=1.0)))
    outs: dict[str, list[int]] = {"x": [], "y": []}
    for e in (a, b):
        while e.has_work():
            for o in e.step():
                outs[o.request_id] += o.ids
    assert outs["x"] == outs["y"] == expected_tokens(9, 40)
    assert 128001 not in outs["x"]
    assert engine().token_at(9, 3) == expected_tokens(9, 4)[3]
    # The answer is drawn in one go up to max_tokens, and its entry goes with its last token.
    assert a._drawn == b._drawn == {}


def test_tokens_drawn_in_one_go_are_those_of_each_position():
    # Past an EOS id (128001 for Llama-3.1) and across a redraw: an answer longer than one draw.
    e = engine(num_blocks=512)
    e.add_request(EngineRequest("z", tuple(range(5000, 5030)), SamplingParams(max_tokens=5000, seed=3)))
    got: list[int] = []
    while e.has_work():
        for o in e.step():
            got += o.ids
    assert got == expected_tokens(3, 5000) and any(t > 128001 for t in got)
    assert e._drawn == {}
    # Requests sharing a seed, a step apart, each draw their own run once.
    e.add_request(EngineRequest("p", tuple(range(5000, 5030)), SamplingParams(max_tokens=40, seed=3)))
    e.step()
    e.add_request(EngineRequest("q", tuple(range(6000, 6030)), SamplingParams(max_tokens=40, seed=3)))
    e.step()
    assert {rid: (start, len(toks)) for rid, (start, toks) in e._drawn.items()} == {"p": (0, 40), "q": (0, 40)}


def test_kv_is_virtual_its_size_real_and_imports_fill_the_cached_gap():
    p, md = engine(), engine()
    prompt = tuple(range(3000, 3040))
    p.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=1), retain_kv=True))
    while p.has_work():
        p.step()
    chunk = p.export_kv("r", 0, 40)
    assert chunk.virtual and len(chunk.payload) == 0 and chunk.payload_nbytes == 0
    assert chunk.nbytes == 40 * L70.kv_bytes_per_token == 40 * 327680
    md.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=4), kv_source="import", hold=True))
    with pytest.raises(RequestError, match="KV of prompt token 0 never arrived"):
        md.finish_import("r")
    md.import_kv(chunk)
    md.finish_import("r")
    md.check_integrity()
    assert md.stats().used_blocks == 3


def test_a_real_kv_pool_refuses_virtual_chunks(tiny64):
    from tests.engines.conftest import make_engine

    eng = make_engine(tiny64)
    eng.add_request(EngineRequest("r", tuple(range(40)), SamplingParams(max_tokens=2), kv_source="import", hold=True))
    spec = tiny64.spec
    virtual = KVChunk(KVSpan.of("r", tokens=(0, 16), layers=(0, spec.num_layers), num_kv_heads=spec.num_kv_heads,
                                head_dim=spec.head_dim, dtype="float64", virtual=True), memoryview(b""))
    with pytest.raises(RequestError, match="virtual KV chunk"):
        eng.import_kv(virtual)


def test_pool_size_comes_from_gpu_memory():
    eng = engine(num_blocks=0)
    # 8 x 80 GB x 0.9 minus 141 GB of weights, in 16-token blocks of 320 KiB per token.
    assert eng.blocks.num_blocks == max_kv_tokens(L70, H100, 8, 0.9) // 16
    with pytest.raises(ConfigError, match="engine.costmodel"):
        engine(num_blocks=0, tp=1)                      # 141 GB of weights on one 80 GB GPU


def test_config_errors_name_the_key():
    base = Config(model=ModelConfig(profile="llama3.1-70b"),
                  engine=EngineConfig(implementation="costmodel", num_blocks=0,
                                      costmodel=CostModelConfig(tensor_parallel=8)))
    eng, tok = create_engine(base)
    assert isinstance(eng, CostModelEngine) and eng.kv_layout.dtype == "bfloat16" and tok.vocab_size == 128256
    with pytest.raises(ConfigError, match="model.profile: unknown model profile 'gpt-5'"):
        create_engine(Config(model=ModelConfig(profile="gpt-5"), engine=base.engine))
    with pytest.raises(ConfigError, match="model.profile: the cost-model engine needs a model shape"):
        create_engine(Config(engine=base.engine))
    with pytest.raises(ConfigError, match="engine.costmodel.hardware: unknown hardware profile 'TPU'"):
        create_engine(Config(model=base.model, engine=EngineConfig(
            implementation="costmodel", costmodel=CostModelConfig(hardware="TPU"))))
    with pytest.raises(ConfigError, match="has no weights"):
        create_engine(Config(model=base.model))        # the torch engine cannot run a profile


def test_async_driver_waits_each_step_on_the_loop_clock():
    eng = engine()

    async def main() -> tuple[float, list[int]]:
        aeng = AsyncEngine(eng, "cm")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        toks = []
        async for out in aeng.generate(EngineRequest("a", tuple(range(1000, 1100)), SamplingParams(max_tokens=3))):
            toks += out.ids
        took = loop.time() - t0
        await aeng.stop()
        return took, toks

    took, toks = run_virtual(main())
    batches = [[SeqWork(64, 0)], [SeqWork(36, 64)], [SeqWork(1, 100)], [SeqWork(1, 101)]]
    # Virtual time advances by exactly the modeled steps (microsecond clock resolution).
    assert took == pytest.approx(sum(step_cost(L70, H100, 8, b).seconds for b in batches), abs=4e-6)
    assert toks == expected_tokens(0, 3)


def test_steady_decode_steps_match_the_general_step_exactly():
    """`CostModelEngine.step` runs a step of one decode per running sequence in one pass
    (`Scheduler.decodes`): the same outputs, step times, blocks and prefix cache as the general
    step, through admissions, preemptions (a small pool), output runs, logprobs and stops."""
    stop_seed = 77
    stop_at = engine().token_at(stop_seed, 9)        # the 10th output token of that request

    def requests(step: int) -> list[EngineRequest]:
        if step % 3:
            return []
        i = step // 3
        if i >= 14:
            return []
        sp = SamplingParams(max_tokens=6 + 5 * (i % 4), seed=stop_seed if i == 5 else i,
                            logprobs=2 if i == 7 else None, stop_token_ids=(stop_at,) if i == 5 else ())
        return [EngineRequest(f"r{i}", tuple(range(3000 + 40 * (i % 3), 3000 + 40 * (i % 3) + 17 + 9 * i)), sp,
                              output_interval=(1, 4, 3)[i % 3])]

    def run(fast: bool) -> tuple[list, int]:
        eng = engine(num_blocks=14)
        took = 0
        decodes = eng.scheduler.decodes

        def counted():
            nonlocal took
            got = decodes() if fast else None
            took += got is not None
            return got

        eng.scheduler.decodes = counted
        seen = []
        for step in range(400):
            for r in requests(step):
                eng.add_request(r)
            outs = eng.step()
            blocks = eng.blocks
            seen.append((eng.step_seconds(), outs, sorted((r, tuple(s.block_ids)) for r, s in eng.seqs.items()),
                         blocks.num_free, blocks.num_cached, eng.scheduler.num_preemptions))
            eng.check_integrity()
            if step > 45 and not eng.has_work():
                break
        return seen, took

    general, _ = run(fast=False)
    steady, took = run(fast=True)
    assert steady == general
    # 103 steps, 31 of them in one pass; 3 preemptions on the way (exact: the run is deterministic).
    assert (len(general), took, general[-1][-1]) == (103, 31, 3)
    finished = {o.request_id: o.reason for _, outs, *_ in general for o in outs if o.done}
    assert len(finished) == 14 and finished["r5"] == "stop"
    assert sorted(set(finished.values())) == ["length", "stop"]


def test_virtual_kv_goes_out_as_p_computes_it_whatever_the_targets_blocks():
    """Virtual KV lands in no pool: a target's larger blocks do not hold P's chunks back (P
    steps of 48 tokens, chunks of 16, a target of 32-token blocks)."""
    eng = CostModelEngine(L70, H100, EngineConfig(
        implementation="costmodel", block_size=16, num_blocks=64, max_num_batched_tokens=48, max_num_seqs=8,
        costmodel=CostModelConfig(hardware="H100-SXM", tensor_parallel=8)))
    batches: list[list[tuple[int, int]]] = []

    async def send(chunks: list[KVChunk]) -> float:
        assert all(c.virtual for c in chunks)
        batches.append([(c.token_start, c.token_end) for c in chunks])
        return 0.0

    async def done(first, lp) -> None:
        pass

    async def main() -> None:
        p = PrefillWorker(AsyncEngine(eng, "p"), chunk_bytes=16 * eng.kv_layout.bytes_per_token())
        await p.prefill("r", tuple(range(1000, 1150)), SamplingParams(max_tokens=4),
                        [KVTarget("md", 0, send, done, block_size=32)])
        await p.aeng.stop()

    run_virtual(main())
    assert batches == [[(0, 16), (16, 32), (32, 48)], [(48, 64), (64, 80), (80, 96)],
                       [(96, 112), (112, 128), (128, 144)], [(144, 150)]]
