"""Prometheus metrics at /metrics: the router's (with the embedded workers') and a worker's own.

Requests run through the embedded deployment (the tiny model in float64, as
in test_embedded.py); each test scrapes before and after and asserts exact
deltas, parsed with prometheus-client's own parser.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pddgw.api.server import build_app
from pddgw.config import Config, EngineConfig, ModelConfig, NetConfig, NodeConfig
from pddgw.harness.ports import free_port
from pddgw.deploy.serve import Embedded, run_worker

from .pdd_client import chat, collect, create
from .test_embedded import make_cfg, prompt_of

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 8      # layers x (K, V) x kv heads x head dim x float64

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """-> ({(sample name, sorted labels): value}, {family name: type})."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, key          # no series twice (merged families)
            samples[key] = s.value
    return samples, types


class Scraper:
    def __init__(self, client):
        self.client = client

    async def __call__(self) -> tuple[Samples, dict[str, str]]:
        resp = await self.client.get("/metrics")
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(await resp.text())


def val(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return val(after, name, **labels) - val(before, name, **labels)


@pytest.fixture
async def deploy(aiohttp_client):
    """-> start(cfg) -> (ws, side, scrape): the front door with its /metrics."""
    started = []

    async def start(cfg: Config):
        emb = Embedded(cfg)
        side = await emb.start()
        app = build_app(side.door)
        client = await aiohttp_client(app)
        ws = await client.ws_connect("/v1/responses")
        started.append((emb, side))
        return ws, side, Scraper(client)

    yield start
    for emb, side in started:
        await side.router.drain()
        await emb.stop()


async def test_p_md_counts_exactly(deploy):
    ws, side, scrape = await deploy(make_cfg(pipeline="P-MD"))
    before, _ = await scrape()
    p = prompt_of(150)
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=20, temperature=0)
    assert r.final["type"] == "response.completed", r.final
    await side.router.drain()
    after, types = await scrape()

    assert all(name.startswith("pddgw:") for name in types), sorted(types)
    for name, typ in (("pddgw:time_to_first_token_seconds", "histogram"),
                      ("pddgw:inter_token_latency_seconds", "histogram"),
                      ("pddgw:e2e_request_latency_seconds", "histogram"),
                      ("pddgw:request_queue_time_seconds", "histogram"),
                      ("pddgw:prompt_tokens", "counter"), ("pddgw:generation_tokens", "counter"),
                      ("pddgw:kv_cache_usage_perc", "gauge"), ("pddgw:prefix_cache_queries", "counter"),
                      ("pddgw:prefix_cache_hits", "counter"), ("pddgw:num_requests_running", "gauge"),
                      ("pddgw:num_requests_waiting", "gauge"), ("pddgw:kv_transfer_bytes", "counter"),
                      ("pddgw:kv_transfer_time_seconds", "histogram"), ("pddgw:handoffs", "counter"),
                      ("pddgw:handoff_stall_seconds", "histogram"), ("pddgw:pipeline_requests", "counter")):
        assert types.get(name) == typ, (name, types.get(name))

    assert delta(before, after, "pddgw:generation_tokens_total") == 20
    assert delta(before, after, "pddgw:prompt_tokens_total") == 150
    assert {role: delta(before, after, "pddgw:generation_tokens_by_role_total", role=role)
            for role in ("prefill", "rld", "md")} == {"prefill": 1, "rld": 0, "md": 19}
    assert val(after, "pddgw:rld_token_share") == 0.0
    assert {pl: delta(before, after, "pddgw:pipeline_requests_total", pipeline=pl)
            for pl in ("P-MD", "P-RLD-MD", "P-RLD")} == {"P-MD": 1, "P-RLD-MD": 0, "P-RLD": 0}
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(before, after, f"pddgw:{hist}_count") == 1, hist
    assert delta(before, after, "pddgw:request_queue_time_seconds_sum") == 0.0        # it never queued
    # One inter-token observation per delivered run after the first (each run is one delta event).
    assert delta(before, after, "pddgw:inter_token_latency_seconds_count") == len(r.deltas) - 1
    ttft_s = delta(before, after, "pddgw:time_to_first_token_seconds_sum")
    assert ttft_s == pytest.approx(r.timeline["ttft_ms"] / 1000.0, abs=1e-6)
    assert delta(before, after, "pddgw:request_success_total", finished_reason="length") == 1
    assert delta(before, after, "pddgw:handoffs_total", mode="one-shot") == 0
    assert delta(before, after, "pddgw:handoffs_total", mode="catch-up") == 0
    assert delta(before, after, "pddgw:wan_kv_bytes_total") == 150 * BYTES_PER_TOKEN

    # Per link and class: P-MD's KV goes to MD, foreground only; nothing to RLD.
    kv = {(peer, cls): delta(before, after, "pddgw:kv_transfer_bytes_total", node="p0", peer=peer, priority=cls)
          for peer in ("md0", "rld0") for cls in ("foreground", "background")}
    assert kv == {("md0", "foreground"): 150 * BYTES_PER_TOKEN, ("md0", "background"): 0,
                  ("rld0", "foreground"): 0, ("rld0", "background"): 0}
    assert delta(before, after, "pddgw:kv_transfer_time_seconds_count",
                 node="p0", peer="md0", priority="foreground") == 1
    assert delta(before, after, "pddgw:kv_transfer_time_seconds_sum",
                 node="p0", peer="md0", priority="foreground") > 0

    # Every node's engine series, labelled by node and role; nothing held once idle.
    for node, role in (("p0", "prefill"), ("rld0", "rld"), ("md0", "md")):
        assert val(after, "pddgw:kv_cache_usage_perc", node=node, role=role) == 0.0
        assert ("pddgw:prefix_cache_queries_total", (("node", node), ("role", role))) in after
    assert delta(before, after, "pddgw:prefix_cache_queries_total", node="p0", role="prefill") == 150
    assert delta(before, after, "pddgw:prefix_cache_hits_total", node="p0", role="prefill") == 0
    assert val(after, "pddgw:num_requests_running") == 0
    assert val(after, "pddgw:num_requests_waiting") == 0

    # Turn 2 re-sends turn 1: P's prefix cache serves it (hits in tokens).
    p2 = p + r.token_ids + prompt_of(25, 50)
    r2 = await chat(ws, prompt_token_ids=p2, max_output_tokens=4, temperature=0)
    assert r2.final["type"] == "response.completed", r2.final
    await side.router.drain()
    again, _ = await scrape()
    assert delta(after, again, "pddgw:prefix_cache_queries_total", node="p0", role="prefill") == len(p2)
    # P (block 16) holds the full blocks of the prompt it computed; MD (block 32) those of
    # what it computed, the prompt and the answer less its last token.
    assert delta(after, again, "pddgw:prefix_cache_hits_total", node="p0", role="prefill") == 150 // 16 * 16
    assert delta(after, again, "pddgw:prefix_cache_hits_total", node="md0", role="md") == (150 + 20 - 1) // 32 * 32
    assert delta(after, again, "pddgw:prefix_cache_queries_total", node="md0", role="md") == len(p2)
    assert delta(after, again, "pddgw:prompt_tokens_total") == len(p2)
    assert delta(after, again, "pddgw:generation_tokens_total") == 4


