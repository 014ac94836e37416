"""KV-chunk throughput of WebSocket links vs raw TCP between two OS processes.

    python -m pddgw.bench.transport [--json] [--sizes 64K,256K,1M,4M] [--stripes 1,2,3,4]

A peer process (loopback only) serves a pddgw `WsServer`, a raw TCP socket
and aiohttp's own WebSocket API (the reference, defaults).  For every frame
size, interleaved and repeated (the best kept): raw TCP (the physical limit
of this machine: frames of that size sent, received by `recv_into`
preallocated memory as large as the kernel offers) and the WebSocket link
(1..4 stripes, bulk server -> client and client -> server), each WebSocket
rate also as a ratio of raw TCP's.  Also: bytes on the wire and round-trip
latency of a 100-token token-ID handoff.  (P's KV pool into a decoder's pool
through the production workers: `python -m pddgw.bench.kvpath`.)
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
from aiohttp import WSMsgType, web

from pddgw.harness.peer import Ring, bench_net, raw_rate, run_peer, running_peer, serve_peer
from pddgw.logs import setup_logging
from pddgw.net import frames
from pddgw import messages as m
from pddgw.net.link import Link
from pddgw.net.ws import WsServer, connect
from pddgw.net.wsproto import ws_header_size
from pddgw.tables import add_output_args, emit, format_table

HEADS, DIM = 8, 128                       # KV chunk = [1, 2, tokens, 8, 128] float16
BYTES_PER_TOKEN = 2 * HEADS * DIM * 2
DIRECTIONS = ("s2c", "c2s")               # bulk server -> client (unmasked), client -> server (masked)
PLAIN_FRAME = 1 << 20


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    return int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20}[s[-1]] if s[-1] in "KM" else int(s)


def _fmt_size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def _chunks(rid: str, total: int, frame: int, src: memoryview) -> list[m.KVChunk]:
    tokens = frame // BYTES_PER_TOKEN
    n = max(1, total // frame)
    return [m.KVChunk(m.KVSpan(rid, 0, 1, i * tokens, (i + 1) * tokens, "float16", (1, 2, tokens, HEADS, DIM)),
                      src[:frame], i, i == n - 1) for i in range(n)]


async def _peer_main(secret: str) -> None:
    src = memoryview(os.urandom(4 << 20))

    async def handler(link: Link, msg: m.Message) -> m.Message | None:
        if isinstance(msg, m.Ready) and msg.detail.startswith("s2c"):
            _, total, frame = msg.detail.split()
            asyncio.get_running_loop().create_task(link.send_all(_chunks(msg.request_id, int(total), int(frame), src)))
        elif isinstance(msg, m.TokenIds):
            return m.Ack(msg.request_id, msg.start + len(msg.ids))
        return None   # KV chunks (c2s) land in the ring; the closing request gets an Ack

    plain = web.AppRunner(_plain_app(src), access_log=None, handle_signals=False)
    await plain.setup()
    await web.TCPSite(plain, "127.0.0.1", 0).start()
    await serve_peer(WsServer("bench-peer", bench_net(secret, 4 << 20, 60), handler, kv_sink=Ring(64 << 20)), src,
                     plain=f"http://127.0.0.1:{plain.addresses[0][1]}/plain")
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
# Measurements (this process), each -> bytes/s


async def _ws(link: Link, direction: str, total: int, frame: int, src: memoryview) -> float:
    rid = uuid.uuid4().hex
    if direction == "c2s":
        chunks = _chunks(rid, total, frame, src)
        t0 = time.perf_counter()
        await link.send_all(chunks)
        await link.request(m.Ready(rid, "c2s done"))
        return len(chunks) * frame / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    async with link.stream(rid, timeout=60) as st:
        await link.send(m.Ready(rid, f"s2c {max(1, total // frame) * frame} {frame}"))
        got = sum([msg.span.nbytes async for msg in st])  # type: ignore[union-attr]
    return got / (time.perf_counter() - t0)


async def _plain(url: str, direction: str, total: int, frame: int, src: memoryview) -> float:
    """aiohttp's own WebSocket API (defaults; messages copied into preallocated memory)."""
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
    msg = m.TokenIds(uuid.uuid4().hex, 4096, tuple(range(1000, 1100)))
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


