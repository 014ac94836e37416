"""`n` choices through the real app (the embedded deployment, the tiny float64 model).

Choice i samples with seed + i (openai_http.choice_seed), so a request for n
choices must equal n single requests with those seeds, token for token; the
stream carries each choice's chunks with its `index`, each choice finishes, and
usage counts the prompt once and every choice's tokens.  Choices after the first
start once the first has a token, so their prefill finds the prompt's full blocks
in P's and MD's prefix caches (`prefix_hit_tokens` on the router's state).
"""

from __future__ import annotations

import pytest

from tests.api.test_openai_client import served  # noqa: F401  (served is a fixture)

PROMPT = [40 + (i * 7) % 80 for i in range(100)]


def hits(state) -> dict[str, int]:
    return {n: s["prefix_hit_tokens"] for n, s in state["nodes"].items()}


async def test_n_choices_equal_single_requests_with_the_derived_seeds(served):  # noqa: F811
    side, _, oai = await served()
    name = side.door.model_name
    kw = dict(model=name, prompt=PROMPT, max_tokens=24, temperature=0.9, extra_body={"ignore_eos": True})
    singles = [await oai.completions.create(**kw, seed=7 + i) for i in range(3)]
    before = hits(await side.state())
    r = await oai.completions.create(**kw, seed=7, n=3)
    after = hits(await side.state())
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert [c.pddgw["output_token_ids"] for c in r.choices] == [s.pddgw["output_token_ids"] for s in singles]
    assert [c.pddgw["seed"] for c in r.choices] == [7, 8, 9]
    assert len({c.text for c in r.choices}) == 3                # sampled, distinct seeds: distinct texts
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 3 * 24
    assert r.usage.total_tokens == len(PROMPT) + 3 * 24
    # The singles already put the prompt in both caches: every choice finds its full blocks.
    bs = side.door.router.nodes["p0"].block_size
    full = len(PROMPT) // bs * bs
    assert after["p0"] - before["p0"] == 3 * full


async def test_choices_after_the_first_find_the_prompt_in_the_prefix_caches(served):  # noqa: F811
    side, _, oai = await served()
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
async def test_streamed_choices_carry_their_index_and_each_finishes(served, route):  # noqa: F811
    side, _, oai = await served()
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


async def test_greedy_choices_are_identical_and_a_stop_ends_each_on_its_own(served):  # noqa: F811
    side, _, oai = await served()
    name = side.door.model_name
    r = await oai.completions.create(model=name, prompt=PROMPT, max_tokens=20, temperature=0, n=2,
                                     extra_body={"ignore_eos": True})
    a, b = r.choices
    assert a.text == b.text and a.pddgw["output_token_ids"] == b.pddgw["output_token_ids"]
    assert len(a.pddgw["output_token_ids"]) == 20
    stop = a.text[8:10]
    r = await oai.completions.create(model=name, prompt=PROMPT, max_tokens=20, temperature=0, n=2, stop=stop,
                                     extra_body={"ignore_eos": True})
    assert [(c.text, c.finish_reason, c.stop_reason) for c in r.choices] == [(a.text[:a.text.find(stop)], "stop",
                                                                              stop)] * 2
