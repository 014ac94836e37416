"""The API tests' shared fixture: `deployment`, the embedded deployment dialed by AsyncOpenAI."""

from __future__ import annotations

import pytest

from pddgw.config import Config
from tests.api.deployment import make_cfg, serve, unserve


@pytest.fixture
async def deployment(aiohttp_client):
    """-> start(cfg) -> (side, aiohttp test client, AsyncOpenAI); afterwards nothing may be left in use."""
    started = []

    async def start(cfg: Config | None = None):
        _, side, client, oai = await serve(aiohttp_client, started, cfg or make_cfg())
        return side, client, oai

    yield start
    await unserve(started)
