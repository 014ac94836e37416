"""Tensor parallel: the vLLM engine with tensor_parallel = 2 on CPU (vLLM's multiprocessing
executor, a worker process per rank, gloo / shared-memory collectives), behind the same contract.

The test model has 2 KV heads, so each rank holds one; a second model with 1 KV head has it
replicated on both ranks.  Greedy tokens must equal the torch engine's on every path (alone,
KV imported from the torch engine, KV exported to it); an imported token's KV must come back
bit-exact from an export (each rank wrote its heads, the export joined them in rank order);
staged imports live in shared memory only until the step that loads them.  Last, a whole PDD
deployment in one process with its MD on TP = 2.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from pddgw.api.server import build_app
from pddgw.config import (Config, ConfigError, NetConfig, NodeConfig, PolicyConfig, ShapingConfig,
                          VllmEngineConfig)
from pddgw.engines import vllm_connector
from pddgw.engines.kv_pool import buffer_to_tensor
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest, SamplingParams
from pddgw.engines.vllm_engine import VllmEngine
from pddgw.engines.weights import build_random, save_hf_checkpoint
from pddgw.deploy.serve import Embedded
from tests.pipeline.pdd_client import chat

from .conftest import (BLOCK, config, model_config, prompt_ids, prompt_of, spec, torch_engine_config,
                       vllm_engine_config)
from .test_vllm_engine import OUT, drain, greedy, hand_over, prefill_on, run, transfer
from .test_vllm_pipeline import BYTES_PER_TOKEN

pytestmark = pytest.mark.slow


def tp_config(checkpoint: str, **vllm):
    settings = dict(enforce_eager=True, gpu_memory_utilization=0.05, tensor_parallel=2)
    settings.update(vllm)
    return config(checkpoint, vllm_engine_config(vllm=VllmEngineConfig(**settings)))


def started(checkpoint: str) -> VllmEngine:
    t0 = time.perf_counter()
    engine, _ = VllmEngine.from_config(tp_config(checkpoint))
    print(f"\nvLLM TP=2 engine up in {time.perf_counter() - t0:.1f} s")
    return engine


@pytest.fixture(scope="module")
def tp2(checkpoint):
    engine = started(checkpoint)
    yield engine
    engine.shutdown()
    assert not vllm_connector.staged_files(engine._engine_id)


@pytest.fixture(scope="module")
def teng(checkpoint):
    engine, _ = TorchEngine.from_config(config(checkpoint, torch_engine_config()))
    return engine


def idle(engine) -> None:
    """Nothing in use, reference counts exact, no staging left in shared memory."""
    engine.check_integrity()
    stats = engine.stats()
    assert (stats.used_blocks, stats.pins, stats.running, stats.waiting, stats.importing,
            stats.retained) == (0, 0, 0, 0, 0, 0), stats
    if isinstance(engine, VllmEngine):
        assert not vllm_connector.staged_files(engine._engine_id)


@pytest.fixture(autouse=True)
def nothing_left(request):
    yield
    for name in ("tp2", "teng"):
        if name in request.fixturenames:
            idle(request.getfixturevalue(name))


def reference(teng, prompt, max_tokens: int = OUT) -> list[int]:
    return run(teng, EngineRequest("ref", prompt, greedy(max_tokens)))["ref"]


def test_greedy_and_seeded_tokens_equal_the_torch_engine(tp2, teng):
    prompts = (prompt_ids(40, 20), prompt_ids(70, 21), prompt_ids(100, 22))
    got = run(tp2, *(EngineRequest(f"r{i}", p, greedy()) for i, p in enumerate(prompts)))
    assert [got[f"r{i}"] for i in range(3)] == [reference(teng, p) for p in prompts]
    # pddgw's position-keyed draw runs in every rank's sampler: same tokens, handoff included.
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    ref = run(teng, EngineRequest("ref", prompts[0], sp))["ref"]
    assert run(tp2, EngineRequest("s", prompts[0], sp))["s"] == ref
    assert run(tp2, EngineRequest("h", prompts[0], sp, output_token_ids=tuple(ref[:9])))["h"] == ref


def test_import_lands_each_ranks_heads_and_exports_bit_exact(tp2, teng):
    """torch P -> TP=2 MD: the staged KV crosses to the ranks as a shared-memory file, each
    rank writes its head; the tokens equal single-node generation, and exporting the imported
    range returns exactly the bytes that came in."""
    prompt = prompt_ids(90, 23)
    t0 = prefill_on(teng, "x", prompt)
    sent = bytes(teng.export_kv("x", 0, len(prompt)).payload)
    tp2.add_request(EngineRequest("x", prompt, greedy(), output_token_ids=(t0,), kv_source="import",
                                  retain_kv=True))
    (staging,) = vllm_connector.staged_files(tp2._engine_id)
    transfer(teng, tp2, "x", 0, len(prompt))
    assert teng.release("x")
    tp2.finish_import("x")
    assert drain(tp2, {"x": [t0]})["x"] == reference(teng, prompt)
    assert not vllm_connector.staged_files(tp2._engine_id), staging      # gone once loaded
    back = tp2.export_kv("x", 0, len(prompt))
    assert (back.span.num_kv_heads, back.span.head_dim) == (2, 32)
    assert bytes(back.payload) == sent
    assert tp2.release("x")


def test_export_joins_the_ranks_heads_in_order(tp2, teng):
    """TP=2 P -> torch MD: the exported KV is the torch engine's own (float32 rounding apart),
    and the torch engine continues it to the same tokens."""
    prompt = prompt_ids(80, 24)
    t0, added, _ = hand_over(tp2, teng, "y", prompt)
    assert added.num_cached_tokens == 0
    assert drain(teng, {"y": [t0]})["y"] == reference(teng, prompt)

    prefill_on(tp2, "a", prompt)
    prefill_on(teng, "b", prompt)
    shape = (2, 2, len(prompt), 2, 32)
    ours, theirs = (buffer_to_tensor(e.export_kv(r, 0, len(prompt)).payload, "float32", shape)
                    for e, r in ((tp2, "a"), (teng, "b")))
    assert torch.allclose(ours, theirs, atol=1e-4)
    assert not torch.allclose(ours[..., 0, :], theirs[..., 1, :], atol=1e-2)     # heads distinct
    assert tp2.release("a") and teng.release("b")


def test_held_import_rounds_and_abort_remove_the_staging(tp2, teng):
    prompt = prompt_ids(64, 25)
    ref = reference(teng, prompt)
    t0, _, _ = hand_over(teng, tp2, "h", prompt, hold=True)     # the first round loads the staging
    tp2.append_tokens("h", (t0,), final=False)
    drain(tp2, {"h": []})
    tp2.append_tokens("h", ref[1:5], final=True)
    assert drain(tp2, {"h": ref[:5]})["h"] == ref

    tp2.add_request(EngineRequest("gone", prompt_ids(50, 26), greedy(), kv_source="import"))
    assert len(vllm_connector.staged_files(tp2._engine_id)) == 1
    assert tp2.abort("gone")
    tp2.step()
    assert not vllm_connector.staged_files(tp2._engine_id)


def test_replicated_kv_head(tmp_path):
    """1 KV head, 2 ranks: both hold it, both load it, one answers exports."""
    path = tmp_path / "llama-1kv"
    save_hf_checkpoint(build_random(dataclasses.replace(spec(), num_kv_heads=1), 0, "float32", "cpu"), path)
    torch_1kv, _ = TorchEngine.from_config(config(str(path), torch_engine_config()))
    engine = started(str(path))
    try:
        assert engine.kv_layout.num_kv_heads == 1
        prompt = prompt_ids(70, 27)
        ref = reference(torch_1kv, prompt)
        assert run(engine, EngineRequest("a", prompt, greedy()))["a"] == ref
        prompt = prompt_ids(75, 28)
        ref = reference(torch_1kv, prompt)
        t0 = prefill_on(torch_1kv, "x", prompt)
        sent = bytes(torch_1kv.export_kv("x", 0, len(prompt)).payload)
        engine.add_request(EngineRequest("x", prompt, greedy(), output_token_ids=(t0,), kv_source="import",
                                         retain_kv=True))
        transfer(torch_1kv, engine, "x", 0, len(prompt))
        torch_1kv.release("x")
        engine.finish_import("x")
        assert drain(engine, {"x": [t0]})["x"] == ref
        assert bytes(engine.export_kv("x", 0, len(prompt)).payload) == sent
        assert engine.release("x")
        idle(engine)
        idle(torch_1kv)
    finally:
        engine.shutdown()
    assert not vllm_connector.staged_files(engine._engine_id)


@pytest.mark.parametrize("vllm, message", [
    (dict(tensor_parallel=3), "tensor_parallel = 3: must divide the model's 4 attention heads"),
    (dict(pipeline_parallel=2), "pipeline_parallel: only 1 is supported"),
    (dict(args={"distributed_executor_backend": "ray"}), "distributed_executor_backend: tensor_parallel > 1"),
    (dict(tensor_parallel=1, args={"tensor_parallel_size": 2}), "set engine.vllm.tensor_parallel instead"),
])
def test_tp_settings_that_cannot_work_are_refused(checkpoint, vllm, message):
    with pytest.raises(ConfigError, match=message):
        VllmEngine.from_config(tp_config(checkpoint, **vllm))


async def test_pdd_with_a_tp2_md_node(aiohttp_client, one_node, checkpoint):
    """The whole deployment in one process (Embedded), MD on vLLM with TP = 2 driven from the
    node's engine thread: P-RLD-MD with catch-up handoff streams the single-node tokens, and a
    second turn sends MD only the blocks its cache lacks."""
    nodes = (NodeConfig("router", "router"), NodeConfig("p0", "prefill", "A", engine=torch_engine_config()),
             NodeConfig("rld0", "rld", "A", engine=torch_engine_config()),
             NodeConfig("md0", "md", "B", engine=tp_config(checkpoint).engine))
    cfg = Config(model=model_config(checkpoint), nodes=nodes,
                 net=NetConfig(links=(ShapingConfig(name="wan", gbps=0.05, latency_ms=20.0),)),
                 policy=PolicyConfig(pipeline="P-RLD-MD", handoff_mode="catch-up", catchup_threshold=2,
                                     catchup_threshold_md_loaded=2, catchup_max_rounds=1))
    emb = Embedded(cfg)
    side = await emb.start()
    md_engine = emb.workers["md0"].aeng.engine
    assert isinstance(md_engine, VllmEngine)
    try:
        ws = await (await aiohttp_client(build_app(side.door))).ws_connect("/v1/responses")
        # One non-final round, then the final one (RLD stops): on CPU, vLLM TP = 2 takes ~1 s an
        # extend while the tiny torch RLD decodes ~225 tokens a second, so a shorter answer (or more
        # non-final rounds) lets RLD finish alone before MD catches up, and no handoff is left to test.
        prompt, n = prompt_of(120, 30), 600
        r = await chat(ws, prompt_token_ids=prompt, max_output_tokens=n, temperature=0.8, seed=78)
        assert r.final["type"] == "response.completed", r.final
        assert r.token_ids == one_node(prompt, n, temperature=0.8, seed=78)
        r.assert_positions_once_in_order()
        tl = r.timeline
        assert (tl["pipeline"], tl["handoff_mode"], tl["wan_kv_bytes"]) == ("P-RLD-MD", "catch-up",
                                                                            120 * BYTES_PER_TOKEN)
        at = tl["handoff_position"]
        assert 0 < at < n and tl["tokens_by_role"] == {"rld": at, "md": n - at}
        await side.router.drain()
        sent = emb.wan_kv_bytes()
        p2 = prompt + r.token_ids + prompt_of(40, 31)
        r2 = await chat(ws, prompt_token_ids=p2, max_output_tokens=8, temperature=0)
        assert r2.token_ids == one_node(p2, 8)
        held = (120 + n - 1) // BLOCK * BLOCK
        assert r2.final["response"]["usage"]["input_tokens_details"]["cached_tokens"] == held
        # Counted on the links: RLD's 8 tokens often end the response before P's report of
        # the send to MD (importing into vLLM TP = 2 is slow), which the timeline then lacks.
        await side.router.drain()
        assert emb.wan_kv_bytes() - sent == (len(p2) - held) * BYTES_PER_TOKEN
        state = await side.state()
    finally:
        await emb.stop()                     # stops the engines: vLLM's worker processes too
    for name, st in state["nodes"].items():
        assert st["kv_blocks_in_use"] == 0, (name, st)
        assert st["inflight"] == {"requests": 0, "transfers": 0, "sessions": 0, "pins": 0, "streams": 0}, \
            (name, st)
    idle(md_engine)