@pytest.mark.parametrize("mode", ["one-shot", "catch-up"])
async def test_p_rld_md_counts_the_handoff_and_both_links(deploy, mode):
    ws, side, scrape = await deploy(make_cfg(pipeline="P-RLD-MD", handoff_mode=mode, catchup_threshold=2,
                                             catchup_threshold_md_loaded=2, catchup_max_rounds=2))
    before, _ = await scrape()
    p = prompt_of(120)
    n = 300
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=n, temperature=0.8, seed=77)
    assert r.final["type"] == "response.completed", r.final
    await side.router.drain()
    after, _ = await scrape()
    tl = r.timeline
    assert tl["pipeline"] == "P-RLD-MD" and tl["handoff_mode"] == mode
    at = tl["handoff_position"]

    assert delta(before, after, "pddgw:pipeline_requests_total", pipeline="P-RLD-MD") == 1
    assert delta(before, after, "pddgw:pipeline_requests_total", pipeline="P-MD") == 0
    assert delta(before, after, "pddgw:handoffs_total", mode=mode) == 1
    other = "catch-up" if mode == "one-shot" else "one-shot"
    assert delta(before, after, "pddgw:handoffs_total", mode=other) == 0
    assert delta(before, after, "pddgw:handoff_stall_seconds_count", mode=mode) == 1
    stall = delta(before, after, "pddgw:handoff_stall_seconds_sum", mode=mode)
    assert stall == pytest.approx(tl["handoff_stall_ms"] / 1000.0, abs=1e-6)
    assert delta(before, after, "pddgw:generation_tokens_total") == n
    assert {role: delta(before, after, "pddgw:generation_tokens_by_role_total", role=role)
            for role in ("prefill", "rld", "md")} == {"prefill": 1, "rld": at - 1, "md": n - at}
    assert val(after, "pddgw:rld_token_share") == pytest.approx((at - 1) / (n - 1))
    assert delta(before, after, "pddgw:fallbacks_total") == 0
    assert delta(before, after, "pddgw:redrives_total") == 0

    # RLD gets all the KV over the fabric, MD all of it over the WAN (it held nothing); both live.
    fabric = {cls: delta(before, after, "pddgw:kv_transfer_bytes_total", node="p0", peer="rld0", priority=cls)
              for cls in ("foreground", "background")}
    assert fabric == {"foreground": 120 * BYTES_PER_TOKEN, "background": 0}
    wan = {cls: delta(before, after, "pddgw:kv_transfer_bytes_total", node="p0", peer="md0", priority=cls)
           for cls in ("foreground", "background")}
    assert sum(wan.values()) == 120 * BYTES_PER_TOKEN and wan["foreground"] > 0
    assert delta(before, after, "pddgw:kv_transfer_time_seconds_count",
                 node="p0", peer="rld0", priority="foreground") == 1


