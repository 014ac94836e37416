"""pddgw.harness, the pieces tests, soak and fidelity start deployments with, without a deployment.

The fault proxy (async and thread-owned) against an echo server on
loopback; the load client against a scripted router; the leak accounting and the wait until quiet on hand-written
/debug/state documents; the config writer through the real config loader;
the launcher's failure path on a process that exits; the in-process
reference against `pddgw generate` itself.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading

import aiohttp
import orjson
import pytest
from aiohttp import web

from pddgw.config import ConfigError, load_config
from pddgw.harness.client import Answer, respond
from pddgw.harness.cluster import ClusterToml, free_ports, serve_processes, toml_lines
from pddgw.harness.launch import Processes
from pddgw.harness.leaks import count_leaks, measure_leaks, state_leftovers, wait_quiescent, wait_until_quiet
from pddgw.harness.proxy import FROM_TARGET, TO_TARGET, FaultProxy, ThreadedProxy
from pddgw.harness.reference import generate_cli, generate_cli_many, generate_engine

# ---- the fault proxy --------------------------------------------------------------------------


async def _echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while data := await r.read(1 << 16):
        w.write(data)
        await w.drain()
    w.close()


async def _dropped(r: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(r.read(), 5) == b""
    except ConnectionError:
        return True


async def test_fault_proxy_cut_slow_heal():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    proxy = FaultProxy(server.sockets[0].getsockname()[1])
    await proxy.start()
    loop = asyncio.get_running_loop()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        w.write(b"x" * 1000)
        assert await r.readexactly(1000) == b"x" * 1000

        proxy.slow(0.8)                     # 0.8 Mbit/s = 100 kB/s each way: 20 kB takes >= 0.2 s
        t = loop.time()
        w.write(b"y" * 20_000)
        assert await asyncio.wait_for(r.readexactly(20_000), 5) == b"y" * 20_000
        assert loop.time() - t >= 0.19

        proxy.cut()                         # open connections drop, new ones are refused
        assert await _dropped(r)
        r2, w2 = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _dropped(r2)
        w.close()
        w2.close()

        proxy.heal()
        r3, w3 = await asyncio.open_connection("127.0.0.1", proxy.port)
        t = loop.time()
        w3.write(b"z" * 20_000)
        assert await asyncio.wait_for(r3.readexactly(20_000), 5) == b"z" * 20_000
        assert loop.time() - t < 0.19        # full speed again
        w3.close()
        assert proxy.bytes[TO_TARGET] >= 41_000 and proxy.bytes[FROM_TARGET] >= 41_000
    finally:
        await proxy.close()
        server.close()
    with pytest.raises(ValueError, match="slow: the bandwidth must be > 0 Mbit/s, not 0"):
        proxy.slow(0)


def _roundtrip(port: int, payload: bytes) -> bytes:
    """What comes back of `payload` through the proxy (b"" when the connection is refused: reset)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        got = b""
        try:
            s.sendall(payload)
            while len(got) < len(payload) and (chunk := s.recv(1 << 16)):
                got += chunk
        except ConnectionError:
            pass
        return got


def test_threaded_proxy_serves_a_sync_caller_and_cuts():
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(_echo, "127.0.0.1", 0))
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    proxy = ThreadedProxy(server.sockets[0].getsockname()[1])
    try:
        assert _roundtrip(proxy.port, b"a" * 5000) == b"a" * 5000
        assert proxy.bytes == {TO_TARGET: 5000, FROM_TARGET: 5000}
        proxy.cut()
        assert _roundtrip(proxy.port, b"b" * 10) == b""        # refused: reset at once, nothing echoed
        proxy.heal()
        assert _roundtrip(proxy.port, b"c" * 10) == b"c" * 10
        assert proxy.bytes == {TO_TARGET: 5010, FROM_TARGET: 5010}
    finally:
        proxy.close()
        proxy.close()                                           # twice: a no-op
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        server.close()


# ---- the load client ------------------------------------------------------------------------------


def _scripted(events: list[dict], close: bool = False):
    """A /v1/responses that answers any response.create with `events` (then closes, if `close`)."""
    seen: list[dict] = []

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        seen.append(orjson.loads((await ws.receive()).data))
        for ev in events:
            await ws.send_str(orjson.dumps(ev).decode())
        if close:
            await ws.close()
        else:
            await ws.receive()
        return ws

    app = web.Application()
    app.router.add_get("/v1/responses", handler)
    return app, seen


def _delta(position: int, ids: list[int]) -> dict:
    return {"type": "response.output_text.delta", "pddgw": {"position": position, "token_ids": ids}}


