"""The web chat page: `/` and its static files, served by the router's front door.

The page (pddgw/api/static/: index.html, app.js, style.css; plain files, no
build step, nothing fetched from elsewhere) speaks the WebSocket Responses
mode at `/v1/responses` on the host that served it, like any client: one
socket per page; each turn a `response.create` with the whole conversation
(asking for `return_token_ids` and `pddgw.states`); each delta a span coloured
by the role that produced it; `response.completed` shows the `pddgw` timeline.
A browser cannot set Authorization on a WebSocket: the page sends its key as
the `pddgw.key.*` subprotocol (door.key_protocol).

The files are read once from the package (pyproject's package-data) and served
from memory with a strict Content-Security-Policy; only these names are
served, so no request path reaches the file system.
"""

from __future__ import annotations

from importlib import resources
from typing import NamedTuple

from aiohttp import web

# name -> content type; the only files served.
_FILES = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "style.css": "text/css",
}

# Everything the page loads is its own; its socket goes back to the host that served it.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class _Asset(NamedTuple):
    body: bytes
    content_type: str


def _load() -> dict[str, _Asset]:
    root = resources.files("pddgw.api").joinpath("static")
    return {name: _Asset(root.joinpath(name).read_bytes(), ctype) for name, ctype in _FILES.items()}


def add_webchat_routes(app: web.Application) -> None:
    """Serve the chat page at `/` and its files at `/static/{name}` on `app`."""
    assets = _load()
    headers = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

    def respond(asset: _Asset) -> web.Response:
        return web.Response(body=asset.body, content_type=asset.content_type, charset="utf-8",
                            headers=headers)

    async def index(request: web.Request) -> web.Response:
        return respond(assets["index.html"])

    async def static(request: web.Request) -> web.Response:
        asset = assets.get(request.match_info["name"])
        if asset is None or request.match_info["name"] == "index.html":
            raise web.HTTPNotFound()
        return respond(asset)

    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static)