async def test_wan_bytes_reported_after_the_response_count(deploy):
    """RLD answers 3 tokens long before P's KV reaches MD over a 1 Mbps WAN (~1 s for 120
    tokens): the response's timeline closes without P's report, the counter still gets it."""
    ws, side, scrape = await deploy(make_cfg(gbps=0.001, pipeline="P-RLD-MD"))
    before, _ = await scrape()
    p = prompt_of(120)
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=3, temperature=0)
    assert r.final["type"] == "response.completed", r.final
    assert r.timeline["tokens_by_role"] == {"prefill": 1, "rld": 2} and r.timeline["wan_kv_bytes"] == 0
    await side.router.drain()                    # MD's alignment: P's KV is in
    after, _ = await scrape()
    assert delta(before, after, "pddgw:wan_kv_bytes_total") == 120 * BYTES_PER_TOKEN


async def test_a_worker_serves_its_own_node_metrics_without_auth():
    """run_worker's /metrics: that node's series only, no Authorization needed."""
    port = free_port()
    md = NodeConfig("md0", "md", "B", port=port)
    cfg = Config(model=ModelConfig(dtype="float64"), engine=EngineConfig(num_blocks=64, block_size=16),
                 net=NetConfig(secret="metrics-test-secret-0123"),
                 nodes=(NodeConfig("router", "router", "A"), NodeConfig("p0", "prefill", "A", port=free_port()),
                        md))
    ready = asyncio.Event()
    task = asyncio.create_task(run_worker(cfg, md, host="127.0.0.1", ready=ready))
    try:
        async with asyncio.timeout(60):
            await ready.wait()
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
                samples, types = parse(await resp.text())
            async with session.get(f"http://127.0.0.1:{port}/debug/state") as resp:
                assert resp.status == 401        # the state still needs the secret
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert val(samples, "pddgw:kv_cache_usage_perc", node="md0", role="md") == 0.0
    assert val(samples, "pddgw:prefix_cache_queries_total", node="md0", role="md") == 0
    assert "pddgw:time_to_first_token_seconds" not in types           # the router's, not a node's
    assert {dict(labels).get("node") for _, labels in samples} == {"md0"}