async def test_respond_reads_one_response_into_an_answer(aiohttp_client):
    done = {"type": "response.completed", "response": {"id": "r1", "pddgw": {"output_token_ids": [7, 8, 9]}}}
    app, seen = _scripted([{"type": "response.created", "response": {"id": "r1"}},
                           _delta(0, [7]), _delta(1, [8, 9]), done])
    client = await aiohttp_client(app)
    async with client.ws_connect("/v1/responses") as ws:
        a = await respond(ws, Answer(), (1, 2, 3), 3, temperature=0.5, seed=11)
    assert seen == [{"type": "response.create", "prompt_token_ids": [1, 2, 3], "max_output_tokens": 3,
                     "temperature": 0.5, "seed": 11, "return_token_ids": True}]
    assert (a.tokens, a.positions_ok, a.response_id, a.final, a.closed) == ([7, 8, 9], True, "r1", done, None)
    # One gap per token after the first: the second delta's wait, then 0 inside it.
    assert len(a.itl) == 2 and a.itl[1] == 0.0 and a.itl[0] >= 0.0
    assert a.sent_t <= a.first_t <= a.last_t <= a.end_t


async def test_respond_flags_a_skipped_position_and_a_closed_socket(aiohttp_client):
    app, _ = _scripted([_delta(0, [5]), _delta(2, [6])], close=True)
    client = await aiohttp_client(app)
    async with client.ws_connect("/v1/responses") as ws:
        a = await respond(ws, Answer(), (1,), 4)
    assert (a.tokens, a.positions_ok, a.final, a.end_t, a.closed) == ([5, 6], False, None, None, "CLOSE")


# ---- leaks ---------------------------------------------------------------------------------------

IDLE = {"inflight": {"requests": 0, "transfers": 0, "sessions": 0, "pins": 0, "streams": 0},
        "kv_blocks_in_use": 0, "healthy": True}
QUIET = {"router": {"active_requests": 0, "inflight": {"requests": 0}}, "nodes": {"p0": IDLE}}


def test_leak_accounting():
    doc = {"router": {"active_requests": 1, "inflight": {"requests": 1, "queued": 0, "wan_backlog_bytes": 4096}},
           "nodes": {"p0": {**IDLE, "kv_blocks_in_use": 62, "inflight": {**IDLE["inflight"], "requests": 1}},
                     "md0": {**IDLE, "inflight": {**IDLE["inflight"], "streams": 3, "pins": 2}},
                     "rld0": {"healthy": False, "error": "link CLOSED"}}}
    left = state_leftovers(doc)
    assert left == {"router": {"requests": 1, "wan_backlog_bytes": 4096, "active_requests": 1},
                    "p0": {"requests": 1, "kv_blocks_in_use": 62}, "md0": {"streams": 3, "pins": 2}}
    # blocks, pins, everything else (a byte counter counts once)
    assert count_leaks(left) == (62, 2, 1 + 1 + 1 + 1 + 3)
    assert state_leftovers(QUIET) == {}


def _states(*docs: dict):
    """A /debug/state that answers `docs` in turn (the last one from then on); counts the calls."""
    calls = []

    async def state() -> dict:
        calls.append(1)
        return docs[min(len(calls), len(docs)) - 1]
    return state, calls


async def test_wait_until_quiet_polls_until_nothing_is_left():
    busy = {**QUIET, "nodes": {"p0": {**IDLE, "kv_blocks_in_use": 3}}}
    state, calls = _states(busy, busy, QUIET)
    left, doc, _ = await wait_until_quiet(state, 60.0, 0.0)
    assert (left, doc, len(calls)) == ({}, QUIET, 3)
    state, calls = _states(busy, QUIET)
    assert await wait_quiescent(state) == QUIET and len(calls) == 2
    state, calls = _states(busy)
    with pytest.raises(AssertionError, match=r"still in use after 0 s: \{'p0': \{'kv_blocks_in_use': 3\}\}"):
        await wait_quiescent(state, timeout=0.0)
    leaks, doc = await measure_leaks(state, 0.0)
    assert (leaks.quiet, leaks.blocks, leaks.pins, leaks.inflight) == (False, 3, 0, 0) and doc == busy
    assert leaks.unhealthy_nodes == [] and leaks.leftovers == {"p0": {"kv_blocks_in_use": 3}}


async def test_a_restarted_node_is_waited_for_until_the_router_reaches_it():
    redialing = {**QUIET, "nodes": {"p0": IDLE, "rld0": {"healthy": False, "error": "link CLOSED"}}}
    back = {**QUIET, "nodes": {"p0": IDLE, "rld0": IDLE}}
    state, calls = _states(redialing, redialing, back)
    leaks, doc = await measure_leaks(state, 60.0, expect_healthy=["rld0"])
    assert (leaks.quiet, leaks.unhealthy_nodes, doc, len(calls)) == (True, [], back, 3)
    state, calls = _states(redialing)                  # not expected back: quiet at once, listed unhealthy
    leaks, _ = await measure_leaks(state, 60.0)
    assert (leaks.quiet, leaks.unhealthy_nodes, len(calls)) == (True, ["rld0"], 1)


async def test_an_unreachable_router_is_a_leak_not_a_quiet_deployment():
    async def down() -> dict:
        raise aiohttp.ClientConnectionError("refused")

    leaks, doc = await measure_leaks(down, 0.0)
    assert (leaks.quiet, leaks.blocks, leaks.pins, leaks.inflight, doc) == (False, 0, 0, 1, {})
    assert leaks.leftovers == {"router": {"state": "unreachable: ClientConnectionError('refused')"}}


