"""`n` choices through the real app (the embedded deployment, the tiny float64 model).

Choice i samples with seed + i (openai_choices.choice_seed), so a request for n
choices must equal n single requests with those seeds, token for token; the
stream carries each choice's chunks with its `index`, each choice finishes, and
usage counts the prompt once and every choice's tokens.  Choices after the first
start once the first has a token, so their prefill finds the prompt's full blocks
in P's and MD's prefix caches (`prefix_hit_tokens` on the router's state).

`best_of` > n generates best_of such choices and returns the n with the highest
summed sampled-token logprob, most likely first, re-indexed; usage counts all.
"""

from __future__ import annotations

import math

import openai
import pytest

from tests.api.deployment import KEY

PROMPT = [40 + (i * 7) % 80 for i in range(100)]


def hits(state) -> dict[str, int]:
    return {n: s["prefix_hit_tokens"] for n, s in state["nodes"].items()}


async def test_n_choices_equal_single_requests_with_the_derived_seeds(deployment):
    side, _, oai = await deployment()
    name = side.door.model_name
    kw = dict(model=name, prompt=PROMPT, max_tokens=24, temperature=0.9,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    singles = [await oai.completions.create(**kw, seed=7 + i) for i in range(3)]
    before = hits(await side.state())
    r = await oai.completions.create(**kw, seed=7, n=3)
    after = hits(await side.state())
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert [c.token_ids for c in r.choices] == [s.choices[0].token_ids for s in singles]
    assert [c.pddgw["output_token_ids"] for c in r.choices] == [c.token_ids for c in r.choices]
    assert [c.prompt_token_ids for c in r.choices] == [PROMPT] * 3
    assert [c.pddgw["seed"] for c in r.choices] == [7, 8, 9]
    assert len({c.text for c in r.choices}) == 3                # sampled, distinct seeds: distinct texts
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 3 * 24
    assert r.usage.total_tokens == len(PROMPT) + 3 * 24
    # The singles already put the prompt in both caches: every choice finds its full blocks.
    bs = side.door.router.nodes["p0"].block_size
    full = len(PROMPT) // bs * bs
    assert after["p0"] - before["p0"] == 3 * full


async def test_choices_after_the_first_find_the_prompt_in_the_prefix_caches(deployment):
    side, _, oai = await deployment()
    name = side.door.model_name
    before = hits(await side.state())
    r = await oai.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=1, n=4,
                                     extra_body={"ignore_eos": True})
    after = hits(await side.state())
    assert len(r.choices) == 4
    nodes = side.door.router.nodes
    p_full = len(PROMPT) // nodes["p0"].block_size * nodes["p0"].block_size
    md_full = len(PROMPT) // nodes["md0"].block_size * nodes["md0"].block_size
    # Choice 0 misses both caches; choices 1..3 hit P's on every full block, and MD's.
    assert after["p0"] - before["p0"] == 3 * p_full
    assert after["md0"] - before["md0"] == 3 * md_full


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_streamed_choices_carry_their_index_and_each_finishes(deployment, route):
    side, _, oai = await deployment()
    name = side.door.model_name
    if route == "chat":
        kw = dict(model=name, messages=[{"role": "user", "content": "Hi."}], max_tokens=16, temperature=0.9,
                  seed=21, n=2, extra_body={"ignore_eos": True})
        create = oai.chat.completions.create

        def text_of(c):
            return c.delta.content or ""
    else:
        kw = dict(model=name, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=21, n=2,
                  extra_body={"ignore_eos": True})
        create = oai.completions.create

        def text_of(c):
            return c.text
    whole = await create(**kw)
    chunks = [c async for c in await create(**kw, stream=True, stream_options={"include_usage": True})]
    per = {0: [], 1: []}
    finishes = {}
    for ch in chunks:
        for c in ch.choices:
            per[c.index].append(text_of(c))
            if c.finish_reason is not None:
                assert c.index not in finishes
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "length", 1: "length"}
    want = [c.message.content if route == "chat" else c.text for c in whole.choices]
    assert ["".join(per[0]), "".join(per[1])] == want
    if route == "chat":      # each choice opens with its role chunk
        roles = [c.index for ch in chunks for c in ch.choices if c.delta.role == "assistant"]
        assert sorted(roles) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert sum(1 for ch in chunks if ch.usage is not None) == 1