async def test_a_request_that_waits_for_kv_room_counts_its_queue_time(deploy):
    """MD's pool holds one of these requests at a time: the second waits in the room queue
    until the first ends, and its wait is what request_queue_time_seconds records."""
    from pddgw.deploy.serve import embedded_nodes

    cfg = make_cfg(pipeline="P-MD")
    nodes = tuple(dataclasses.replace(n, engine=dataclasses.replace(n.engine, num_blocks=16)) if n.role == "md"
                  else n for n in embedded_nodes(cfg))          # MD: 16 blocks of 32 tokens
    ws, side, scrape = await deploy(dataclasses.replace(cfg, nodes=nodes))
    before, _ = await scrape()
    a, b = prompt_of(300), prompt_of(300, 45)                     # 10 blocks each on MD
    await create(ws, prompt_token_ids=a, max_output_tokens=200, temperature=0, stream_id="a")
    while True:                                                   # A decodes on MD: it holds its blocks
        msg = orjson.loads((await ws.receive()).data)
        if msg["type"] == "response.output_text.delta":
            break
    await create(ws, prompt_token_ids=b, max_output_tokens=4, temperature=0, stream_id="b")
    done = await collect(ws, 2)
    assert {sid: r.final["type"] for sid, r in done.items()} == {"a": "response.completed",
                                                                  "b": "response.completed"}
    after, _ = await scrape()
    assert delta(before, after, "pddgw:request_queue_time_seconds_count") == 2
    waited = delta(before, after, "pddgw:request_queue_time_seconds_sum")
    assert waited > 0
    # B's E2E covers its wait; the queue holds nobody now.
    assert delta(before, after, "pddgw:e2e_request_latency_seconds_sum") > waited
    assert val(after, "pddgw:num_requests_waiting") == 0
    assert delta(before, after, "pddgw:request_queue_refused_total") == 0
    assert delta(before, after, "pddgw:pipeline_requests_total", pipeline="P-MD") == 2



def _samples(registry, prefix: str) -> dict[tuple, float]:
    """{(name without `prefix`, labels): value} of the registry's samples named `prefix`..."""
    return {(smp.name[len(prefix):], tuple(sorted(smp.labels.items()))): smp.value
            for fam in registry.collect() for smp in fam.samples
            if smp.name.startswith(prefix) and not smp.name.endswith("_created")}


def test_runs_counted_locally_are_exact_at_every_scrape():
    """The router counts each run's inter-token gap and tokens locally and applies them when
    its registry is collected (or every `_MAX_PENDING` runs): what a scrape reads is what
    observing each run at once gives, to the last bit of the histogram's sum."""
    from prometheus_client import CollectorRegistry, Histogram

    from pddgw import metrics as pm

    rm = pm.RouterMetrics()
    ref_reg = CollectorRegistry()
    ref = Histogram("ref_itl", "", buckets=pm.ITL_BUCKETS, registry=ref_reg)
    t, total, by_role = 0.0, 0, {"prefill": 0, "rld": 0, "md": 0}
    for n in (1, 7, pm._MAX_PENDING + 3, 2 * pm._MAX_PENDING):   # scrapes in between, the bound crossed
        for i in range(n):
            role, count = ("prefill" if i % 5 == 0 else "rld" if i % 3 else "md"), 1 + i % 4
            prev, t = (t if total else None), t + 0.001 * ((i * 7919) % 613) + 1e-9 * i
            rm.emitted(role, count, t, prev, 0.0, 100)
            if prev is not None:
                ref.observe(max(0.0, t - prev))
            total += count
            by_role[role] += count
        assert _samples(rm.registry, pm.PREFIX + "inter_token_latency_seconds") == _samples(ref_reg, "ref_itl")
        tokens = _samples(rm.registry, pm.PREFIX + "generation_tokens")
        assert tokens.pop(("_total", ())) == total
        assert tokens == {("_by_role_total", (("role", r),)): float(v) for r, v in by_role.items()}
