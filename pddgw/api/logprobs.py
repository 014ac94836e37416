"""Log-probabilities in the OpenAI shapes, from the engine's `TokenLogprobs`.

What the values are: the model's raw distribution at each output position
(log_softmax of the logits before temperature, top-k / top-p / min-p; vLLM's
default "raw_logprobs", as OpenAI reports them), computed on the engine's
device; -inf is reported as -9999.0.  They ride with the tokens from P, RLD
and MD through the router's ordered merge, every position once.

Token strings: the tokenizer's decode of the token alone (a special token the
tokenizer skips decodes to "", a piece of a multi-byte character to U+FFFD),
and `bytes` the UTF-8 bytes of that string.

Shapes:
  chat, responses   [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}, ...]
                    (top_logprobs: the k most probable, most probable first)
  completions       {tokens, token_logprobs, top_logprobs, text_offset}: top_logprobs one
                    {token string: logprob} per position, the k most probable plus the
                    sampled token (up to k + 1 entries, OpenAI's legacy rule; a string
                    two ids decode to keeps the more probable); text_offset the character
                    offset of each token string in the concatenation of the strings
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pddgw.core.tokens import TokenLogprobs
from pddgw.engines.tokenizer import Tokenizer

_CACHED_PIECES = 1 << 17


class TokenPieces:
    """Per-token strings and bytes, decoded once per id (a bounded cache shared by requests)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        got = self._cache.get(token_id)
        if got is None:
            text = self.tok.decode([token_id])
            got = (text, list(text.encode("utf-8")))
            if len(self._cache) < _CACHED_PIECES:
                self._cache[token_id] = got
        return got


def content(pieces: TokenPieces, token_ids: Sequence[int], lps: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """Chat completions' `logprobs.content` and the responses API's output_text `logprobs`."""
    out = []
    for t, lp in zip(token_ids, lps, strict=True):
        text, raw = pieces(t)
        top = []
        for i, v in zip(lp.top_ids, lp.top_logprobs):
            s, b = pieces(i)
            top.append({"token": s, "logprob": v, "bytes": b})
        out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion(pieces: TokenPieces, token_ids: Sequence[int], lps: Sequence[TokenLogprobs],
               offset: int = 0) -> tuple[dict[str, Any], int]:
    """Completions' `logprobs` object for these tokens, their strings starting at character
    `offset`; -> (the object, the offset after them)."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for t, lp in zip(token_ids, lps, strict=True):
        text = pieces(t)[0]
        tokens.append(text)
        values.append(lp.logprob)
        offsets.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for i, v in zip(lp.top_ids, lp.top_logprobs):
            top.setdefault(pieces(i)[0], v)
        top.setdefault(text, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def prompt_completion(pieces: TokenPieces, token_ids: Sequence[int],
                      lps: Sequence[TokenLogprobs]) -> tuple[dict[str, Any], int]:
    """Completions' `logprobs` object of an echoed prompt (OpenAI's `echo`): one entry per
    prompt token, the first with null token_logprobs / top_logprobs (it has no context);
    `lps` scores tokens 1..n-1.  -> (the object, the text offset after the prompt), so the
    completion's entries continue it (`completion(..., offset)`)."""
    first = pieces(token_ids[0])[0]
    rest, offset = completion(pieces, token_ids[1:], lps, len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}, offset


def vllm_prompt(pieces: TokenPieces, token_ids: Sequence[int],
                lps: Sequence[TokenLogprobs]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice: null for the first prompt token, then per token
    {token id (a string key): {logprob, rank, decoded_token}} of the token itself and its top
    alternatives; rank (1 = most probable) is known for the alternatives, and for the token
    when it is among them, else null."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t, lp in zip(token_ids[1:], lps, strict=True):
        entry: dict[str, dict[str, Any]] = {}
        rank = next((r + 1 for r, i in enumerate(lp.top_ids) if i == t), None)
        entry[str(t)] = {"logprob": lp.logprob, "rank": rank, "decoded_token": pieces(t)[0]}
        for r, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs)):
            entry.setdefault(str(i), {"logprob": v, "rank": r + 1, "decoded_token": pieces(i)[0]})
        out.append(entry)
    return out
