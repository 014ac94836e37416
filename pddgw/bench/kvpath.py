"""End-to-end KV path: P's pool -> a WebSocket link (loopback) -> the decoder's pool.

    python -m pddgw.bench.kvpath [--json] [--layers 8 --kv-heads 8 --head-dim 64 --block-size 16]
                                 [--prompt 2048] [--chunk-kb 1024] [--repeat 3] [--busy-seqs 4 --busy-context 512]

Production code end to end: P, a `WorkerNode` in its own process, prefills
the prompt and streams its KV over links it dials to two decoder
`WorkerNode`s here (set up as `run_worker` does); this process plays the
router and times each transfer from Prefill until the decoder reports the
KV complete.  Random Llama weights, real KV shape (default 32 KiB a token);
P's prefix cache holds the prompt after a warm-up.  Interleaved, on an idle
decoder and on a busy one (`--busy-seqs` sequences decoding throughout):
  production  each one-block chunk received straight into its pool block
  old         the link allocates each payload, one engine call a chunk copies it
  raw         the ceiling: the same frames over raw TCP into preallocated memory
Reported: GB/s (best of the repeats) end to end and from the first chunk's
delivery on (rx), ratios, copies per KV byte (1 = straight into the pool)
from the engines' counters; both paths must leave bit-identical KV in their
pools (read back and compared).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import secrets
import statistics
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass

import torch

from pddgw.config import EngineConfig, NetConfig
from pddgw.core.sampling import SamplingParams
from pddgw.engines.model_spec import llama_spec
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import KVChunk, RequestError
from pddgw.engines.weights import build_random
from pddgw.harness.engines import Decoding
from pddgw.harness.peer import bench_net, raw_rate, run_peer, running_peer, serve_peer
from pddgw.logs import setup_logging
from pddgw import messages as m
from pddgw.net.link import Link
from pddgw.net.ws import WsServer
from pddgw.net.ws import connect as ws_connect
from pddgw.pipeline.decode import DecodeState
from pddgw.pipeline.node import WorkerNode
from pddgw.pipeline.prefill import tokens_per_chunk
from pddgw.tables import add_output_args, emit, format_table

PATHS = ("production", "old")
PHASES = ("idle", "busy")
SEED = 7
SAMPLING = SamplingParams(max_tokens=4, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    prompt_tokens: int
    chunk_bytes: int
    busy_seqs: int
    busy_context: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 4

    @property
    def frame_bytes(self) -> int:
        """KV bytes of P's chunks (`PrefillWorker`'s rule)."""
        return tokens_per_chunk(self.bytes_per_token, self.block_size, self.chunk_bytes) * self.bytes_per_token

    def engine(self, prefix_caching: bool) -> TorchEngine:
        tokens = self.prompt_tokens * 3 + self.busy_seqs * (self.busy_context + 4096)
        cfg = EngineConfig(num_blocks=-(-tokens // self.block_size), block_size=self.block_size,
                           max_num_seqs=max(8, 2 * self.busy_seqs), max_num_batched_tokens=512,
                           enable_prefix_caching=prefix_caching, cpu_threads=1)
        # Small hidden size, real KV shape: P computes little, every token carries its KV.
        spec = llama_spec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=self.layers,
                          num_heads=self.kv_heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                          max_position_embeddings=1 << 16, eos_token_ids=(1,))
        return TorchEngine(build_random(spec, SEED, torch.float32, "cpu"), spec, cfg, torch.float32)


async def _peer_main(secret: str, shape: dict, decoders: dict[str, str]) -> None:
    """P, in its own process: dials the decoders (url by name) as deploy.dial does, minus the start-up retries."""
    torch.set_num_threads(1)
    sh = Shape(**shape)
    cfg = bench_net(secret, sh.chunk_bytes, 300)

    async def connect(name: str) -> Link:
        return await ws_connect(decoders[name], "p", cfg, worker.handle, kv_sink=worker.kv_sink)

    worker = WorkerNode("p", "prefill", sh.engine(prefix_caching=True), connect, sh.chunk_bytes)
    await serve_peer(WsServer("p", cfg, worker.handle, kv_sink=worker.kv_sink),
                     memoryview(os.urandom(max(sh.frame_bytes, 1 << 20))))
    await worker.stop()


class _Decoder:
    """A decoder node behind its server, on the production or the copying (`old`) import path."""

    def __init__(self, name: str, shape: Shape, cfg: NetConfig, production: bool) -> None:
        async def no_dial(peer: str) -> Link:
            raise RuntimeError("the bench decoders dial nobody")

        self.name = name
        self.engine = shape.engine(prefix_caching=False)    # every transfer imports the whole prompt
        self.node = WorkerNode(name, "md", self.engine, no_dial, shape.chunk_bytes)
        self.first_chunk: dict[str, float] = {}             # request -> when its first chunk was handed over
        self.server = WsServer(name, cfg, self._handle, kv_sink=self.node.kv_sink if production else None)
        if not production:
            self.node.decode.import_kv = self._old_import    # type: ignore[method-assign,union-attr]
        self.url = ""
        self.link: Link | None = None

    async def _old_import(self, chunk: KVChunk) -> None:
        """The copying import path (`old`): each chunk copied into the pool by an engine call of its own."""
        s = self.node.decode.sessions.get(chunk.request_id)    # type: ignore[union-attr]
        if s is None or s.state != DecodeState.IMPORTING:
            raise RequestError(f"request {chunk.request_id!r} is not importing")
        await self.node.aeng.call(self.engine.import_kv, chunk)

    async def _handle(self, link: Link, msg: m.Message) -> m.Message | None:
        """The node's handler, noting when each request's first KV chunk was delivered."""
        if isinstance(msg, m.KVChunk):
            self.first_chunk.setdefault(msg.span.request_id, time.perf_counter())
        return await self.node.handle(link, msg)

    async def close(self) -> None:
        await self.node.stop()
        await self.server.close()

    async def transfer(self, p_link: Link, rid: str, prompt: tuple[int, ...]) -> tuple[dict, bytes]:
        """One request's prompt KV from P's pool into ours -> (timings and counters, the KV read back)."""
        assert self.link is not None
        landed0, copied0 = self.engine.kv_bytes_landed, self.engine.kv_bytes_copied
        async with self.link.stream(rid, timeout=300) as st:
            await self.link.request(m.Submit(rid, kv="import", hold=True, prompt=prompt, sampling=SAMPLING))
            t0 = time.perf_counter()
            done = await p_link.request(m.Prefill(rid, targets=(self.name,), starts=(0,), prompt=prompt,
                                                   holds=(True,), sampling=SAMPLING), timeout=300)
            ready = await st.__anext__()
            t1 = time.perf_counter()
        assert isinstance(done, m.PrefillDone) and done.errors == ("",), done
        assert isinstance(ready, m.Ready) and ready.detail == "kv", ready
        kv = await self.node.aeng.call(lambda: bytes(self.engine.export_kv(rid, 0, len(prompt)).payload))
        await self.link.request(m.Cancel(rid))
        return {"seconds": t1 - t0, "receive_seconds": t1 - self.first_chunk.pop(rid), "kv_bytes": len(kv),
                "landed_bytes": self.engine.kv_bytes_landed - landed0,
                "copied_bytes": self.engine.kv_bytes_copied - copied0,
                "digest": hashlib.blake2b(kv, digest_size=16).hexdigest(), "nonzero": any(kv[::4097])}, kv


async def _suite(shape: Shape, repeat: int) -> dict:
    torch.set_num_threads(1)
    secret = secrets.token_hex(16)
    cfg = bench_net(secret, shape.chunk_bytes, 300)
    decs = {path: _Decoder(f"d-{path}", shape, cfg, path == "production") for path in PATHS}
    runs: dict[str, dict[str, list[dict]]] = {phase: {p: [] for p in PATHS} for phase in PHASES}
    raw_rates: list[float] = []
    step_ms: list[float] = []
    reference: bytes | None = None    # every measured transfer must leave exactly these bytes
    identical = True
    async with AsyncExitStack() as stack:
        for d in decs.values():
            d.url = await d.server.start("127.0.0.1", 0)
            stack.push_async_callback(d.close)
            d.link = await ws_connect(d.url, "router", cfg)
            stack.push_async_callback(d.link.close)
        addr = stack.enter_context(running_peer("pddgw.bench.kvpath", secret, shape=asdict(shape),
                                                decoders={d.name: d.url for d in decs.values()}))
        p_link = await ws_connect(addr["ws"], "router", cfg)
        stack.push_async_callback(p_link.close)
        prompt = tuple((37 * i) % 500 + 2 for i in range(shape.prompt_tokens))
        frame = shape.frame_bytes
        raw_total = shape.prompt_tokens * shape.bytes_per_token // frame * frame
        buf = memoryview(bytearray(max(frame, 4 << 20)))
        busy = [tuple((13 * j + i) % 500 + 2 for j in range(shape.busy_context)) for i in range(shape.busy_seqs)]
        for d in decs.values():        # warm-up: P caches the prompt; allocators, links warm
            await d.transfer(p_link, f"warm-{d.name}", prompt)
        for r in range(repeat):
            raw_rates.append(await asyncio.to_thread(raw_rate, addr["raw"], b"S", raw_total, frame, buf))
            for phase in PHASES:
                for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                    d = decs[path]
                    load = Decoding(d.node.aeng, busy) if phase == "busy" else None
                    if load is not None:
                        await load.start()
                        tokens0 = load.tokens
                    res, kv = await d.transfer(p_link, f"{phase}-{path}-{r}", prompt)
                    reference = kv if reference is None else reference
                    identical = identical and kv == reference
                    if load is not None:
                        if made := (load.tokens - tokens0) / shape.busy_seqs:
                            step_ms.append(res["seconds"] / made * 1e3)
                        await load.stop()
                    runs[phase][path].append(res)
        leaks = {}
        for d in decs.values():
            st = await d.node.state()
            await d.node.aeng.call(d.engine.check_integrity)
            leaks[d.name] = {"used_blocks": st.kv_blocks_in_use, "pending": st.streams}
    return _report(shape, repeat, runs, max(raw_rates) / 1e9, step_ms, identical, leaks)


def _path_report(rs: list[dict], total: int, frame: int) -> dict:
    best, best_rx = min(r["seconds"] for r in rs), min(r["receive_seconds"] for r in rs)
    kv = sum(r["kv_bytes"] for r in rs)
    return {"gb_per_s": total / best / 1e9, "seconds_best": best,
            "seconds_median": statistics.median(r["seconds"] for r in rs),
            # From the first chunk's delivery on (P's compute and first frame excluded):
            # the rest of the KV over the link into the pool, committed.
            "receive_gb_per_s": (total - frame) / best_rx / 1e9, "receive_seconds_best": best_rx,
            "copies_per_byte": 1.0 + sum(r["copied_bytes"] for r in rs) / kv,
            "landed_fraction": sum(r["landed_bytes"] for r in rs) / kv,
            "kv_digest": rs[0]["digest"], "kv_nonzero": all(r["nonzero"] for r in rs)}


def _report(shape: Shape, repeat: int, runs: dict, raw_gbps: float, step_ms: list[float], identical: bool,
            leaks: dict) -> dict:
    total = shape.prompt_tokens * shape.bytes_per_token
    out: dict = {"benchmark": "kvpath",
                 "config": {**asdict(shape), "dtype": "float32", "kv_bytes_per_token": shape.bytes_per_token,
                            "kv_bytes": total, "frame_bytes": shape.frame_bytes, "repeat": repeat},
                 "raw": {"gb_per_s": raw_gbps, "copies_per_byte": 1.0}}
    for phase in PHASES:
        ph = out[phase] = {path: _path_report(runs[phase][path], total, shape.frame_bytes) for path in PATHS}
        for rx in ("", "receive_"):
            prod, old = ph["production"][f"{rx}gb_per_s"], ph["old"][f"{rx}gb_per_s"]
            ph.update({f"{rx}production_to_old": prod / old, f"{rx}production_to_raw": prod / raw_gbps,
                       f"{rx}old_to_raw": old / raw_gbps})
    out["busy"]["decode_step_ms"] = statistics.median(step_ms) if step_ms else None
    return {**out, "kv_identical": identical, "leaks": leaks}


def _table(rep: dict) -> str:
    c, raw = rep["config"], rep["raw"]["gb_per_s"]
    rows = []
    for phase in PHASES:
        ph = rep[phase]
        for path in PATHS:
            x, prod = ph[path], path == "production"
            rows.append((phase, path, f"{x['gb_per_s']:.3f}", ph["production_to_old"] if prod else 1.0,
                         x["gb_per_s"] / raw, f"{x['receive_gb_per_s']:.3f}",
                         ph["receive_production_to_old"] if prod else 1.0, x["receive_gb_per_s"] / raw,
                         x["copies_per_byte"], f"{x['landed_fraction']:.0%}"))
    rows.append(("-", "raw TCP", f"{raw:.3f}", None, 1.0, f"{raw:.3f}", None, 1.0, 1.0, None))
    step = rep["busy"]["decode_step_ms"]
    return "\n".join([
        f"KV path P pool -> WebSocket (loopback) -> decoder pool: {c['prompt_tokens']} tokens x "
        f"{c['kv_bytes_per_token']} B = {c['kv_bytes'] / 2**20:.1f} MiB a request, frames of "
        f"{c['frame_bytes'] / 1024:.0f} KiB, blocks of {c['block_size']} tokens, best of {c['repeat']}",
        "GB/s: end to end (Prefill -> KV in pool); rx: receive (1st chunk delivered -> KV in pool)",
        format_table(["decoder", "path", "GB/s", "vs old", "vs raw", "rx GB/s", "rx vs old", "rx vs raw",
                      "copies/B", "landed"], rows),
        f"busy decoder: {c['busy_seqs']} sequences of {c['busy_context']} tokens decoding, step ~{step:.1f} ms"
        if step else "busy decoder: no step completed during the transfers",
        f"KV in both pools bit-identical: {rep['kv_identical']}; leaks: {rep['leaks']}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pddgw.bench.kvpath", description=__doc__.split("\n")[0])
    add_output_args(ap)
    for flag, default, what in (
            ("layers", 8, None), ("kv-heads", 8, None), ("head-dim", 64, None), ("block-size", 16, None),
            ("prompt", 2048, "prompt tokens"), ("chunk-kb", 1024, "P's KV chunk size (net.kv_frame_bytes)"),
            ("repeat", 3, "repeats; the best is kept"), ("busy-seqs", 4, "sequences decoding on a busy decoder"),
            ("busy-context", 512, "their context tokens")):
        ap.add_argument(f"--{flag}", type=int, default=default, help=what)
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer:
        return run_peer(_peer_main)
    import uvloop

    shape = Shape(args.layers, args.kv_heads, args.head_dim, args.block_size, args.prompt, args.chunk_kb << 10,
                  args.busy_seqs, args.busy_context)
    rep = uvloop.run(_suite(shape, args.repeat))
    emit(rep, args.json, _table(rep))
    return 0


if __name__ == "__main__":
    # Here, not in main(): a test calling main() must not reconfigure its process's logging.
    setup_logging("warning")      # logs go to stderr; stdout is the table / JSON
    raise SystemExit(main())
