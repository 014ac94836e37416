"""Test helpers: drive the front door over WebSocket and compute reference outputs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson
import torch

from pddgw.config import EngineConfig
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest, SamplingParams
from pddgw.engines.weights import build_tiny


@dataclass
class Response:
    events: list[dict] = field(default_factory=list)

    @property
    def deltas(self) -> list[dict]:
        return [e for e in self.events if e["type"] == "response.output_text.delta"]

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d["pddgw"]["token_ids"]]

    @property
    def final(self) -> dict:
        return self.events[-1]

    @property
    def timeline(self) -> dict:
        return self.final["response"]["pddgw"]

    def assert_positions_once_in_order(self) -> None:
        pos = 0
        for d in self.deltas:
            assert d["pddgw"]["position"] == pos, (d["pddgw"]["position"], pos)
            pos += len(d["pddgw"]["token_ids"])


async def create(ws, **fields) -> None:
    """Send one response.create; it asks for the token ids (`Response.token_ids` reads them) unless
    `fields` say otherwise."""
    await ws.send_str(orjson.dumps({"type": "response.create", "return_token_ids": True, **fields}).decode())


async def collect(ws, n: int = 1, timeout: float = 60.0) -> dict[str | None, Response]:
    """Read events until n responses ended (completed or error); keyed by stream_id."""
    out: dict[str | None, Response] = {}
    done = 0
    async with asyncio.timeout(timeout):
        while done < n:
            msg = await ws.receive()
            ev = orjson.loads(msg.data)
            out.setdefault(ev.get("stream_id"), Response()).events.append(ev)
            if ev["type"] in ("response.completed", "error"):
                done += 1
    return out


async def chat(ws, timeout: float = 60.0, **fields) -> Response:
    await create(ws, **fields)
    return (await collect(ws, 1, timeout))[fields.get("stream_id")]


_REF_MODELS: dict[str, torch.nn.Module] = {}


def reference(prompt, max_tokens: int, temperature: float = 0.0, seed: int = 0, top_p: float = 1.0,
              dtype: str = "float64") -> list[int]:
    """What one local engine generates for the same request (the invariant's yardstick)."""
    model = _REF_MODELS.get(dtype)
    if model is None:
        model = _REF_MODELS[dtype] = build_tiny(0, dtype, "cpu")
    eng = TorchEngine(model, model.spec, EngineConfig(num_blocks=512, max_num_batched_tokens=512),
                      model.dtype)
    eng.add_request(EngineRequest("ref", tuple(prompt), SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, top_p=top_p)))
    out: list[int] = []
    while eng.has_work():
        for o in eng.step():
            out += o.ids
    return out
