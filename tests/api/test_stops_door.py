"""Stop strings through the real app (the embedded deployment, the tiny float64 model).

Each test generates once without `stop` (a seeded, sampled output of printable
text), picks a piece of that output as the stop string, and asks again: the
answer must be exactly the output cut right before the stop's first occurrence
(or right after it with include_stop_str_in_output), streamed and not, with
finish_reason "stop", vLLM's stop_reason, and usage counting the tokens up to
the one the stop string completed at.  The stop cancels the request on every
node at once: when the answer is in, nothing is held anywhere any more, and the
router emitted no more than the run that completed the stop.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pddgw.config import PolicyConfig
from pddgw.harness.leaks import state_leftovers
from tests.api.deployment import make_cfg

PROMPT = [40 + (i * 7) % 80 for i in range(40)]
MAX = 120


def stop_point(tok, ids: list[int], stop: str) -> int:
    """Tokens kept: the fewest whose text holds the stop string (the token it completes at)."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


async def free_at_once(side) -> None:
    """Nothing held on any node or the router the moment the answer is in (the release is awaited)."""
    assert state_leftovers(await side.state()) == {}


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD"])
async def test_completions_stop_cuts_the_text_counts_the_tokens_and_frees_every_node(deployment, pipeline):
    cfg = make_cfg()
    side, _, oai = await deployment(replace(cfg, policy=PolicyConfig(pipeline=pipeline)))
    tok, name = side.door.tok, side.door.model_name
    kw = dict(model=name, prompt=PROMPT, max_tokens=MAX, temperature=0.9, seed=11)
    ask = {"ignore_eos": True, "return_token_ids": True}
    full = await oai.completions.create(**kw, extra_body=ask)
    text, ids = full.choices[0].text, full.choices[0].token_ids
    assert len(ids) == MAX and text == tok.decode(ids)
    stop = text[20:23]
    at = text.find(stop)
    kept = stop_point(tok, ids, stop)
    for include in (False, True):
        want = text[:at + len(stop)] if include else text[:at]
        r = await oai.completions.create(**kw, stop=[stop, "\x00never"],
                                         extra_body={**ask, "include_stop_str_in_output": include})
        await free_at_once(side)
        ch = r.choices[0]
        assert (ch.text, ch.finish_reason, ch.stop_reason) == (want, "stop", stop)
        assert r.usage.completion_tokens == kept and ch.token_ids == r.pddgw["output_token_ids"] == ids[:kept]
        assert r.pddgw["final_state"] == "FINISHED" and r.pddgw["finish_reason"] == "stop"
        assert kept <= r.pddgw["output_tokens"] < MAX         # stopped at the run holding the stop

        chunks = [c async for c in await oai.completions.create(
            **kw, stop=stop, stream=True, stream_options={"include_usage": True},
            extra_body={**ask, "include_stop_str_in_output": include})]
        await free_at_once(side)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        last = [c for c in chunks if c.choices][-1].choices[0]
        assert (last.finish_reason, last.stop_reason) == ("stop", stop)
        assert chunks[-1].usage.completion_tokens == kept
        streamed = [t for c in chunks if c.choices and "token_ids" in (c.pddgw or {}) for t in c.pddgw["token_ids"]]
        assert streamed == ids[:kept] == [t for c in chunks if c.choices for t in c.choices[0].token_ids]


async def test_chat_stop_streamed_holds_back_a_possible_stop_and_a_stop_at_the_first_characters(deployment):
    side, _, oai = await deployment()
    name = side.door.model_name
    msgs = [{"role": "user", "content": "Say something."}]
    kw = dict(model=name, messages=msgs, max_tokens=60, temperature=0.9, seed=5, extra_body={"ignore_eos": True})
    text = (await oai.chat.completions.create(**kw)).choices[0].message.content
    assert len(text) >= 30
    # A stop that spans tokens (3 characters, one byte token each) at the very start of the output.
    stop = text[:3]
    r = await oai.chat.completions.create(**kw, stop=stop)
    ch = r.choices[0]
    assert (ch.message.content, ch.finish_reason, ch.stop_reason, r.usage.completion_tokens) == ("", "stop", stop, 3)
    await free_at_once(side)
    # Streamed: a delta never shows the head of a stop string that is then cut.
    stop = text[15:19]
    want = text[:text.find(stop)]
    chunks = [c async for c in await oai.chat.completions.create(**kw, stop=[stop], stream=True)]
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == want
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == stop
    await free_at_once(side)


async def test_a_stop_token_id_is_the_stop_reason_and_no_stop_leaves_it_null(deployment):
    side, _, oai = await deployment()
    name = side.door.model_name
    kw = dict(model=name, prompt=PROMPT, max_tokens=40, temperature=0.9, seed=3)
    ask = {"ignore_eos": True, "return_token_ids": True}
    full = await oai.completions.create(**kw, extra_body=ask)
    ids = full.choices[0].token_ids
    assert (full.choices[0].finish_reason, full.choices[0].stop_reason) == ("length", None)
    t = ids[10]
    r = await oai.completions.create(**kw, extra_body={**ask, "stop_token_ids": [t]})
    k = ids.index(t) + 1
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", t)
    assert r.choices[0].token_ids == ids[:k] and r.usage.completion_tokens == k
