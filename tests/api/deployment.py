"""The embedded deployment behind the OpenAI HTTP API, dialed by the official client, for the API tests.

`make_cfg` is the tiny model in float64 (clear margins, so greedy outputs equal one local
engine's token for token) on P-MD behind user and admin keys; `serve` starts a config embedded
with its app on a real 127.0.0.1 port; `unserve` closes what it started once nothing is left in
use.  The `deployment` fixture (tests/api/conftest.py) wraps the two.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from pddgw.api.server import build_app
from pddgw.config import Config, EngineConfig, ModelConfig, NetConfig, PolicyConfig, ServerConfig, ShapingConfig
from pddgw.deploy.serve import Embedded
from pddgw.harness.leaks import wait_quiescent

KEY, ADMIN = "sk-user", "sk-admin"


def make_cfg(**server) -> Config:
    return Config(model=ModelConfig(dtype="float64"),
                  engine=EngineConfig(num_blocks=256, block_size=16, max_num_batched_tokens=256),
                  net=NetConfig(links=(ShapingConfig(name="wan", gbps=0.05, latency_ms=5.0),)),
                  policy=PolicyConfig(pipeline="P-MD"),
                  server=ServerConfig(api_keys=(KEY,), admin_keys=(ADMIN,), **server))


async def serve(aiohttp_client, started: list, cfg: Config, api_key: str = KEY):
    """Start `cfg` embedded, its app on a real port, dialed by AsyncOpenAI; noted in `started` for `unserve`.

    -> (emb, side, aiohttp test client, AsyncOpenAI)."""
    emb = Embedded(cfg)
    side = await emb.start()
    client = await aiohttp_client(build_app(side.door))
    oai = AsyncOpenAI(api_key=api_key, base_url=f"http://{client.server.host}:{client.server.port}/v1",
                      max_retries=0, timeout=60)
    started.append((emb, side, oai))
    return emb, side, client, oai


async def unserve(started: list) -> None:
    """Close what `serve` started, each once nothing is left in use on it."""
    for emb, side, oai in started:
        await oai.close()
        await wait_quiescent(side.state)
        await emb.stop()
