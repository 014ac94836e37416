"""The front door's shared core: API keys, who may steer a request, the prompt and sampling.

`FrontDoor` is what every route of the router's front door shares, whatever
its protocol (the WebSocket Responses door in server.py, the OpenAI HTTP
routes in openai_http.py): API keys (`authorized`; an admin key is an API
key too), who may steer a request (`check_steering`: forcing a pipeline or
handoff mode needs an admin key or `[server] allow_request_steering`), the
prompt and sampling (`prepare`: output tokens clamped to the context,
`Prepared.clamped` says so), and whether an input is prepared off the event
loop (`heavy`).  server.py's `build_app` registers the routes.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pddgw.api import logprobs as lpfmt
from pddgw.api.responses import ApiError, SamplingFields
from pddgw.config import Config
from pddgw.engines.tokenizer import Tokenizer
from pddgw.engines.types import RequestError, SamplingParams
from pddgw.pipeline.router import Router

DEFAULT_MAX_OUTPUT_TOKENS = 256
_INLINE_INPUT = 1 << 16       # bytes / characters of input prepared on the loop itself

StateFn = Callable[[], Awaitable[dict[str, Any]]]


class Detokenizer:
    """Incremental detokenizer: each push decodes only a short window of recent tokens.

    The text of ids[prefix:read] was already emitted; decoding ids[prefix:]
    and cutting that off yields the new text, held back while it ends in a
    partial character.  (Decoding the whole output per token would cost
    quadratic time on the event loop.)
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, ids: tuple[int, ...]) -> str:
        self.ids += ids
        done = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or not text.startswith(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]


KEY_PROTOCOL = "pddgw.key."


def key_protocol(request: web.Request) -> str:
    """The offered `pddgw.key.*` WebSocket subprotocol ("" if none): echoed when accepted."""
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    return next((p.strip() for p in offered.split(",") if p.strip().startswith(KEY_PROTOCOL)), "")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for the router."""

    ids: tuple[int, ...]
    sampling: SamplingParams
    # The max output tokens asked for (or the default) did not fit in the context:
    # sampling.max_tokens is the room left, and an output that reaches it was cut there.
    clamped: bool


class FrontDoor:
    def __init__(self, cfg: Config, router: Router, tokenizer: Tokenizer, model_name: str, state: StateFn):
        self.cfg = cfg
        self.router = router
        self.tok = tokenizer
        self.model_name = model_name
        self._state = state
        self.active = 0
        self.max_prompt = router.spec.max_position_embeddings
        if cfg.model.max_model_len:
            self.max_prompt = min(self.max_prompt, cfg.model.max_model_len)
        self.pieces = lpfmt.TokenPieces(tokenizer)      # per-token strings of logprobs

    # ---- auth ------------------------------------------------------------------------
    @staticmethod
    def _bearer(request: web.Request) -> bytes:
        """The key of `Authorization: Bearer KEY`, or of a WebSocket subprotocol
        `pddgw.key.<base64url(KEY)>` (a browser cannot set headers on a WebSocket)."""
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[7:].encode()
        proto = key_protocol(request)
        if proto:
            b64 = proto[len(KEY_PROTOCOL):]
            with contextlib.suppress(ValueError):
                return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
        return b""

    @staticmethod
    def _matches(given: bytes, keys: tuple[str, ...]) -> bool:
        found = False
        for k in keys:      # no early exit: the time taken does not say which key matched
            found |= hmac.compare_digest(given, k.encode())
        return found

    def authorized(self, request: web.Request) -> bool:
        """An accepted API key, or none needed ([server] api_keys empty); an admin key is an API key too."""
        srv = self.cfg.server
        return not srv.api_keys or self._matches(self._bearer(request), srv.api_keys + srv.admin_keys)

    _authorized = authorized

    def may_steer(self, request: web.Request) -> bool:
        """Whether this client may force a request's pipeline / handoff mode (an operator's tool)."""
        srv = self.cfg.server
        return srv.allow_request_steering or (bool(srv.admin_keys)
                                              and self._matches(self._bearer(request), srv.admin_keys))

    def check_steering(self, request: web.Request, pipeline: str | None, handoff_mode: str | None) -> None:
        """ApiError (403 permission_denied) naming the forced field, unless this client may steer."""
        if (pipeline is None and handoff_mode is None) or self.may_steer(request):
            return
        name = "pddgw.pipeline" if pipeline is not None else "pddgw.handoff_mode"
        raise ApiError(f"forcing {name} needs an admin key ([server] admin_keys) or "
                       "[server] allow_request_steering = true", name, "permission_denied")

    # ---- requests --------------------------------------------------------------------
    def heavy(self, messages: tuple[tuple[str, str], ...], nbytes: int = 0) -> bool:
        """Whether preparing this input is worth a thread (a checkpoint's Jinja template, or a
        long input): the event loop must not tokenize or template it."""
        return self.tok.renders_jinja or nbytes > _INLINE_INPUT or sum(len(c) for _, c in messages) > _INLINE_INPUT

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.tok)

    def prepare(self, ids: tuple[int, ...] | None, messages: tuple[tuple[str, str], ...], max_tokens: int | None,
                sampling: SamplingFields, input_param: str = "input", logprobs: int | None = None) -> Prepared:
        """Prompt ids (given, or the chat template of `messages`) and sampling; ApiError names the field.

        `sampling`: the request's decoded fields (a seed of None is drawn here).  `logprobs`: None, or the
        number of top alternatives per token (SamplingParams.logprobs)."""
        if ids is not None:
            vocab = self.router.spec.vocab_size
            if any(t >= vocab for t in ids):
                raise ApiError(f"{input_param} must be < vocab size {vocab}", input_param)
        else:
            try:
                ids = tuple(self.tok.apply_chat_template(list(messages)))
            except RequestError as e:          # the checkpoint's template refused the conversation
                raise ApiError(str(e), input_param) from None
        room = self.max_prompt - len(ids)
        if room < 1:
            raise ApiError(f"prompt is {len(ids)} tokens; the context length is {self.max_prompt}",
                           input_param, "context_length_exceeded")
        want = max_tokens or DEFAULT_MAX_OUTPUT_TOKENS
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        try:
            params = SamplingParams(max_tokens=min(want, room), temperature=sampling.temperature,
                                    top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p, seed=seed,
                                    logprobs=logprobs)
        except RequestError as e:
            raise ApiError(str(e)) from None
        return Prepared(ids, params, want > room)

    # ---- plain HTTP ----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": "router", "active_requests": self.active})

    async def debug_state(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return web.json_response({"error": "invalid or missing API key"}, status=401)
        return web.json_response(await self._state())
