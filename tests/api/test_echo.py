"""Completions' `echo` with `logprobs` (OpenAI's shape), vLLM's `prompt_logprobs`, and echo with
max_tokens 0 - what lm-eval's `local-completions` log-likelihood requests send - through the
embedded deployment on every pipeline.

The tiny model in float64; the reference is a dense float64 forward of the prompt
(`forward_dense`), row p scoring prompt token p + 1, and one local engine for the output
tokens.  Prompt logprobs are computed where the prompt is computed (P, in float64), so they
agree with the reference to 1e-9; token strings are the tokenizer's decode of each id alone.
"""

from __future__ import annotations

import aiohttp
import pytest
import torch

from pddgw.engines.weights import build_tiny
from tests.api.deployment import ADMIN, KEY
from tests.pipeline.pdd_client import reference

PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests."
TOL = 1e-9
_MODEL = []


def dense(ids: list[int]) -> torch.Tensor:
    """float64 [len(ids) - 1, vocab]: row p = log p(. | ids[: p + 1])."""
    if not _MODEL:
        _MODEL.append(build_tiny(0, torch.float64, "cpu"))
    with torch.inference_mode():
        logits = _MODEL[0].forward_dense(torch.tensor(ids, dtype=torch.int64))
    return torch.log_softmax(logits.to(torch.float64), dim=-1)[:-1]


async def post(client, body: dict, key: str = KEY) -> tuple[int, dict]:
    r = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    return r.status, await r.json()


def check_prompt_part(tok, ids: list[int], lp: dict, k: int) -> None:
    """The echoed prompt's entries of a completions `logprobs` object."""
    ref = dense(ids)
    n = len(ids)
    assert lp["tokens"][:n] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = [0]
    for t in ids[:-1]:
        offsets.append(offsets[-1] + len(tok.decode([t])))
    assert lp["text_offset"][:n] == offsets
    for p in range(1, n):
        assert abs(lp["token_logprobs"][p] - float(ref[p - 1, ids[p]])) < TOL, p
        top = torch.topk(ref[p - 1], k)
        want = {tok.decode([i]): v for i, v in zip(top.indices.tolist(), top.values.tolist())}
        got = lp["top_logprobs"][p]
        # The k alternatives (distinct strings), plus the token itself when it is not one of them.
        extra = set(got) - set(want)
        assert extra <= {tok.decode([ids[p]])}
        assert all(abs(got[s] - v) < TOL for s, v in want.items() if s in got)
        assert len(set(want) - set(got)) == 0


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD", "P-RLD"])
async def test_echo_with_logprobs_scores_the_prompt_then_the_completion(deployment, pipeline):
    side, client, _ = await deployment()
    tok = side.door.tok
    ids = tok.encode(PROMPT)
    status, body = await post(client, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True,
                                       "logprobs": 2, "pddgw": {"pipeline": pipeline}}, ADMIN)
    assert status == 200, body
    choice = body["choices"][0]
    out = reference(ids, 3)
    assert choice["text"] == PROMPT + "".join(tok.decode([t]) for t in out)
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 3
    check_prompt_part(tok, ids, lp, 2)
    assert lp["tokens"][n:] == [tok.decode([t]) for t in out]
    # The completion's offsets continue the prompt's.
    assert lp["text_offset"][n] == lp["text_offset"][n - 1] + len(lp["tokens"][n - 1])
    assert body["usage"]["prompt_tokens"] == n and body["usage"]["completion_tokens"] == 3


async def test_lm_eval_loglikelihood_request_shape(deployment):
    """What lm-eval's local-completions sends for a log-likelihood: token IDs as a batch of one,
    echo, logprobs 1, max_tokens 1, temperature 0; it reads token_logprobs[ctxlen:-1]."""
    side, client, _ = await deployment()
    tok = side.door.tok
    ids = tok.encode(PROMPT)
    status, body = await post(client, {"model": side.door.model_name, "prompt": [ids], "max_tokens": 1,
                                       "temperature": 0, "logprobs": 1, "seed": 1234, "echo": True})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    check_prompt_part(tok, ids, lp, 1)
    ref = dense(ids)
    cont = sum(float(ref[p - 1, ids[p]]) for p in range(10, len(ids)))
    assert abs(sum(lp["token_logprobs"][10:-1]) - cont) < 1e-8


async def test_echo_with_max_tokens_0_returns_the_prompt_only(deployment):
    side, client, _ = await deployment()
    tok = side.door.tok
    ids = tok.encode(PROMPT)
    status, body = await post(client, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == PROMPT
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    check_prompt_part(tok, ids, choice["logprobs"], 0)
    assert body["usage"]["completion_tokens"] == 0
    # Without echo, max_tokens 0 is still refused, naming the field.
    status, body = await post(client, {"prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"


async def test_vllm_prompt_logprobs_field(deployment):
    side, client, _ = await deployment()
    tok = side.door.tok
    ids = tok.encode(PROMPT)
    status, body = await post(client, {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["logprobs"] is None and choice["text"] == "".join(tok.decode([t]) for t in reference(ids, 2))
    plp = choice["prompt_logprobs"]
    ref = dense(ids)
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        top = torch.topk(ref[p - 1], 3).indices.tolist()
        entry = plp[p]
        assert abs(entry[str(ids[p])]["logprob"] - float(ref[p - 1, ids[p]])) < TOL
        assert entry[str(ids[p])]["decoded_token"] == tok.decode([ids[p]])
        assert {int(i) for i in entry} == set(top) | {ids[p]}
        assert [entry[str(i)]["rank"] for i in top] == [1, 2, 3]


async def test_echo_without_logprobs_and_streamed_echo(deployment):
    side, client, _ = await deployment()
    tok = side.door.tok
    out = "".join(tok.decode([t]) for t in reference(tok.encode(PROMPT), 4))
    status, body = await post(client, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True})
    assert status == 200 and body["choices"][0]["text"] == PROMPT + out
    assert body["choices"][0]["logprobs"] is None
    r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                   "echo": True, "stream": True},
                          headers={"Authorization": f"Bearer {KEY}"})
    assert r.status == 200
    import orjson

    texts = []
    async for line in r.content:
        if line.startswith(b"data: {"):
            texts += [c["text"] for c in orjson.loads(line[6:])["choices"]]
    assert texts[0] == PROMPT and "".join(texts) == PROMPT + out


@pytest.mark.parametrize("body, param", [
    ({"echo": "yes"}, "echo"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": True, "max_tokens": 0, "stream": True}, "max_tokens"),
])
async def test_bad_echo_requests_name_the_field(deployment, body, param):
    _, client, _ = await deployment()
    status, got = await post(client, {"prompt": PROMPT, "max_tokens": 2, **body})
    assert status == 400, got
    assert got["error"]["param"] == param


async def test_echo_through_aiohttp_is_unaffected_by_a_warm_prefix_cache(deployment):
    """The same prompt twice: the second finds it in P's and MD's caches, yet its prompt logprobs
    are computed again (the cache is bypassed for the request that asks) and are the same."""
    side, client, _ = await deployment()
    body = {"prompt": PROMPT * 3, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    _, a = await post(client, body)
    _, b = await post(client, body)
    assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    _ = aiohttp
