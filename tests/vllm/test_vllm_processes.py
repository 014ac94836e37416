"""End to end with a vLLM node: router, P and RLD (torch engine) and MD (vLLM) as separate
`pddgw serve` processes on loopback, a shaped WAN between; every path must stream what one
torch engine generates, a second turn moves only the blocks vLLM's cache lacks, and nothing
stays in use afterwards."""

from __future__ import annotations

import aiohttp
import pytest

from tests.e2e.cluster import Cluster
from tests.pipeline.pdd_client import chat

from .conftest import BLOCK, prompt_of

pytestmark = pytest.mark.slow

BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4          # layers x (K, V) x kv heads x head dim x float32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, checkpoint):
    c = Cluster(tmp_path_factory.mktemp("pdd-vllm"), model=f'path = "{checkpoint}"\ndtype = "float32"',
                md_engine=f'implementation = "vllm"\nblock_size = {BLOCK}\nnum_blocks = 64\n'
                          'max_num_batched_tokens = 256\n[nodes.engine.vllm]\nenforce_eager = true\n'
                          'gpu_memory_utilization = 0.05',
                policy="catchup_threshold = 2\ncatchup_threshold_md_loaded = 2\ncatchup_max_rounds = 2")
    c.start()
    yield c
    c.stop()


async def test_every_path_to_a_vllm_md_streams_what_one_node_generates(cluster, one_node):
    # Seeded sampling: the position-keyed draw inside vLLM (greedy is the in-process tests' too).
    temperature, seed, n = 0.9, 4242, 200
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(cluster.url + "/v1/responses")
        for i, (pipeline, mode) in enumerate([("P-MD", None), ("P-RLD-MD", "one-shot"), ("P-RLD-MD", "catch-up")]):
            prompt = prompt_of(130, i)        # nothing of it on MD yet
            r = await chat(ws, prompt_token_ids=prompt, max_output_tokens=n, temperature=temperature, seed=seed,
                           pddgw={"pipeline": pipeline, "handoff_mode": mode})
            assert r.final["type"] == "response.completed", (pipeline, mode, r.final)
            assert r.token_ids == one_node(prompt, n, temperature, seed), (pipeline, mode)
            r.assert_positions_once_in_order()
            tl = r.timeline
            assert (tl["pipeline"], tl["handoff_mode"]) == (pipeline, mode)
            assert tl["wan_kv_bytes"] == len(prompt) * BYTES_PER_TOKEN
            assert tl["tokens_by_role"].get("md", 0) > 0
    await cluster.wait_idle()


async def test_second_turn_moves_only_the_blocks_vllm_lacks(cluster, one_node):
    p1 = prompt_of(100, 30)
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(cluster.url + "/v1/responses")
        r1 = await chat(ws, prompt_token_ids=p1, max_output_tokens=12, temperature=0, pddgw={"pipeline": "P-MD"})
        assert r1.token_ids == one_node(p1, 12, 0.0, 0)
        p2 = p1 + r1.token_ids + prompt_of(40, 31)
        r2 = await chat(ws, prompt_token_ids=p2, max_output_tokens=8, temperature=0, pddgw={"pipeline": "P-MD"})
    assert r2.token_ids == one_node(p2, 8, 0.0, 0)
    held = (100 + 12 - 1) // BLOCK * BLOCK
    assert r2.final["response"]["usage"]["input_tokens_details"]["cached_tokens"] == held
    assert r2.timeline["wan_kv_bytes"] == (len(p2) - held) * BYTES_PER_TOKEN
    st = await cluster.wait_idle()
    assert st["nodes"]["md0"]["kv_blocks_in_use"] == 0
