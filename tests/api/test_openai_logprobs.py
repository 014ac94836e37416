"""Log-probabilities through the official `openai` client: chat, completions, responses.

The embedded deployment (P-MD) on the tiny model in float64, greedy, so the
tokens equal one local engine's; the token strings are the ByteTokenizer's
decode of each id alone, the values within 1e-5 of the local engine's (see
tests/pipeline/test_logprobs_paths.py for every path).
"""

from __future__ import annotations

import openai
import pytest

from pddgw.engines.types import SamplingParams
from tests.api.test_openai_client import chat_ids
from tests.pipeline.test_logprobs_paths import TOL, local_off_loop

MSGS = [("system", "Be brief."), ("user", "Name a colour.")]


def piece(tok, t: int) -> tuple[str, list[int]]:
    s = tok.decode([t])
    return s, list(s.encode())


def check_content(tok, content, toks, lps, k: int) -> None:
    """chat / responses `logprobs` entries against the local engine (greedy)."""
    assert len(content) == len(toks)
    for c, t, lp in zip(content, toks, lps):
        assert (c.token, c.bytes) == piece(tok, t)
        assert abs(c.logprob - lp.logprob) <= TOL
        assert [(x.token, x.bytes) for x in c.top_logprobs] == [piece(tok, i) for i in lp.top_ids]
        assert len(c.top_logprobs) == k
        assert all(abs(x.logprob - v) <= TOL for x, v in zip(c.top_logprobs, lp.top_logprobs))
        assert c.top_logprobs[0].logprob == c.logprob              # greedy: the sampled token is the top one


async def test_chat_completions_logprobs_and_top_logprobs(deployment):
    side, _, oai = await deployment()
    tok, name = side.door.tok, side.door.model_name
    ids = chat_ids(side, MSGS)
    toks, lps = await local_off_loop(ids, SamplingParams(max_tokens=10, logprobs=2))
    messages = [{"role": r, "content": c} for r, c in MSGS]
    r = await oai.chat.completions.create(model=name, max_tokens=10, temperature=0, messages=messages,
                                          logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == toks
    check_content(tok, r.choices[0].logprobs.content, toks, lps, 2)

    stream = await oai.chat.completions.create(model=name, max_tokens=10, temperature=0, messages=messages,
                                               logprobs=True, top_logprobs=2, stream=True,
                                               extra_body={"return_token_ids": True})
    chunks = [c async for c in stream]
    with_tokens = [c for c in chunks if c.choices and "position" in (getattr(c, "pddgw", None) or {})]
    assert all(len(c.choices[0].logprobs.content) == len(c.choices[0].token_ids) for c in with_tokens)
    check_content(tok, [x for c in with_tokens for x in c.choices[0].logprobs.content], toks, lps, 2)
    assert chunks[0].choices[0].logprobs is None and chunks[-1].choices[0].logprobs is None  # role, finish

    # logprobs alone: the sampled tokens' values, no alternatives; not asked for: null.
    r = await oai.chat.completions.create(model=name, max_tokens=10, temperature=0, messages=messages,
                                          logprobs=True)
    assert [len(c.top_logprobs) for c in r.choices[0].logprobs.content] == [0] * len(toks)
    assert all(abs(c.logprob - lp.logprob) <= TOL for c, lp in zip(r.choices[0].logprobs.content, lps))
    r = await oai.chat.completions.create(model=name, max_tokens=10, temperature=0, messages=messages)
    assert r.choices[0].logprobs is None


async def test_completions_logprobs(deployment):
    side, _, oai = await deployment()
    tok, name = side.door.tok, side.door.model_name
    ids = [40 + (i * 7) % 80 for i in range(50)]
    toks, lps = await local_off_loop(ids, SamplingParams(max_tokens=9, logprobs=2))
    strings = [tok.decode([t]) for t in toks]
    offsets = [sum(len(s) for s in strings[:i]) for i in range(len(strings))]

    def check(lp_obj_tokens, values, tops, text_offset):
        assert lp_obj_tokens == strings and text_offset == offsets
        assert all(abs(a - b.logprob) <= TOL for a, b in zip(values, lps, strict=True))
        for top, lp, s in zip(tops, lps, strings, strict=True):
            want = {}
            for i, v in zip(lp.top_ids, lp.top_logprobs):
                want.setdefault(tok.decode([i]), v)
            want.setdefault(s, lp.logprob)                       # the sampled token (greedy: already in)
            assert list(top) == list(want) and all(abs(top[key] - want[key]) <= TOL for key in want)

    r = await oai.completions.create(model=name, prompt=ids, max_tokens=9, temperature=0, logprobs=2,
                                     extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == toks
    lp = r.choices[0].logprobs
    check(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)

    stream = await oai.completions.create(model=name, prompt=ids, max_tokens=9, temperature=0, logprobs=2,
                                          stream=True)
    parts = [c.choices[0].logprobs for c in [c async for c in stream] if c.choices and c.choices[0].logprobs]
    check([t for p in parts for t in p.tokens], [v for p in parts for v in p.token_logprobs],
          [d for p in parts for d in p.top_logprobs], [o for p in parts for o in p.text_offset])


async def test_responses_include_output_text_logprobs(deployment):
    side, _, oai = await deployment()
    tok, name = side.door.tok, side.door.model_name
    ids = chat_ids(side, MSGS)
    toks, lps = await local_off_loop(ids, SamplingParams(max_tokens=8, logprobs=2))
    r = await oai.responses.create(model=name, instructions=MSGS[0][1], input=MSGS[1][1], max_output_tokens=8,
                                   temperature=0, include=["message.output_text.logprobs"], top_logprobs=2,
                                   extra_body={"return_token_ids": True})
    assert r.pddgw["output_token_ids"] == toks
    check_content(tok, r.output[0].content[0].logprobs, toks, lps, 2)
    events = [e async for e in await oai.responses.create(
        model=name, instructions=MSGS[0][1], input=MSGS[1][1], max_output_tokens=8, temperature=0,
        include=["message.output_text.logprobs"], top_logprobs=2, stream=True)]
    deltas = [e for e in events if e.type == "response.output_text.delta" and e.logprobs]
    check_content(tok, [x for d in deltas for x in d.logprobs], toks, lps, 2)
    done = next(e for e in events if e.type == "response.output_text.done")
    check_content(tok, done.logprobs, toks, lps, 2)
    check_content(tok, events[-1].response.output[0].content[0].logprobs, toks, lps, 2)


async def test_out_of_range_logprobs_are_400s_naming_the_parameter(deployment):
    side, _, oai = await deployment()
    name = side.door.model_name
    messages = [{"role": "user", "content": "x"}]
    cases = [
        (oai.chat.completions.create(model=name, messages=messages, logprobs=True, top_logprobs=21), "top_logprobs"),
        (oai.chat.completions.create(model=name, messages=messages, top_logprobs=2), "top_logprobs"),
        (oai.completions.create(model=name, prompt="x", logprobs=25), "logprobs"),
        (oai.responses.create(model=name, input="x", include=["message.output_text.logprobs"], top_logprobs=-1),
         "top_logprobs"),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            await call
        assert ei.value.status_code == 400
        assert ei.value.body["param"] == param and ei.value.body["type"] == "invalid_request_error", ei.value.body