# ---- the config and the processes --------------------------------------------------------------


def test_toml_lines():
    assert toml_lines(a=1, b=2.5, c=True, d='say "hi"', e=False) == (
        'a = 1\nb = 2.5\nc = true\nd = "say \\"hi\\""\ne = false')
    with pytest.raises(TypeError, match="toml_lines: list is not a TOML scalar"):
        toml_lines(x=[1])


def test_cluster_toml_is_the_pdd_topology_behind_a_proxy(tmp_path):
    ports = {"router": 20001, "p0": 20002, "rld0": 20003, "md0": 20004}
    toml = ClusterToml(server="allow_request_steering = true", policy="catchup_threshold = 100",
                       p_engine="num_blocks = 64", md_engine="block_size = 32\nnum_blocks = 128",
                       wan="gbps = 0.5\nlatency_ms = 7.0", log='level = "warning"')
    cfg = load_config(toml.write(tmp_path / "config.toml", ports, "s" * 26, md_dialed=20099))
    assert [(n.name, n.role, n.cluster, n.port) for n in cfg.nodes] == [
        ("router", "router", "A", 0), ("p0", "prefill", "A", 20002), ("rld0", "rld", "A", 20003),
        ("md0", "md", "B", 20099)]
    assert (cfg.server.host, cfg.server.port, cfg.server.allow_request_steering) == ("127.0.0.1", 20001, True)
    assert (cfg.node("p0").engine.num_blocks, cfg.node("p0").engine.block_size) == (64, 16)
    assert (cfg.node("md0").engine.num_blocks, cfg.node("md0").engine.block_size) == (128, 32)
    assert (cfg.engine.num_blocks, cfg.engine.block_size, cfg.model.dtype) == (256, 16, "float64")
    assert (cfg.policy.catchup_threshold, cfg.log.level, cfg.net.secret) == (100, "warning", "s" * 26)
    assert (cfg.net.heartbeat_s, cfg.net.stripes, cfg.net.dead_after_s) == (0.5, 2, 2.0)
    (wan,) = cfg.net.links
    assert (wan.name, wan.gbps, wan.latency_ms) == ("wan", 0.5, 7.0)
    # md0 listens on its own port; the others dial the proxy's.
    procs = serve_processes(tmp_path, tmp_path / "config.toml", ports)
    assert list(procs.nodes) == ["md0", "rld0", "p0", "router"]
    assert procs.nodes["md0"].args[-2:] == ["--port", "20004"] and procs.nodes["md0"].port == 20004
    assert procs.nodes["router"].args == ["serve", "--role", "router", "--node", "router", "--config",
                                          str(tmp_path / "config.toml")]


def test_a_bad_option_fails_when_written_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="stripes"):
        ClusterToml(net="stripes = 0").write(tmp_path / "config.toml", free_ports())


def test_a_node_that_exits_fails_the_wait_with_its_log(tmp_path):
    procs = Processes(tmp_path)
    procs.add("v", ["--version"], 1)
    with pytest.raises(RuntimeError, match=r"v exited \(rc 0\):\npddgw "):
        procs.start(timeout_s=60)
    node = procs.nodes["v"]
    assert (node.alive, node.returncode, node.kills, procs.kill("v")) == (False, 0, 0, None)
    assert procs.restart("v") is True and procs.nodes["v"].restarts == 1
    assert procs.nodes["v"].proc.wait(60) == 0
    procs.stop()                                                # nothing left to stop
    assert procs.log("v").count("pddgw ") == 2 and procs.rss_kb("v") is None     # a restart appends
    with pytest.raises(ValueError, match="node 'v' is already declared"):
        procs.add("v", [], 1)


def test_a_node_may_run_another_command_with_its_own_environment(tmp_path):
    procs = Processes(tmp_path)
    procs.add("other", ["-c", "import os, sys; print(sys.argv[1:], os.environ['PDDGW_TEST_NODE'])", "a"], 1,
              command=(sys.executable,), env={"PDDGW_TEST_NODE": "given"})
    with pytest.raises(RuntimeError, match=r"other exited \(rc 0\):\n\['a'\] given\n"):
        procs.start(timeout_s=60)


# ---- the reference ---------------------------------------------------------------------------------


def test_reference_is_what_pddgw_generate_prints():
    prompts = [(tuple(40 + i % 50 for i in range(70)), 6), ((5, 6, 7), 3)]
    ours = generate_engine(prompts, "float64")
    assert ours == asyncio.run(generate_cli_many(prompts[:1], "float64")) + ours[1:]
    assert [len(t) for t in ours] == [6, 3]
    # Seeded sampling: the engine and the command agree at a temperature too.
    assert generate_engine(prompts[1:], "float64", 0.9, 7) == [generate_cli((5, 6, 7), 3, 0.9, 7)]
