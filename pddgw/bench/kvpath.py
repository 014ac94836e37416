"""End-to-end KV path: P's pool -> a WebSocket link (loopback) -> the decoder's pool.

    python -m pddgw.bench.kvpath [--json] [--layers 8 --kv-heads 8 --head-dim 64 --block-size 16]
                                 [--prompt 2048] [--chunk-kb 1024] [--repeat 3] [--busy-seqs 4 --busy-context 512]

Production code end to end: a P `WorkerNode` in its own process prefills the
prompt and streams its KV with `PrefillWorker` over a WebSocket link it
dials; two decoder `WorkerNode`s here import it through `DecodeWorker`
behind a `WsServer` set up as `run_worker` sets it up; this process plays
the router (Submit, Prefill, Cancel) and times each transfer from Prefill
until the decoder reports the KV complete.  The model is a random Llama
spec with a real KV shape (default 32 KiB a token, 512 KiB a block); P's
prefix cache holds the prompt after a warm-up.

Side by side, interleaved, on an idle decoder and on a busy one
(`--busy-seqs` sequences of `--busy-context` tokens decoding throughout):
  production  each one-block chunk received straight into its pool block
              (`WorkerNode.kv_sink`); the import only marks it present
  old         the link allocates each payload and one engine call per chunk
              copies it into the pool
  raw         the ceiling: the same bytes in frames of the same size over
              raw TCP between the same processes, into preallocated memory
Reported: GB/s (best of the repeats), ratios, copies per KV byte (1 =
received straight into the pool) from the engines' counters; both paths
must leave bit-identical KV in their pools (read back and compared).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import secrets
import statistics
import time
from dataclasses import dataclass

import orjson
import torch

from pddgw.config import EngineConfig, NetConfig
from pddgw.core.sampling import SamplingParams
from pddgw.engines.model_spec import ModelSpec, llama_spec
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import KVChunk, RequestError
from pddgw.engines.weights import build_random
from pddgw.harness.engines import Decoding
from pddgw.harness.peer import bench_net, raw_rate, serve_raw, spawn_peer, stop_peer, until_stdin_closes
from pddgw.logs import setup_logging
from pddgw.net import messages as m
from pddgw.net.link import Link
from pddgw.net.ws import WsServer
from pddgw.net.ws import connect as ws_connect
from pddgw.pipeline import protocol as pm
from pddgw.pipeline.decode import DecodeState, DecodeWorker
from pddgw.pipeline.node import WorkerNode
from pddgw.pipeline.prefill import tokens_per_chunk
from pddgw.tables import add_output_args, emit, format_table

PATHS = ("production", "old")
SEED = 7


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    prompt: int
    chunk_bytes: int
    busy_seqs: int
    busy_context: int

    def spec(self) -> ModelSpec:
        # Small hidden size, real KV shape: P computes little, every token carries its KV.
        return llama_spec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=self.layers,
                          num_heads=self.kv_heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                          max_position_embeddings=1 << 16, eos_token_ids=(1,))

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 4

    @property
    def frame_bytes(self) -> int:
        """KV bytes of P's chunks (`PrefillWorker`'s rule)."""
        return tokens_per_chunk(self.bytes_per_token, self.block_size, self.chunk_bytes) * self.bytes_per_token

    def engine_cfg(self, prefix_caching: bool) -> EngineConfig:
        tokens = self.prompt * 3 + self.busy_seqs * (self.busy_context + 4096)
        return EngineConfig(num_blocks=-(-tokens // self.block_size), block_size=self.block_size,
                            max_num_seqs=max(8, 2 * self.busy_seqs), max_num_batched_tokens=512,
                            enable_prefix_caching=prefix_caching, cpu_threads=1)

    def prompt_ids(self, k: int = 0) -> tuple[int, ...]:
        return tuple((37 * i + 11 * k) % 500 + 2 for i in range(self.prompt))


def _engine(shape: Shape, prefix_caching: bool) -> TorchEngine:
    spec = shape.spec()
    return TorchEngine(build_random(spec, SEED, torch.float32, "cpu"), spec, shape.engine_cfg(prefix_caching),
                       torch.float32)


def _sampled(**kw) -> dict:
    return dict(sampling=SamplingParams(max_tokens=4, ignore_eos=True), **kw)


# ---------------------------------------------------------------------------
# P: its own process


async def _peer_main(shape: Shape, secret: str, decoders: dict[str, str]) -> None:
    torch.set_num_threads(1)
    cfg = bench_net(secret, shape.chunk_bytes, 300)
    worker: WorkerNode | None = None

    async def connect(name: str) -> Link:   # as deploy.dial does, minus the start-up retries
        assert worker is not None
        return await ws_connect(decoders[name], "p", cfg, worker.handle, kv_sink=worker.kv_sink)

    worker = WorkerNode("p", "prefill", _engine(shape, prefix_caching=True), connect, shape.chunk_bytes)
    server = WsServer("p", cfg, worker.handle, kv_sink=worker.kv_sink)
    url = await server.start("127.0.0.1", 0)
    raw = serve_raw(memoryview(os.urandom(max(shape.frame_bytes, 1 << 20))))
    print(orjson.dumps({"ws": url, "raw": raw.getsockname()[1]}).decode(), flush=True)
    await until_stdin_closes()
    raw.close()
    await worker.stop()
    await server.close()


# ---------------------------------------------------------------------------
# Decoders and the router: this process


def _use_old_import(dec: DecodeWorker) -> None:
    """The import path before: each chunk copied into the pool by an engine call of its own."""

    async def import_kv(chunk: KVChunk) -> None:
        s = dec.sessions.get(chunk.request_id)
        if s is None or s.state != DecodeState.IMPORTING:
            raise RequestError(f"request {chunk.request_id!r} is not importing")
        await dec.aeng.call(dec.engine.import_kv, chunk)

    dec.import_kv = import_kv   # type: ignore[method-assign]


class _Decoder:
    def __init__(self, name: str, shape: Shape, cfg: NetConfig, production: bool) -> None:
        async def no_dial(peer: str) -> Link:
            raise RuntimeError("the bench decoders dial nobody")

        self.name = name
        self.engine = _engine(shape, prefix_caching=False)    # every transfer imports the whole prompt
        self.node = WorkerNode(name, "md", self.engine, no_dial, shape.chunk_bytes)
        self.first_chunk: dict[str, float] = {}               # request -> when its first chunk was handed over
        if production:
            self.server = WsServer(name, cfg, self._handle, kv_sink=self.node.kv_sink)
        else:
            self.server = WsServer(name, cfg, self._handle)
            assert self.node.decode is not None
            _use_old_import(self.node.decode)
        self.url = ""
        self.link: Link | None = None

    async def _handle(self, link: Link, msg: m.Message) -> m.Message | None:
        """The node's handler, noting when each request's first KV chunk was delivered."""
        if isinstance(msg, m.KVChunk):
            self.first_chunk.setdefault(msg.span.request_id, time.perf_counter())
        return await self.node.handle(link, msg)

    def counters(self) -> tuple[int, int]:
        return self.engine.kv_bytes_landed, self.engine.kv_bytes_copied


async def _transfer(p_link: Link, dec: _Decoder, rid: str, prompt: tuple[int, ...]) -> tuple[dict, bytes]:
    """One request's prompt KV from P's pool into `dec`'s pool; -> (timings and counters, the KV
    read back from the pool)."""
    assert dec.link is not None
    link = dec.link
    async with link.stream(rid, timeout=300) as st:
        await link.request(pm.Submit(**_sampled(request_id=rid, kv="import", hold=True, prompt=prompt)))
        landed0, copied0 = dec.counters()
        t0 = time.perf_counter()
        done = await p_link.request(pm.Prefill(**_sampled(request_id=rid, targets=(dec.name,), starts=(0,),
                                                          prompt=prompt, holds=(True,))), timeout=300)
        ready = await st.__anext__()
        t1 = time.perf_counter()
    seconds = t1 - t0
    receive_s = t1 - dec.first_chunk.pop(rid)
    assert isinstance(done, pm.PrefillDone) and done.errors == ("",), done
    assert isinstance(ready, m.Ready) and ready.detail == "kv", ready
    landed, copied = (a - b for a, b in zip(dec.counters(), (landed0, copied0)))
    eng = dec.engine
    kv = await dec.node.aeng.call(lambda: bytes(eng.export_kv(rid, 0, len(prompt)).payload))
    await link.request(m.Cancel(rid))
    return {"seconds": seconds, "receive_seconds": receive_s, "kv_bytes": len(kv), "landed_bytes": landed,
            "copied_bytes": copied, "digest": hashlib.blake2b(kv, digest_size=16).hexdigest(),
            "nonzero": any(kv[::4097])}, kv


def _busy(dec: _Decoder, shape: Shape) -> Decoding:
    """`--busy-seqs` sequences of `--busy-context` tokens decoding on `dec` throughout a measurement."""
    return Decoding(dec.node.aeng, [tuple((13 * j + i) % 500 + 2 for j in range(shape.busy_context))
                                    for i in range(shape.busy_seqs)])


def _spawn_peer(shape: Shape, secret: str, decoders: dict[str, str]):
    peer = {"shape": {f: getattr(shape, f) for f in Shape.__slots__}, "decoders": decoders}
    return spawn_peer("pddgw.bench.kvpath", {"PDDGW_BENCH_SECRET": secret,
                                              "PDDGW_KVPATH_PEER": orjson.dumps(peer).decode()})


async def _suite(shape: Shape, repeat: int) -> dict:
    torch.set_num_threads(1)
    secret = secrets.token_hex(16)
    cfg = bench_net(secret, shape.chunk_bytes, 300)
    decs = {path: _Decoder(f"d-{path}", shape, cfg, path == "production") for path in PATHS}
    for d in decs.values():
        d.url = await d.server.start("127.0.0.1", 0)
    proc, addr = _spawn_peer(shape, secret, {d.name: d.url for d in decs.values()})
    runs: dict[str, dict[str, list[dict]]] = {phase: {p: [] for p in PATHS} for phase in ("idle", "busy")}
    raw_rates: list[float] = []
    step_ms: list[float] = []
    p_link: Link | None = None
    try:
        p_link = await ws_connect(addr["ws"], "router", cfg)
        for d in decs.values():
            d.link = await ws_connect(d.url, "router", cfg)
        prompt = shape.prompt_ids()
        total = shape.prompt * shape.bytes_per_token
        frame = shape.frame_bytes
        buf = memoryview(bytearray(max(frame, 4 << 20)))
        for d in decs.values():        # warm-up: P caches the prompt; allocators, links warm
            await _transfer(p_link, d, f"warm-{d.name}", prompt)
        reference: bytes | None = None    # every measured transfer must leave exactly these bytes
        n = 0
        for r in range(repeat):
            raw_rates.append(await asyncio.to_thread(raw_rate, addr["raw"], b"S", total // frame * frame,
                                                     frame, buf))
            for phase in ("idle", "busy"):
                for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                    d = decs[path]
                    load = _busy(d, shape) if phase == "busy" else None
                    if load is not None:
                        await load.start()
                        tokens0 = load.tokens
                    n += 1
                    res, kv = await _transfer(p_link, d, f"{phase}-{path}-{n}", prompt)
                    reference = kv if reference is None else reference
                    res["identical"] = kv == reference
                    del kv
                    if load is not None:
                        made = (load.tokens - tokens0) / shape.busy_seqs
                        if made:
                            step_ms.append(res["seconds"] / made * 1e3)
                        await load.stop()
                    runs[phase][path].append(res)
        leaks = {}
        for d in decs.values():
            st = await d.node.state()
            await d.node.aeng.call(d.engine.check_integrity)
            leaks[d.name] = {"used_blocks": st.kv_blocks_in_use, "pending": st.streams}
    finally:
        for link in [p_link, *(d.link for d in decs.values())]:
            if link is not None:
                await link.close()
        stop_peer(proc)
        for d in decs.values():
            await d.node.stop()
            await d.server.close()
    return _report(shape, runs, max(raw_rates) / 1e9, step_ms, leaks, repeat)


def _report(shape: Shape, runs: dict, raw_gbps: float, step_ms: list[float], leaks: dict, repeat: int) -> dict:
    total = shape.prompt * shape.bytes_per_token
    out: dict = {
        "benchmark": "kvpath",
        "config": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                   "dtype": "float32", "block_size": shape.block_size, "prompt_tokens": shape.prompt,
                   "kv_bytes_per_token": shape.bytes_per_token, "kv_bytes": total,
                   "frame_bytes": shape.frame_bytes, "chunk_bytes": shape.chunk_bytes,
                   "repeat": repeat, "busy_seqs": shape.busy_seqs, "busy_context": shape.busy_context},
        "raw": {"gb_per_s": raw_gbps, "copies_per_byte": 1.0},
    }
    identical = True
    for phase in ("idle", "busy"):
        ph: dict = {}
        for path in PATHS:
            rs = runs[phase][path]
            identical = identical and all(r["identical"] for r in rs)
            best = min(r["seconds"] for r in rs)
            best_rx = min(r["receive_seconds"] for r in rs)
            ph[path] = {
                "gb_per_s": total / best / 1e9, "seconds_best": best,
                "seconds_median": statistics.median(r["seconds"] for r in rs),
                # From the first chunk's delivery on (P's compute and first frame excluded):
                # the rest of the KV over the link into the pool, committed.
                "receive_gb_per_s": (total - shape.frame_bytes) / best_rx / 1e9, "receive_seconds_best": best_rx,
                "copies_per_byte": 1.0 + sum(r["copied_bytes"] for r in rs) / sum(r["kv_bytes"] for r in rs),
                "landed_fraction": sum(r["landed_bytes"] for r in rs) / sum(r["kv_bytes"] for r in rs),
                "kv_digest": rs[0]["digest"], "kv_nonzero": all(r["nonzero"] for r in rs),
            }
        for key, name in (("gb_per_s", ""), ("receive_gb_per_s", "receive_")):
            prod, old = ph["production"][key], ph["old"][key]
            ph[f"{name}production_to_old"] = prod / old
            ph[f"{name}production_to_raw"] = prod / raw_gbps
            ph[f"{name}old_to_raw"] = old / raw_gbps
        out[phase] = ph
    out["busy"]["decode_step_ms"] = statistics.median(step_ms) if step_ms else None
    out["kv_identical"] = identical       # byte for byte, every transfer, both paths
    out["leaks"] = leaks
    return out


def _table(rep: dict) -> str:
    c, raw = rep["config"], rep["raw"]["gb_per_s"]
    head = (f"KV path P pool -> WebSocket (loopback) -> decoder pool: {c['prompt_tokens']} tokens x "
            f"{c['kv_bytes_per_token']} B = {c['kv_bytes'] / 2**20:.1f} MiB a request, frames of "
            f"{c['frame_bytes'] / 1024:.0f} KiB, blocks of {c['block_size']} tokens, best of {c['repeat']}\n"
            "GB/s: end to end (Prefill -> KV in pool); rx: receive (1st chunk delivered -> KV in pool)")
    rows = []
    for phase in ("idle", "busy"):
        ph = rep[phase]
        for path in PATHS:
            x, prod = ph[path], path == "production"
            rows.append((phase, path, f"{x['gb_per_s']:.3f}", ph["production_to_old"] if prod else 1.0,
                         x["gb_per_s"] / raw, f"{x['receive_gb_per_s']:.3f}",
                         ph["receive_production_to_old"] if prod else 1.0, x["receive_gb_per_s"] / raw,
                         x["copies_per_byte"], f"{x['landed_fraction']:.0%}"))
    rows.append(("-", "raw TCP", f"{raw:.3f}", None, 1.0, f"{raw:.3f}", None, 1.0, 1.0, None))
    step = rep["busy"]["decode_step_ms"]
    tail = (f"busy decoder: {c['busy_seqs']} sequences of {c['busy_context']} tokens decoding, "
            f"step ~{step:.1f} ms" if step else "busy decoder: no step completed during the transfers")
    return "\n".join([head, format_table(
        ["decoder", "path", "GB/s", "vs old", "vs raw", "rx GB/s", "rx vs old", "rx vs raw", "copies/B",
         "landed"],
        rows), tail, f"KV in both pools bit-identical: {rep['kv_identical']}; leaks: {rep['leaks']}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pddgw.bench.kvpath", description=__doc__.split("\n")[0])
    add_output_args(ap)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--chunk-kb", type=int, default=1024, help="P's KV chunk size (net.kv_frame_bytes)")
    ap.add_argument("--repeat", type=int, default=3, help="repeats; the best is kept")
    ap.add_argument("--busy-seqs", type=int, default=4, help="sequences decoding on a busy decoder")
    ap.add_argument("--busy-context", type=int, default=512, help="their context tokens")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import uvloop

    if args.peer:
        peer = orjson.loads(os.environ["PDDGW_KVPATH_PEER"])
        uvloop.run(_peer_main(Shape(**peer["shape"]), os.environ["PDDGW_BENCH_SECRET"], peer["decoders"]))
        return 0
    shape = Shape(args.layers, args.kv_heads, args.head_dim, args.block_size, args.prompt, args.chunk_kb << 10,
                  args.busy_seqs, args.busy_context)
    rep = uvloop.run(_suite(shape, args.repeat))
    emit(rep, args.json, _table(rep))
    return 0


if __name__ == "__main__":
    # Here, not in main(): a test calling main() must not reconfigure its process's logging.
    setup_logging("warning")      # logs go to stderr; stdout is the table / JSON
    raise SystemExit(main())
