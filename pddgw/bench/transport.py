"""KV-chunk throughput of WebSocket links vs raw TCP between two OS processes.

    python -m pddgw.bench.transport [--json] [--sizes 64K,256K,1M,4M] [--stripes 1,2,3,4]

A peer process (spawned here, loopback only, stopped at the end) serves
both a pddgw `WsServer` and a raw TCP socket.  For every frame size the raw
TCP transfer (blocking sockets, `recv_into` preallocated memory: the physical
limit of this machine: frames of the same size sent, received as large as
the kernel offers) and the WebSocket link transfers (1..4 stripes, bulk
server -> client and client -> server) run side by side, interleaved and
repeated; the best of the repeats is reported, and each WebSocket rate as a
ratio of the raw rate for the same frame size.  Also: bytes on the wire and
round-trip latency of a 100-token token-ID handoff.  (The whole path from P's
KV pool into a decoder's pool through the production workers, on an idle and
a busy decoder: `python -m pddgw.bench.kvpath`.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import time
import uuid

import aiohttp
import orjson
from aiohttp import WSMsgType, web

from pddgw.logs import setup_logging
from pddgw.harness.peer import Ring, bench_net, raw_rate, serve_raw, spawn_peer, stop_peer, until_stdin_closes
from pddgw.net import frames
from pddgw.net import messages as m
from pddgw.net.link import Link
from pddgw.net.ws import WsServer, connect
from pddgw.net.wsproto import ws_header_size

HEADS, DIM = 8, 128                       # KV chunk = [1, 2, tokens, 8, 128] float16
BYTES_PER_TOKEN = 2 * HEADS * DIM * 2


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(s[:-1] if s[-1] in "KM" else s) * mult


def _chunks(rid: str, total: int, frame: int, src: memoryview) -> list[m.KVChunk]:
    tokens = frame // BYTES_PER_TOKEN
    n = max(1, total // frame)
    return [m.KVChunk(m.KVSpan(rid, 0, 1, i * tokens, (i + 1) * tokens, "float16", (1, 2, tokens, HEADS, DIM)),
                      src[:frame], i, i == n - 1) for i in range(n)]


async def _peer_main(secret: str) -> None:
    src = memoryview(os.urandom(4 << 20))
    raw = serve_raw(src)
    ring = Ring(64 << 20)

    async def handler(link: Link, msg: m.Message) -> m.Message | None:
        if isinstance(msg, m.Ready) and msg.detail.startswith("s2c"):
            _, total, frame = msg.detail.split()
            chunks = _chunks(msg.request_id, int(total), int(frame), src)
            asyncio.get_running_loop().create_task(link.send_all(chunks))
            return None
        if isinstance(msg, m.TokenIds):
            return m.Ack(msg.request_id, msg.start + len(msg.ids))
        return None   # KV chunks (c2s) land in `ring`; the closing request gets an Ack

    server = WsServer("bench-peer", bench_net(secret, 4 << 20, 60), handler, kv_sink=ring)
    url = await server.start("127.0.0.1", 0)
    plain = web.AppRunner(_plain_app(src), access_log=None, handle_signals=False)
    await plain.setup()
    await web.TCPSite(plain, "127.0.0.1", 0).start()
    plain_url = f"http://127.0.0.1:{plain.addresses[0][1]}/plain"
    print(orjson.dumps({"ws": url, "raw": raw.getsockname()[1], "plain": plain_url}).decode(), flush=True)
    await until_stdin_closes()
    raw.close()
    await server.close()
    await plain.cleanup()


def _plain_app(src: memoryview) -> web.Application:
    """Reference: aiohttp's own WebSocket API with default settings (no pddgw framing)."""
    dst = bytearray(len(src))

    async def handle(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                dst[:len(msg.data)] = msg.data
            elif msg.type == WSMsgType.TEXT:
                cmd = msg.data.split()
                if cmd[0] == "s2c":
                    for _ in range(int(cmd[1]) // int(cmd[2])):
                        await ws.send_bytes(src[:int(cmd[2])])
                await ws.send_str("done")
        return ws

    app = web.Application()
    app.router.add_get("/plain", handle)
    return app


# ---------------------------------------------------------------------------
# Measurements (this process)


async def _ws(link: Link, direction: str, total: int, frame: int, src: memoryview) -> float:
    rid = uuid.uuid4().hex
    if direction == "s2c":
        n = max(1, total // frame)
        t0 = time.perf_counter()
        async with link.stream(rid, timeout=60) as st:
            await link.send(m.Ready(rid, f"s2c {n * frame} {frame}"))
            got = 0
            async for msg in st:
                got += msg.span.nbytes  # type: ignore[union-attr]
        return got / (time.perf_counter() - t0)
    chunks = _chunks(rid, total, frame, src)
    t0 = time.perf_counter()
    await link.send_all(chunks)
    await link.request(m.Ready(rid, "c2s done"))
    return len(chunks) * frame / (time.perf_counter() - t0)


async def _plain(url: str, direction: str, total: int, frame: int, src: memoryview) -> float:
    """Rate of aiohttp's own WebSocket API (defaults; messages copied into preallocated memory)."""
    dst = bytearray(frame)
    async with aiohttp.ClientSession() as session, session.ws_connect(url, max_msg_size=0) as ws:
        t0 = time.perf_counter()
        if direction == "s2c":
            await ws.send_str(f"s2c {total} {frame}")
            got = 0
            async for msg in ws:
                if msg.type != WSMsgType.BINARY:
                    break
                dst[:] = msg.data
                got += len(msg.data)
            return got / (time.perf_counter() - t0)
        for _ in range(total // frame):
            await ws.send_bytes(src[:frame])
        await ws.send_str("c2s")
        await ws.receive()
        return total // frame * frame / (time.perf_counter() - t0)


async def _handoff(link: Link, iters: int) -> dict:
    rid = uuid.uuid4().hex
    msg = m.TokenIds(rid, 4096, tuple(range(1000, 1100)))
    frame = len(frames.encode_bytes(msg))
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await link.request(msg)
        lat.append(time.perf_counter() - t0)
    lat.sort()
    wire_server = frame + ws_header_size(frame, masked=False)
    wire_client = frame + ws_header_size(frame, masked=True)
    return {"tokens": 100, "frame_bytes": frame, "wire_bytes_server_to_client": wire_server,
            "wire_bytes_client_to_server": wire_client, "bytes_per_token": wire_client / 100,
            "rtt_ms_median": statistics.median(lat) * 1e3, "rtt_ms_p99": lat[int(len(lat) * 0.99) - 1] * 1e3}


async def _ws_suite(url: str, secret: str, sizes: list[int], stripes: list[int], total_for, repeat: int,
                    raw_port: int, plain_url: str) -> tuple[list[dict], dict[int, dict[str, float]], dict, dict]:
    src = memoryview(os.urandom(4 << 20))
    ring = Ring(64 << 20)
    links = {k: await connect(url, "bench", bench_net(secret, 4 << 20, 60), stripes=k, kv_sink=ring) for k in stripes}
    raw_buf = memoryview(bytearray(4 << 20))
    best: dict[tuple[int, int, str], float] = {}
    raw_best: dict[int, dict[str, float]] = {}
    plain_best: dict[str, float] = {}
    plain_frame = 1 << 20
    try:
        for _ in range(repeat):
            for direction in ("s2c", "c2s"):
                rate = await _plain(plain_url, direction, total_for(plain_frame), plain_frame, src)
                plain_best[direction] = max(plain_best.get(direction, 0.0), rate)
            for size in sizes:
                total = total_for(size)
                for op, name in ((b"S", "s2c"), (b"R", "c2s")):
                    rate = await asyncio.to_thread(raw_rate, raw_port, op, total, size, raw_buf)
                    d = raw_best.setdefault(size, {})
                    d[name] = max(d.get(name, 0.0), rate)
                for k in stripes:
                    for direction in ("s2c", "c2s"):
                        rate = await _ws(links[k], direction, total, size, src)
                        key = (size, k, direction)
                        best[key] = max(best.get(key, 0.0), rate)
        handoff = await _handoff(links[stripes[0]], 300)
    finally:
        for link in links.values():
            await link.close()
    rows = []
    for (size, k, direction), rate in sorted(best.items()):
        raw = raw_best[size][direction]
        rows.append({"frame_bytes": size, "stripes": k, "direction": direction, "gb_per_s": rate / 1e9,
                     "raw_gb_per_s": raw / 1e9, "ratio": rate / raw})
    best_raw = {d: max(r[d] for r in raw_best.values()) for d in ("s2c", "c2s")}
    plain = {"frame_bytes": plain_frame, **{f"{d}_gb_per_s": v / 1e9 for d, v in plain_best.items()},
             **{f"{d}_ratio_to_best_raw": v / best_raw[d] for d, v in plain_best.items()}}
    return rows, raw_best, handoff, plain


def _fmt_size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pddgw.bench.transport", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print machine-readable results")
    ap.add_argument("--sizes", default="64K,256K,1M,4M", help="KV frame sizes")
    ap.add_argument("--stripes", default="1,2,3,4", help="parallel connections per link")
    ap.add_argument("--mib", type=int, default=768, help="MiB per transfer (64K frames move a quarter)")
    ap.add_argument("--repeat", type=int, default=2, help="repeats; the best is kept")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import uvloop

    setup_logging("warning")      # logs go to stderr; stdout is the table / JSON

    if args.peer:
        uvloop.run(_peer_main(os.environ["PDDGW_BENCH_SECRET"]))
        return 0
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    stripes = [int(s) for s in args.stripes.split(",")]
    total_mib = args.mib

    def total_for(size: int) -> int:
        t = (total_mib << 20) // (4 if size < 256 << 10 else 1)
        return max(size, t // size * size)

    secret = secrets.token_hex(16)
    proc, addr = spawn_peer("pddgw.bench.transport", {"PDDGW_BENCH_SECRET": secret})
    try:
        rows, raw_best, handoff, plain = uvloop.run(
            _ws_suite(addr["ws"], secret, sizes, stripes, total_for, args.repeat, addr["raw"], addr["plain"]))
    finally:
        stop_peer(proc)
    summary = {}
    for d in ("s2c", "c2s"):
        top = max((r for r in rows if r["direction"] == d), key=lambda r: r["gb_per_s"])
        raw_top = max(v[d] for v in raw_best.values())
        summary[d] = {"ws_gb_per_s": top["gb_per_s"], "frame_bytes": top["frame_bytes"], "stripes": top["stripes"],
                      "raw_gb_per_s": raw_top / 1e9, "ratio": top["gb_per_s"] * 1e9 / raw_top}
    if args.json:
        print(orjson.dumps({"rows": rows, "raw": {str(k): v for k, v in raw_best.items()}, "summary": summary,
                            "plain_aiohttp": plain, "handoff": handoff}, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"{'frame':>6} {'stripes':>7} {'dir':>4} {'ws GB/s':>8} {'raw GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{_fmt_size(r['frame_bytes']):>6} {r['stripes']:>7} {r['direction']:>4} {r['gb_per_s']:>8.2f} "
              f"{r['raw_gb_per_s']:>9.2f} {r['ratio']:>6.2f}")
    for d, what in (("s2c", "bulk server -> client (unmasked)"), ("c2s", "bulk client -> server (masked)")):
        x = summary[d]
        print(f"best {what}: {x['ws_gb_per_s']:.2f} GB/s at {_fmt_size(x['frame_bytes'])} frames, "
              f"{x['stripes']} stripe(s) = {x['ratio']:.2f} of the best raw TCP ({x['raw_gb_per_s']:.2f} GB/s)")
    print(f"reference, aiohttp's own WebSocket API with defaults, 1M frames: s2c {plain['s2c_gb_per_s']:.2f} GB/s "
          f"({plain['s2c_ratio_to_best_raw']:.2f} of best raw), c2s {plain['c2s_gb_per_s']:.2f} GB/s "
          f"({plain['c2s_ratio_to_best_raw']:.2f})")
    print(f"token-ID handoff, 100 tokens: {handoff['wire_bytes_client_to_server']} B client->server "
          f"({handoff['bytes_per_token']:.2f} B/token), {handoff['wire_bytes_server_to_client']} B server->client; "
          f"round trip (send + ack) median {handoff['rtt_ms_median']:.3f} ms, p99 {handoff['rtt_ms_p99']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
