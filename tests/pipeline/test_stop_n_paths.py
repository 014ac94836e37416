"""Stop strings and `n` on every path: the same tokens as one local engine.

A stop string is matched at the router's door, on the detokenized text (api/stops.py,
door.OutputText), never on a node; when it matches, the router stops the request on
every node at once.  So where the text is cut depends on the token ids alone, and the
ids depend only on the sampling, whichever nodes produced them: P-MD, P-RLD-MD
one-shot and catch-up, and a re-drive onto MD after RLD is lost must all answer one
local engine's text cut right before the stop, its ids up to the token the stop
completed at, finish_reason "stop" with the string as stop_reason, and leave nothing
held on any node.  Choice i of `n` is a router request of its own with seed
`choice_seed(seed, i)`: on every path, exactly one local engine's tokens for that seed.

Through the real app (the OpenAI HTTP routes) on the embedded deployment, the tiny
model in float64, seeded sampling, paths forced with the `pddgw` extension (steering
allowed), handoffs configured as tests/pipeline/test_penalty_paths.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from pddgw.api.openai_choices import choice_seed
from pddgw.config import ServerConfig
from pddgw.core.sampling import SamplingParams
from pddgw.harness.leaks import state_leftovers
from pddgw.net.errors import CloseCode
from tests.api.deployment import serve, unserve
from tests.api.test_stops_door import stop_point

from .test_embedded import prompt_of
from .test_logprobs_paths import local_off_loop
from .test_penalty_paths import handoff_cfg

PROMPT = prompt_of(120)
SEED = 11
PATHS = [("P-MD", None), ("P-RLD-MD", "one-shot"), ("P-RLD-MD", "catch-up")]


@pytest.fixture
async def steered(aiohttp_client):
    """-> start(pipeline, mode) -> (emb, side, AsyncOpenAI), steering allowed; afterwards every node is quiet."""
    started = []

    async def start(pipeline: str, mode: str | None):
        cfg = handoff_cfg(pipeline, mode)
        server = ServerConfig(max_streams_per_connection=4, allow_request_steering=True)
        emb, side, _, oai = await serve(aiohttp_client, started, replace(cfg, server=server), api_key="unused")
        return emb, side, oai

    yield start
    await unserve(started)


def steer(pipeline: str, mode: str | None) -> dict:
    ext = {"pipeline": pipeline} | ({"handoff_mode": mode} if mode else {})
    return {"ignore_eos": True, "return_token_ids": True, "pddgw": ext}


def pick_stop(text: str, at: int, length: int = 4) -> tuple[str, int]:
    """A stop string from `text` whose first occurrence starts at `at` or just after: (stop, where)."""
    for i in range(at, len(text) - length):
        s = text[i:i + length]
        if text.find(s) == i:
            return s, i
    raise AssertionError(f"no {length}-character piece of the text first occurs at or after {at}")


async def local_tokens(n: int, seed: int) -> list[int]:
    toks, _ = await local_off_loop(PROMPT, SamplingParams(max_tokens=n, temperature=0.9, seed=seed, ignore_eos=True))
    assert len(toks) == n
    return toks


async def check_stop(side, oai, toks: list[int], at: int, body: dict) -> dict:
    """A stop picked from the local text at `at` ends the answer there, exactly; -> its timeline."""
    tok = side.door.tok
    text = tok.decode(toks)
    stop, where = pick_stop(text, at)
    kept = stop_point(tok, toks, stop)
    # The stop spans a token boundary: the token it completes at does not hold it alone.
    assert stop not in tok.decode(toks[kept - 1:kept])
    r = await oai.completions.create(model=side.door.model_name, prompt=PROMPT, max_tokens=len(toks),
                                     temperature=0.9, seed=SEED, stop=[stop, "\x00never"], extra_body=body)
    # Nothing held on any node the moment the answer is in: the stop cancelled the request everywhere.
    assert state_leftovers(await side.state()) == {}
    ch = r.choices[0]
    assert (ch.text, ch.finish_reason, ch.stop_reason) == (text[:where], "stop", stop)
    assert ch.token_ids == r.pddgw["output_token_ids"] == toks[:kept] and r.usage.completion_tokens == kept
    assert r.pddgw["final_state"] == "FINISHED" and r.pddgw["finish_reason"] == "stop"
    assert kept <= r.pddgw["output_tokens"] < len(toks)         # stopped at the run holding the stop
    return r.pddgw


@pytest.mark.parametrize("pipeline,mode", PATHS)
async def test_a_stop_string_cuts_the_local_engines_text_on_every_path(steered, pipeline, mode):
    _, side, oai = await steered("P-MD", None)        # the path is the request's own (steered)
    n = 300 if pipeline == "P-RLD-MD" else 120
    toks = await local_tokens(n, SEED)
    tl = await check_stop(side, oai, toks, n - 40 if pipeline == "P-RLD-MD" else 60, steer(pipeline, mode))
    assert (tl["pipeline"], tl["handoff_mode"]) == (pipeline, mode)
    if pipeline == "P-RLD-MD":
        # MD was handed the request before the stop: the token the stop completed at is MD's.
        kept = len(tl["output_token_ids"])
        assert 0 < tl["handoff_position"] < kept and tl["tokens_by_role"]["md"] > 0


async def test_a_stop_string_after_a_redrive_cuts_the_local_engines_text(steered, monkeypatch):
    emb, side, oai = await steered("P-RLD-MD", "one-shot")
    n, kill_at = 120, 10
    toks = await local_tokens(n, SEED)
    real = side.router.run
    lost: list[asyncio.Task] = []        # the one closing task, referenced until the end

    async def lose() -> None:
        for link in list(emb.net.links):
            if "rld0" in (link.local, link.peer):
                await link.close(CloseCode.GOING_AWAY, "rld0 lost")

    async def run(rid, prompt, sampling, emit, *rest):
        got = [0]

        async def emit_then_lose(tr) -> None:
            got[0] += len(tr.ids)
            if not lost and got[0] >= kill_at:
                lost.append(asyncio.get_running_loop().create_task(lose()))
            await emit(tr)

        return await real(rid, prompt, sampling, emit_then_lose, *rest)

    monkeypatch.setattr(side.router, "run", run)
    tl = await check_stop(side, oai, toks, 80, steer("P-RLD-MD", "one-shot"))
    assert len(lost) == 1 and lost[0].done() and side.router.counts.as_dict()["redrives"] == 1
    # The re-drive point (RLD's tokens, given to MD) comes before the stop: MD's tokens hold it.
    (redrive,) = tl["redrives"]
    at = tl["tokens_by_role"]["prefill"] + tl["tokens_by_role"]["rld"]       # P's first, then RLD's
    assert redrive["position"] == at and kill_at <= at < len(tl["output_token_ids"]) and tl["tokens_by_role"]["md"] > 0


@pytest.mark.parametrize("pipeline,mode", PATHS)
async def test_n_choices_are_the_local_engines_tokens_of_their_seeds_on_every_path(steered, pipeline, mode):
    _, side, oai = await steered("P-MD", None)
    n = 300 if pipeline == "P-RLD-MD" else 40
    want = [await local_tokens(n, choice_seed(SEED, i)) for i in range(2)]
    assert want[0] != want[1]
    r = await oai.completions.create(model=side.door.model_name, prompt=PROMPT, max_tokens=n, temperature=0.9,
                                     seed=SEED, n=2, extra_body=steer(pipeline, mode))
    assert [c.index for c in r.choices] == [0, 1] and [c.finish_reason for c in r.choices] == ["length"] * 2
    assert [c.pddgw["seed"] for c in r.choices] == [SEED, SEED + 1]
    assert [c.token_ids for c in r.choices] == [c.pddgw["output_token_ids"] for c in r.choices] == want
    assert [c.text for c in r.choices] == [side.door.tok.decode(w) for w in want]
    for c in r.choices:
        tl = c.pddgw
        assert (tl["pipeline"], tl["handoff_mode"]) == (pipeline, mode)
        if pipeline == "P-RLD-MD":
            at = tl["handoff_position"]
            assert 0 < at < n and tl["tokens_by_role"] == {"prefill": 1, "rld": at - 1, "md": n - at}
