"""vLLM's tokenizer endpoints on the router's front door: POST /tokenize and POST /detokenize.

Shapes (vLLM's `TokenizeRequest` / `DetokenizeRequest` and their responses):

  POST /tokenize     {"model"?, "prompt": str, "add_special_tokens"?: bool = true}
                     or {"model"?, "messages": [...], "add_generation_prompt"?: bool = true,
                         "add_special_tokens"?: bool = false}
                  -> {"count": n, "max_model_len": m, "tokens": [ids], "token_strs": null}
  POST /detokenize   {"model"?, "tokens": [ids]}  -> {"prompt": text}

`prompt` is the text alone (`add_special_tokens`: with the bos the tokenizer puts in
front of plain text, if any); `messages` (chat messages as /v1/chat/completions takes
them) go through the served model's chat template, the ids the router would run
(`add_special_tokens: true` puts bos in front when the tokenizer adds one and the
template did not).  `max_model_len` is the context the front door allows
(`model.max_model_len` or the model's own).  `return_token_strs: true` and vLLM's
other chat fields (tools, chat_template, ...) answer 400 `unsupported_parameter`
naming the field; `detokenize` drops special tokens, like the streams' text.

Same rules as the other routes: an API key (401 `invalid_api_key`), a `model`
other than the served one (404 `model_not_found`), bad fields (400 naming the
field in `param`); the body is capped by `[server] max_message_bytes` before it
is read.  Inputs past a few KiB are tokenized in a worker thread, never on the
event loop (a Jinja chat template always is).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from pddgw.api.door import ClientTooSlow
from pddgw.api.errors import ApiError, brief, optional
from pddgw.api.openai_errors import error_response
from pddgw.api.openai_parse import check_keys, json_body, parse_messages
from pddgw.engines.types import RequestError

if TYPE_CHECKING:
    from pddgw.api.door import FrontDoor

_PROMPT_KEYS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_KEYS = {"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"}
_DETOKENIZE_KEYS = {"model", "tokens"}
# Characters of text, or ids, handled on the event loop itself; more go to a thread.
INLINE = 4096


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _flag(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ApiError(f"'{key}' must be a boolean", key)
    return v


class TokenizeRoutes:
    """The handlers; server.py's `build_app` registers them (`add_tokenize_routes`)."""

    def __init__(self, door: FrontDoor):
        self.door = door

    async def _read(self, request: web.Request) -> dict[str, Any] | web.Response:
        door = self.door
        if not door.authorized(request):
            return error_response("invalid or missing API key (Authorization: Bearer KEY)", "invalid_api_key")
        try:
            raw = await door.read_body(request)
        except ClientTooSlow:
            return web.Response(status=408)      # already written: the connection is closed
        d = json_body(raw)
        if not isinstance(d, dict):
            raise ApiError("the request body must be a JSON object")
        model = optional(d, "model", str)
        if model is not None and model != door.model_name:
            raise ApiError(f"the model {brief(model)} does not exist (this server serves "
                           f"{door.model_name!r})", "model", "model_not_found")
        return d

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            d = await self._read(request)
            if isinstance(d, web.Response):
                return d
            ids = await self._tokenize(d)
        except ApiError as e:
            return error_response(str(e), e.code, e.param)
        return web.json_response({"count": len(ids), "max_model_len": self.door.max_prompt, "tokens": ids,
                                  "token_strs": None}, dumps=_dumps)

    async def _tokenize(self, d: dict[str, Any]) -> list[int]:
        tok = self.door.tok
        if ("prompt" in d) == ("messages" in d):
            raise ApiError("give exactly one of 'prompt' (text) or 'messages' (a chat)",
                           "messages" if "messages" in d else "prompt")
        if d.get("return_token_strs") not in (None, False):
            raise ApiError("'return_token_strs' is not supported by this server", "return_token_strs",
                           "unsupported_parameter")
        if "prompt" in d:
            check_keys(d, _PROMPT_KEYS)
            text = d["prompt"]
            if not isinstance(text, str):
                raise ApiError("'prompt' must be a string", "prompt")
            special = _flag(d, "add_special_tokens", True)
            ids = await asyncio.to_thread(tok.encode, text) if len(text) > INLINE else tok.encode(text)
        else:
            check_keys(d, _CHAT_KEYS)
            msgs, _ = parse_messages(d["messages"])
            gen = _flag(d, "add_generation_prompt", True)
            special = _flag(d, "add_special_tokens", False)
            try:
                ids = await tok.apply_chat_template_async(msgs, add_generation_prompt=gen)
            except RequestError as e:        # the checkpoint's template refused the conversation
                raise ApiError(str(e), "messages") from None
        bos = tok.bos_token_id
        if special and tok.adds_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return list(ids)

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            d = await self._read(request)
            if isinstance(d, web.Response):
                return d
            check_keys(d, _DETOKENIZE_KEYS)
            ids = d.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ApiError("'tokens' must be a list of token IDs", "tokens")
            vocab = self.door.router.spec.vocab_size
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(f"tokens[{bad}] = {ids[bad]} is not a token ID of this model (0 .. {vocab - 1})",
                               "tokens")
        except ApiError as e:
            return error_response(str(e), e.code, e.param)
        tok = self.door.tok
        text = await asyncio.to_thread(tok.decode, ids) if len(ids) > INLINE else tok.decode(ids)
        return web.json_response({"prompt": text}, dumps=_dumps)


def add_tokenize_routes(app: web.Application, door: FrontDoor) -> None:
    """POST /tokenize and POST /detokenize (module docstring)."""
    routes = TokenizeRoutes(door)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
