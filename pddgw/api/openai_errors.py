"""OpenAI-shaped error answers, and the one log line of every refused request.

`ERRORS` maps a pddgw error code to its HTTP status and OpenAI error type; an
unknown code is a 500 `server_error`.  Every error body is
`{"error": {"message", "type", "param", "code"}}`.

`openai_not_found` is the app's middleware that answers an unknown /v1/ route
or method with such a body (other paths keep aiohttp's), and logs every 4xx
answer once as `request_refused` with its route, field (`param`), reason and
status.  A 499 (the client went away, logged as `client_gone`) is not a refusal.
"""

from __future__ import annotations

from typing import Any

import orjson
import structlog
from aiohttp import web

from pddgw.api.errors import brief

log = structlog.get_logger(__name__)

# Error code -> (HTTP status, OpenAI error type).
ERRORS: dict[str, tuple[int, str]] = {
    "invalid_request_error": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "unsupported_parameter": (400, "invalid_request_error"),
    "invalid_api_key": (401, "invalid_request_error"),
    "permission_denied": (403, "permission_error"),
    "not_found": (404, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "rate_limit_exceeded": (429, "rate_limit_exceeded"),
    "overloaded": (429, "rate_limit_exceeded"),
    "unavailable": (503, "server_error"),
    "timeout": (504, "server_error"),
    "server_error": (500, "server_error"),
}


def error_body(message: str, code: str, param: str | None = None) -> dict[str, Any]:
    _, kind = ERRORS.get(code, ERRORS["server_error"])
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# An error answer's (param, message), kept on the response for the middleware's one log line.
REFUSAL = web.ResponseKey("pddgw_refusal", tuple)


def error_response(message: str, code: str, param: str | None = None) -> web.Response:
    status, _ = ERRORS.get(code, ERRORS["server_error"])
    resp = web.json_response(error_body(message, code, param), status=status, dumps=_dumps)
    resp[REFUSAL] = (param, message)
    return resp


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def unauthorized() -> web.Response:
    return error_response("invalid or missing API key (Authorization: Bearer KEY)", "invalid_api_key")


@web.middleware
async def openai_not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown /v1/ path or method answers with an OpenAI-shaped error, not aiohttp's text page;
    and every request refused with a 4xx, whatever its route, is logged here, once: `request_refused`
    with the route, the field (the error's `param`), the reason (its message) and the status."""
    try:
        resp = await _not_found(request, handler)
    except web.HTTPException as e:
        if 400 <= e.status < 500:
            _refused(request, e.status, None, e.reason)
        raise
    # 499: the client went away mid-answer (logged as client_gone), nothing was refused.
    if 400 <= resp.status < 500 and resp.status != 499:
        field_name, reason = resp.get(REFUSAL, (None, resp.reason))
        _refused(request, resp.status, field_name, reason)
    return resp


def _refused(request: web.Request, status: int, field_name: str | None, reason: str) -> None:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path[:200]
    log.info("request_refused", route=f"{request.method} {route}", field=field_name, reason=reason,
             status=status)


async def _not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        if not request.path.startswith("/v1/"):
            raise
        return error_response(f"unknown route {request.method} {brief(request.path)}", "not_found")
    except web.HTTPMethodNotAllowed as e:
        if not request.path.startswith("/v1/"):
            raise
        return error_response(f"{request.method} is not allowed on {brief(request.path)} (allowed: "
                              f"{', '.join(sorted(e.allowed_methods))})", "method_not_allowed")
