"""The front door's aiohttp app: `build_app(door)` is the one place its routes are registered.

What every route shares (API keys, steering, admission, the prompt and
sampling) is `FrontDoor` (door.py).  The routes: the Responses API over
WebSocket (responses_ws.py) and over HTTP, chat completions, completions and
models (openai_routes.py), tokenize / detokenize (tokenize.py), the web chat
page, /metrics, GET /health and /debug/state.

Middlewares, in order: the connection guard (guard.py: read timeouts, the
per-address cap; deploy/serve.py serves the app through its `GuardedSite`),
OpenAI-shaped 404 / 405 answers and the refusal log line (openai_errors.py),
and draining: while the router drains (SIGTERM: `door.drain`) a request that
would start a generation (a generating POST, a WebSocket upgrade) is refused
with 503 `unavailable`, and GET /health answers 503 `{"status": "draining"}`;
what was admitted runs to its end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from pddgw.api.door import FrontDoor
from pddgw.api.guard import GUARD, ConnectionGuard
from pddgw.api.openai_errors import error_response, openai_not_found
from pddgw.api.openai_routes import OpenAIRoutes
from pddgw.api.responses_ws import ResponsesSocket
from pddgw.api.tokenize import add_tokenize_routes
from pddgw.api.webchat import add_webchat_routes
from pddgw.metrics import metrics_route


def build_app(door: FrontDoor) -> web.Application:
    """The front door's aiohttp app: every route is registered here."""
    openai = OpenAIRoutes(door)
    guard = ConnectionGuard(door.cfg.server, door.metrics)
    app = web.Application(client_max_size=door.cfg.server.max_message_bytes,
                          middlewares=[guard.middleware, openai_not_found, _draining(door)],
                          handler_args=guard.handler_args())
    app[GUARD] = guard
    r = app.router
    # Responses API, WebSocket mode (GET upgrade) and HTTP (POST, optionally SSE).
    r.add_get("/v1/responses", ResponsesSocket(door).handle)
    r.add_post("/v1/responses", openai.responses)
    # OpenAI HTTP API (openai_routes.py).
    r.add_post("/v1/chat/completions", openai.chat_completions)
    r.add_post("/v1/completions", openai.completions)
    r.add_get("/v1/models", openai.models)
    r.add_get("/v1/models/{model}", openai.model)
    # Operations.
    r.add_get("/health", _health(door))
    r.add_get("/debug/state", door.debug_state)
    # ---- further routes (metrics, web page, ...) are registered below this line ----
    add_webchat_routes(app)
    add_tokenize_routes(app, door)                     # POST /tokenize, /detokenize (vLLM's; api/tokenize.py)
    metrics_route(app, door.router.metrics.scrape)     # GET /metrics (counts only: no key, like vLLM)
    return app


# Routes that start a request (generation): refused while the router drains.
_REQUEST_ROUTES = frozenset({("POST", "/v1/responses"), ("GET", "/v1/responses"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/completions")})


def _draining(door: FrontDoor) -> Callable[..., Any]:
    @web.middleware
    async def draining(request: web.Request, handler: Any) -> web.StreamResponse:
        if door.drain.draining and (request.method, request.path) in _REQUEST_ROUTES:
            return error_response(door.drain.MESSAGE, "unavailable")
        return await handler(request)

    return draining


def _health(door: FrontDoor) -> Callable[[web.Request], Any]:
    async def health(request: web.Request) -> web.StreamResponse:
        if door.drain.draining:
            return web.json_response({"status": "draining", "role": "router",
                                      "active_requests": door.admission.active}, status=503)
        return await door.health(request)

    return health
