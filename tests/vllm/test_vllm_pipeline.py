"""PDD with vLLM engines: the whole deployment in one process (in-process links, shaped WAN),
P, RLD and MD each on vLLM or on the torch engine, through the front door.

Greedy tokens must equal single-node generation on every path and mix of
engines; a second turn sends MD only the blocks vLLM's prefix cache does not
hold; afterwards nothing is in use on any node, vLLM's pools included.
"""

from __future__ import annotations

import pytest

from pddgw.config import Config, NetConfig, NodeConfig, PolicyConfig, ShapingConfig
from tests.pipeline.pdd_client import chat
from tests.pipeline.test_embedded import deploy  # noqa: F401  (a fixture: stops the deployment, checks for leaks)

from .conftest import BLOCK, model_config, prompt_of, torch_engine_config, vllm_engine_config

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4          # float32


def engine(kind: str):
    return vllm_engine_config() if kind == "vllm" else torch_engine_config()


def cluster(checkpoint: str, p: str, rld: str, md: str, **policy) -> Config:
    nodes = (NodeConfig("router", "router"), NodeConfig("p0", "prefill", "A", engine=engine(p)),
             NodeConfig("rld0", "rld", "A", engine=engine(rld)), NodeConfig("md0", "md", "B", engine=engine(md)))
    return Config(model=model_config(checkpoint), nodes=nodes,
                  net=NetConfig(links=(ShapingConfig(name="wan", gbps=0.05, latency_ms=20.0),)),
                  policy=PolicyConfig(**policy))


MIXES = [("vllm", "vllm", "vllm"), ("torch", "torch", "vllm"), ("vllm", "vllm", "torch")]


@pytest.mark.parametrize("p,rld,md", MIXES, ids=["all vLLM", "torch P -> vLLM MD", "vLLM P -> torch MD"])
async def test_p_md_second_turn_sends_only_missing_blocks(deploy, one_node, checkpoint, p, rld, md):
    ws, _, _ = await deploy(cluster(checkpoint, p, rld, md, pipeline="P-MD"))
    p1 = prompt_of(100, 1)
    r1 = await chat(ws, prompt_token_ids=p1, max_output_tokens=12, temperature=0)
    assert r1.final["type"] == "response.completed", r1.final
    assert r1.token_ids == one_node(p1, 12)
    r1.assert_positions_once_in_order()
    assert (r1.timeline["pipeline"], r1.timeline["tokens_by_role"]) == ("P-MD", {"md": 12})
    assert r1.timeline["wan_kv_bytes"] == 100 * BYTES_PER_TOKEN
    p2 = p1 + r1.token_ids + prompt_of(40, 2)
    r2 = await chat(ws, prompt_token_ids=p2, max_output_tokens=8, temperature=0)
    assert r2.token_ids == one_node(p2, 8)
    md_block = BLOCK if md == "vllm" else 16
    held = (100 + 12 - 1) // md_block * md_block       # MD's full blocks of what it computed
    assert r2.final["response"]["usage"]["input_tokens_details"]["cached_tokens"] == held
    assert r2.timeline["wan_kv_bytes"] == (len(p2) - held) * BYTES_PER_TOKEN


@pytest.mark.parametrize("mode", ["one-shot", "catch-up"])
@pytest.mark.parametrize("p,rld,md", MIXES, ids=["all vLLM", "torch P -> vLLM MD", "vLLM P -> torch MD"])
async def test_p_rld_md_handoff_same_sampled_tokens(deploy, one_node, checkpoint, p, rld, md, mode):
    ws, _, _ = await deploy(cluster(checkpoint, p, rld, md, pipeline="P-RLD-MD", handoff_mode=mode,
                                 catchup_threshold=2, catchup_threshold_md_loaded=2, catchup_max_rounds=2))
    prompt = prompt_of(120, 3)
    n = 240       # RLD must not reach the end before the rounds do (the tiny model decodes fast)
    r = await chat(ws, prompt_token_ids=prompt, max_output_tokens=n, temperature=0.8, seed=77)
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == one_node(prompt, n, temperature=0.8, seed=77)
    r.assert_positions_once_in_order()
    tl = r.timeline
    assert tl["pipeline"] == "P-RLD-MD" and tl["handoff_mode"] == mode
    at = tl["handoff_position"]
    assert 0 < at < n and tl["tokens_by_role"] == {"rld": at, "md": n - at}
    assert tl["wan_kv_bytes"] == 120 * BYTES_PER_TOKEN
    if mode == "catch-up":
        # One or two catch-up rounds (how many RLD tokens a round's RTT covers depends on the
        # machine's speed), then the final one.
        assert len(tl["handoff_positions"]) in (2, 3), tl["handoff_positions"]