async def _suite(addr: dict, secret: str, sizes: list[int], stripes: list[int], mib: int, repeat: int) -> dict:
    """Every measurement, interleaved, best of `repeat` -> the report."""
    def total_for(size: int) -> int:   # 64K frames move a quarter of --mib
        t = (mib << 20) // (4 if size < 256 << 10 else 1)
        return max(size, t // size * size)

    src, raw_buf = memoryview(os.urandom(4 << 20)), memoryview(bytearray(4 << 20))
    ring = Ring(64 << 20)
    links = {k: await connect(addr["ws"], "bench", bench_net(secret, 4 << 20, 60), stripes=k, kv_sink=ring)
             for k in stripes}
    ws_best: dict[tuple[int, int, str], float] = {}
    raw_best: dict[int, dict[str, float]] = {size: {} for size in sizes}
    plain_best: dict[str, float] = {}

    def keep(table: dict, key: object, rate: float) -> None:
        table[key] = max(table.get(key, 0.0), rate)

    try:
        for _ in range(repeat):
            for d in DIRECTIONS:
                keep(plain_best, d, await _plain(addr["plain"], d, total_for(PLAIN_FRAME), PLAIN_FRAME, src))
            for size in sizes:
                for op, d in ((b"S", "s2c"), (b"R", "c2s")):
                    keep(raw_best[size], d, await asyncio.to_thread(raw_rate, addr["raw"], op, total_for(size),
                                                                    size, raw_buf))
                for k in stripes:
                    for d in DIRECTIONS:
                        keep(ws_best, (size, k, d), await _ws(links[k], d, total_for(size), size, src))
        handoff = await _handoff(links[stripes[0]], 300)
    finally:
        for link in links.values():
            await link.close()
    rows = [{"frame_bytes": size, "stripes": k, "direction": d, "gb_per_s": rate / 1e9,
             "raw_gb_per_s": raw_best[size][d] / 1e9, "ratio": rate / raw_best[size][d]}
            for (size, k, d), rate in sorted(ws_best.items())]
    best_raw = {d: max(r[d] for r in raw_best.values()) for d in DIRECTIONS}
    top = {d: max((r for r in rows if r["direction"] == d), key=lambda r: r["gb_per_s"]) for d in DIRECTIONS}
    summary = {d: {"ws_gb_per_s": t["gb_per_s"], "frame_bytes": t["frame_bytes"], "stripes": t["stripes"],
                   "raw_gb_per_s": best_raw[d] / 1e9, "ratio": t["gb_per_s"] * 1e9 / best_raw[d]}
               for d, t in top.items()}
    plain = {"frame_bytes": PLAIN_FRAME, **{f"{d}_gb_per_s": v / 1e9 for d, v in plain_best.items()},
             **{f"{d}_ratio_to_best_raw": v / best_raw[d] for d, v in plain_best.items()}}
    return {"rows": rows, "raw": {str(k): v for k, v in raw_best.items()}, "summary": summary,
            "plain_aiohttp": plain, "handoff": handoff}


def _table(rep: dict) -> str:
    rows = [(_fmt_size(r["frame_bytes"]), r["stripes"], r["direction"], r["gb_per_s"], r["raw_gb_per_s"],
             r["ratio"]) for r in rep["rows"]]
    lines = [format_table(["frame", "stripes", "dir", "ws GB/s", "raw GB/s", "ratio"], rows)]
    for d, what in zip(DIRECTIONS, ("bulk server -> client (unmasked)", "bulk client -> server (masked)")):
        x = rep["summary"][d]
        lines.append(f"best {what}: {x['ws_gb_per_s']:.2f} GB/s at {_fmt_size(x['frame_bytes'])} frames, "
                     f"{x['stripes']} stripe(s) = {x['ratio']:.2f} of the best raw TCP ({x['raw_gb_per_s']:.2f} GB/s)")
    plain, handoff = rep["plain_aiohttp"], rep["handoff"]
    return "\n".join(lines + [
        f"reference, aiohttp's own WebSocket API with defaults, 1M frames: s2c {plain['s2c_gb_per_s']:.2f} GB/s "
        f"({plain['s2c_ratio_to_best_raw']:.2f} of best raw), c2s {plain['c2s_gb_per_s']:.2f} GB/s "
        f"({plain['c2s_ratio_to_best_raw']:.2f})",
        f"token-ID handoff, 100 tokens: {handoff['wire_bytes_client_to_server']} B client->server "
        f"({handoff['bytes_per_token']:.2f} B/token), {handoff['wire_bytes_server_to_client']} B server->client; "
        f"round trip (send + ack) median {handoff['rtt_ms_median']:.3f} ms, p99 {handoff['rtt_ms_p99']:.3f} ms"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pddgw.bench.transport", description=__doc__.split("\n")[0])
    add_output_args(ap)
    ap.add_argument("--sizes", default="64K,256K,1M,4M", help="KV frame sizes")
    ap.add_argument("--stripes", default="1,2,3,4", help="parallel connections per link")
    ap.add_argument("--mib", type=int, default=768, help="MiB per transfer (64K frames move a quarter)")
    ap.add_argument("--repeat", type=int, default=2, help="repeats; the best is kept")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    setup_logging("warning")      # logs go to stderr; stdout is the table / JSON
    if args.peer:
        return run_peer(_peer_main)
    import uvloop

    secret = secrets.token_hex(16)
    with running_peer("pddgw.bench.transport", secret) as addr:
        rep = uvloop.run(_suite(addr, secret, [_parse_size(s) for s in args.sizes.split(",")],
                                [int(s) for s in args.stripes.split(",")], args.mib, args.repeat))
    emit(rep, args.json, _table(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
