"""One response over the router's /v1/responses WebSocket, as a load client sees it.

`respond` sends one `response.create` (token ids in, a binary frame) and
reads its events into an `Answer` until `response.completed` or `error`
(`final`), or until the socket closes (`closed`).  The answer is filled in
place as events arrive, so a caller that cancels a response still holds
what streamed before the cancel.  Times are the event loop's clock.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass(slots=True)
class Answer:
    tokens: list[int] = field(default_factory=list)
    positions_ok: bool = True          # every delta came at the next position, none empty
    response_id: str | None = None     # from response.created
    sent_t: float = 0.0
    first_t: float | None = None       # the first delta
    last_t: float = 0.0                # the latest delta
    # Gap before each token: the first token of a delta waited since the last delta, the rest 0.
    itl: array = field(default_factory=lambda: array("d"))
    end_t: float | None = None         # when `final` came
    final: dict[str, Any] | None = None            # the response.completed or error event
    closed: str | None = None          # the WebSocket message type that ended it early (e.g. "CLOSED")


async def respond(ws: aiohttp.ClientWebSocketResponse, answer: Answer, prompt: Sequence[int], max_tokens: int,
                  temperature: float = 0.0, seed: int = 0) -> Answer:
    """Send one response.create and read its events into `answer` (-> `answer`)."""
    loop = asyncio.get_running_loop()
    answer.sent_t = loop.time()
    await ws.send_bytes(orjson.dumps({"type": "response.create", "prompt_token_ids": prompt,
                                      "max_output_tokens": max_tokens, "temperature": temperature, "seed": seed}))
    while True:
        msg = await ws.receive()
        now = loop.time()
        if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            answer.closed = msg.type.name
            return answer
        ev = orjson.loads(msg.data)
        kind = ev.get("type")
        if kind == "response.created":
            answer.response_id = ev["response"]["id"]
        elif kind == "response.output_text.delta":
            ext = ev["pddgw"]
            ids = ext["token_ids"]
            if ext["position"] != len(answer.tokens) or not ids:
                answer.positions_ok = False
            if answer.first_t is None:
                answer.first_t = now
            else:
                answer.itl.append(now - answer.last_t)
            answer.itl.extend([0.0] * (len(ids) - 1))
            answer.last_t = now
            answer.tokens += ids
        elif kind in ("response.completed", "error"):
            answer.final, answer.end_t = ev, now
            return answer