async def test_greedy_choices_are_identical_and_a_stop_ends_each_on_its_own(deployment):
    side, _, oai = await deployment()
    name = side.door.model_name
    r = await oai.completions.create(model=name, prompt=PROMPT, max_tokens=20, temperature=0, n=2,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    a, b = r.choices
    assert a.text == b.text and a.token_ids == b.token_ids
    assert len(a.token_ids) == 20
    stop = a.text[8:10]
    r = await oai.completions.create(model=name, prompt=PROMPT, max_tokens=20, temperature=0, n=2, stop=stop,
                                     extra_body={"ignore_eos": True})
    assert [(c.text, c.finish_reason, c.stop_reason) for c in r.choices] == [(a.text[:a.text.find(stop)], "stop",
                                                                              stop)] * 2


async def test_best_of_returns_the_n_most_likely_of_best_of_single_requests(deployment):
    side, _, oai = await deployment()
    name = side.door.model_name
    kw = dict(model=name, prompt=PROMPT, max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True})
    singles = [await oai.completions.create(**kw, seed=i, logprobs=0) for i in range(3)]
    sums = [math.fsum(s.choices[0].logprobs.token_logprobs) for s in singles]
    # The ranking is strict: no two sums so close that float noise could swap them.
    assert min(abs(a - b) for i, a in enumerate(sums) for b in sums[i + 1:]) > 1e-6
    order = sorted(range(3), key=lambda i: -sums[i])[:2]
    assert order != sorted(order)          # these seeds: the most likely is not the first generated
    r = await oai.completions.create(**kw, seed=0, n=2, best_of=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [singles[i].choices[0].text for i in order]
    assert [c.pddgw["seed"] for c in r.choices] == order
    assert [c.logprobs for c in r.choices] == [None, None]          # ranked on them, not asked for
    assert r.usage.completion_tokens == 3 * 24 and r.usage.total_tokens == len(PROMPT) + 3 * 24
    # Asked for: they come back, the chosen choices' own.
    r = await oai.completions.create(**kw, seed=0, n=2, best_of=3, logprobs=0)
    assert [c.logprobs.token_logprobs for c in r.choices] == [singles[i].choices[0].logprobs.token_logprobs
                                                              for i in order]


async def test_chat_best_of_with_one_choice_returns_the_most_likely(deployment):
    side, _, oai = await deployment()
    name = side.door.model_name
    kw = dict(model=name, messages=[{"role": "user", "content": "Hi."}], max_tokens=12, temperature=1.0,
              logprobs=True, extra_body={"ignore_eos": True})
    singles = [await oai.chat.completions.create(**kw, seed=4 + i) for i in range(4)]
    sums = [math.fsum(t.logprob for t in s.choices[0].logprobs.content) for s in singles]
    best = max(range(4), key=lambda i: (sums[i], -i))
    assert best > 0                        # these seeds: not the first generated
    r = await oai.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "best_of": 4}}, seed=4)
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].message.content == singles[best].choices[0].message.content
    assert r.choices[0].pddgw["seed"] == 4 + best
    want = singles[best].choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in r.choices[0].logprobs.content] == [(t.token, t.logprob) for t in want]
    assert r.usage.completion_tokens == 4 * 12


async def test_greedy_best_of_returns_the_first_n(deployment):
    side, _, oai = await deployment()
    name = side.door.model_name
    r = await oai.completions.create(model=name, prompt=PROMPT, max_tokens=20, temperature=0, seed=5, n=2,
                                     best_of=4, extra_body={"ignore_eos": True, "return_token_ids": True})
    a, b = r.choices
    assert (a.index, b.index) == (0, 1) and [a.pddgw["seed"], b.pddgw["seed"]] == [5, 6]
    assert a.text == b.text and a.token_ids == b.token_ids and len(a.token_ids) == 20
    assert r.usage.completion_tokens == 4 * 20


@pytest.mark.parametrize("route,body,message", [
    ("completions", {"prompt": "x", "n": 2, "best_of": 3, "stream": True},
     "'best_of' greater than n (2) is not supported with 'stream': true"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "best_of": 2, "stream": True},
     "'best_of' greater than n (1) is not supported with 'stream': true"),
    ("completions", {"prompt": "x", "n": 2, "best_of": 17}, "'best_of' must be an integer in [n (2), 16], got 17"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3, "best_of": 2},
     "'best_of' must be an integer in [n (3), 16], got 2"),
])
async def test_best_of_refusals_name_it_and_the_node_keeps_serving(deployment, route, body, message):
    side, client, oai = await deployment()
    async with client.post(f"/v1/{route}", json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
    assert (err["param"], err["message"]) == ("best_of", message)
    with pytest.raises(openai.BadRequestError) as ei:
        await oai.completions.create(model=side.door.model_name, prompt="x", n=2, best_of=3, stream=True)
    assert ei.value.body["param"] == "best_of"
    r = await oai.completions.create(model=side.door.model_name, prompt="x", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
