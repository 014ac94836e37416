"""The front door's shared core: API keys, who may steer a request, the prompt and sampling.

`FrontDoor` is what every route of the router's front door shares, whatever
its protocol (the WebSocket Responses door in server.py, the OpenAI HTTP
routes in openai_routes.py): API keys (`authorized`; an admin key is an API
key too; the `pddgw.key.*` WebSocket subprotocol carries one only on the
WebSocket upgrade route, `websocket=True`), the bound on requests in flight
(`admission`, an `Admission`: see there; `drain`, a `Drain`: SIGTERM), a request body read at a minimum
rate (`read_body`), who may steer a request (`check_steering`: forcing a pipeline or
handoff mode needs an admin key or `[server] allow_request_steering`), the
prompt and sampling (`prepare`: output tokens clamped to the context,
`Prepared.clamped` says so), whether an input is prepared off the event
loop (`heavy`), and an output's text (`output_text`: detokenized token by
token, the request's stop strings matched there, at the router, the one place
text exists).  server.py's `build_app` registers the routes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from pddgw.api import logprobs as lpfmt
from pddgw.api.errors import ApiError
from pddgw.api.guard import close_with
from pddgw.api.stops import StopMatcher
from pddgw.config import Config
from pddgw.core.sampling import SamplingParams
from pddgw.engines.tokenizer import Tokenizer
from pddgw.engines.types import RequestError
from pddgw.metrics import FrontDoorMetrics
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


class OutputText:
    """One output's text as its tokens arrive: detokenized token by token, stop strings matched.

    `push(ids)` -> (the text that may be sent now, how many of `ids` the output keeps):
    all of them, unless a stop string (api/stops.py) completed at one of them; the
    output then ends with that token (`stop` is the string, `ids` the tokens kept) and
    the request is to be stopped.  Tokens go one by one through the detokenizer, so the
    token a stop string ends at, and so the tokens counted, depend on the token ids
    alone, never on how the router's runs grouped them.  Stop strings are not looked
    for until more than `min_tokens` tokens exist (vLLM's rule).  `end()` once no more
    tokens come: the text still held back (a partial character, a possible stop
    string's start).  `text` is everything released so far.
    """

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = (), include: bool = False,
                 min_tokens: int = 0):
        self.tok = tokenizer
        self.detok = Detokenizer(tokenizer)
        self.matcher = StopMatcher(stops, include)
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.text = ""
        self._decoded = ""         # what the detokenizer gave so far (the matcher's input)

    @property
    def stop(self) -> str | None:
        return self.matcher.matched

    def push(self, ids: tuple[int, ...]) -> tuple[str, int]:
        out = []
        for k, t in enumerate(ids):
            if self.matcher.matched is not None:
                return self._release(out), k
            piece = self.detok.push((t,))
            self._decoded += piece
            self.ids.append(t)
            out.append(self.matcher.feed(piece, check=len(self.ids) > self.min_tokens))
        return self._release(out), len(ids)

    def end(self) -> str:
        if self.matcher.matched is not None:
            return ""
        full = self.tok.decode(self.ids)
        extra = full[len(self._decoded):] if full.startswith(self._decoded) else ""
        self._decoded += extra
        return self._release([self.matcher.feed(extra, check=len(self.ids) > self.min_tokens),
                              self.matcher.flush()])

    def _release(self, parts: list[str]) -> str:
        text = "".join(parts)
        self.text += text
        return text


class Slot:
    """One admitted request's place under the bound; `release()` gives it back, once (again: nothing)."""

    __slots__ = ("_owner",)

    def __init__(self, owner: Admission):
        self._owner: Admission | None = owner

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.active -= 1

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """The front door's bound on requests in flight (`[server] max_concurrent_requests`).

    `try_acquire()` checks the bound and takes a slot in one synchronous step, so
    handlers interleaving at their awaits cannot all pass the check before any of them
    counts itself (the HTTP and WebSocket routes call it before their first await on a
    request).  None: the bound is reached, the refusal is counted, the caller answers
    429 / an error event `rate_limit_exceeded`.  The `Slot` is released exactly once, by
    its owner's one `finally` / done-callback."""

    def __init__(self, limit: int, metrics: FrontDoorMetrics):
        self.limit = limit
        self.active = 0
        self._metrics = metrics
        metrics.watch(active=lambda: self.active)

    def try_acquire(self) -> Slot | None:
        if self.active >= self.limit:
            self._metrics.refuse("max_concurrent_requests")
            return None
        self.active += 1
        return Slot(self)


class Drain:
    """The front door's drain (SIGTERM on the router, deploy/serve.py): `start()` and the
    door admits nothing new (server.py answers 503 `unavailable` and /health says
    "draining"), while every request already admitted runs to its end; `wait_idle`
    waits for that, within a bound.  Beside `Admission`, not in it: the bound on
    requests in flight and the drain are separate refusals (429 / 503)."""

    MESSAGE = ("server draining: this router is shutting down (a restart); no new requests, "
               "those in flight finish - retry shortly or on another router")

    def __init__(self, admission: Admission):
        self._admission = admission
        self.since: float | None = None       # loop time of `start`

    @property
    def draining(self) -> bool:
        return self.since is not None

    def start(self) -> int:
        """-> requests in flight now (they finish; nothing new is admitted from here on)."""
        if self.since is None:
            self.since = asyncio.get_running_loop().time()
        return self._admission.active

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Until no admitted request is left, at most `timeout_s`; -> those still in flight."""
        # Polled: a Slot is released from many places (finally blocks, done-callbacks).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._admission.active and loop.time() < deadline:
            await asyncio.sleep(min(poll_s, max(0.0, deadline - loop.time())))
        return self._admission.active


class ClientTooSlow(Exception):
    """A request body came slower than `[server] body_min_bytes_per_s`: its connection is closed."""


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
        self.metrics = router.metrics.front_door
        self.admission = Admission(cfg.server.max_concurrent_requests, self.metrics)
        self.drain = Drain(self.admission)
        self.max_prompt = router.spec.max_position_embeddings
        if cfg.model.max_model_len:
            self.max_prompt = min(self.max_prompt, cfg.model.max_model_len)
        self.pieces = lpfmt.TokenPieces(tokenizer)      # per-token strings of logprobs

    @property
    def active(self) -> int:
        """Requests admitted and not yet ended (the admission's count)."""
        return self.admission.active

    # ---- auth ------------------------------------------------------------------------
    @staticmethod
    def _bearer(request: web.Request, websocket: bool) -> bytes:
        """The key of `Authorization: Bearer KEY`, or, on the WebSocket upgrade route only
        (`websocket`), of a subprotocol `pddgw.key.<base64url(KEY)>` (a browser cannot set
        headers on a WebSocket).  A plain HTTP route never reads the subprotocol header: a
        page could otherwise have a browser send it where no WebSocket handshake happens."""
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[7:].encode()
        proto = key_protocol(request) if websocket else ""
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

    def authorized(self, request: web.Request, websocket: bool = False) -> bool:
        """An accepted API key, or none needed ([server] api_keys empty); an admin key is an API key too.
        `websocket`: the WebSocket upgrade route, where the key subprotocol counts too."""
        srv = self.cfg.server
        return not srv.api_keys or self._matches(self._bearer(request, websocket), srv.api_keys + srv.admin_keys)

    def may_steer(self, request: web.Request, websocket: bool = False) -> bool:
        """Whether this client may force a request's pipeline / handoff mode (an operator's tool)."""
        srv = self.cfg.server
        return srv.allow_request_steering or (bool(srv.admin_keys)
                                              and self._matches(self._bearer(request, websocket), srv.admin_keys))

    def check_steering(self, request: web.Request, pipeline: str | None, handoff_mode: str | None) -> None:
        """ApiError (403 permission_denied) naming the forced field, unless this client may steer."""
        if (pipeline is None and handoff_mode is None) or self.may_steer(request):
            return
        name = "pddgw.pipeline" if pipeline is not None else "pddgw.handoff_mode"
        raise ApiError(f"forcing {name} needs an admin key ([server] admin_keys) or "
                       "[server] allow_request_steering = true", name, "permission_denied")

    # ---- requests --------------------------------------------------------------------
    async def read_body(self, request: web.Request) -> bytes:
        """The request's body, at most `[server] max_message_bytes` (else ApiError 413
        `request_too_large`, from Content-Length before anything is read when it says so).

        The body must keep up with a minimum rate after a grace period: by t seconds
        after this call, (t - body_read_grace_s) * body_min_bytes_per_s bytes.  With n
        bytes in, the next must come by grace + n / rate; one that does not closes the
        connection (a 408 written first) and raises ClientTooSlow.  A large honest
        upload only ever has to beat the rate, never a fixed deadline."""
        srv = self.cfg.server
        limit = srv.max_message_bytes
        too_large = ApiError(f"request body over {limit} bytes ([server] max_message_bytes)", None,
                             "request_too_large")
        if (request.content_length or 0) > limit:
            self.metrics.refuse("max_message_bytes")
            raise too_large
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        body = bytearray()
        while True:
            try:
                async with asyncio.timeout_at(t0 + srv.body_read_grace_s + len(body) / srv.body_min_bytes_per_s):
                    chunk = await request.content.readany()
            except TimeoutError:
                self.metrics.close("body_min_rate")
                close_with(request.transport, 408, "request body slower than [server] body_min_bytes_per_s")
                raise ClientTooSlow() from None
            if not chunk:
                return bytes(body)
            if len(body) + len(chunk) > limit:
                self.metrics.refuse("max_message_bytes")
                raise too_large
            body += chunk

    def heavy(self, messages: tuple[tuple[str, str], ...], nbytes: int = 0) -> bool:
        """Whether preparing this input is worth a thread (a checkpoint's Jinja template, or a
        long input): the event loop must not tokenize or template it."""
        return self.tok.renders_jinja or nbytes > _INLINE_INPUT or sum(len(c) for _, c in messages) > _INLINE_INPUT

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.tok)

    def output_text(self, sampling: SamplingParams, stops: tuple[str, ...] = ()) -> OutputText:
        """One output's text with the request's stop strings (and its include_stop_str_in_output, min_tokens)."""
        return OutputText(self.tok, stops, sampling.include_stop_str_in_output, sampling.min_tokens)

    def prepare(self, ids: tuple[int, ...] | None, messages: tuple[tuple[str, str], ...], max_tokens: int | None,
                sampling: SamplingParams, input_param: str = "input", logprobs: int | None = None) -> Prepared:
        """Prompt ids (given, or the chat template of `messages`) and sampling; ApiError names the field.

        `sampling`: the request's decoded fields; its max_tokens is set here (the room left in the
        context), logit_bias checked against the vocabulary.  `logprobs`: None, or the number of top
        alternatives per token (SamplingParams.logprobs)."""
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
        try:
            sampling.check_vocab(self.router.spec.vocab_size)
            params = replace(sampling, max_tokens=min(want, room), logprobs=logprobs)
        except RequestError as e:
            raise ApiError(str(e), getattr(e, "field", None)) from None
        return Prepared(ids, params, want > room)

    # ---- plain HTTP ----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": "router", "active_requests": self.admission.active})

    async def debug_state(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return web.json_response({"error": "invalid or missing API key"}, status=401)
        return web.json_response(await self._state())
