"""Penalties, logit_bias and min_tokens on every path: the same tokens as one local engine.

They depend on the tokens so far, prompt and output told apart (presence and
frequency penalties and min_tokens count output tokens only), so every node
must see the same split: P samples position 0 from the prompt alone; MD gets
RLD's tokens by Extend (one-shot or catch-up rounds) and a re-drive's emitted
tokens by a final Extend, and counts them all as output.  The embedded
deployment on the tiny model in float64 (clear margins), with seeded
sampling, as tests/pipeline/test_logprobs_paths.py.
"""

from __future__ import annotations

import asyncio

import pytest

from pddgw.config import EngineConfig
from pddgw.core.sampling import SamplingParams
from pddgw.deploy.serve import Embedded
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest
from pddgw.harness.leaks import wait_quiescent
from pddgw.net.errors import CloseCode

from .test_embedded import deploy, make_cfg, prompt_of  # noqa: F401  (deploy is a fixture)
from .test_logprobs_paths import local_off_loop, run_on

PROMPT = prompt_of(120)


def params(n: int) -> SamplingParams:
    # min_tokens n - 1: EOS masked at every position but the last, so every path runs n tokens.
    return SamplingParams(max_tokens=n, temperature=0.8, seed=77, repetition_penalty=1.3, presence_penalty=0.4,
                          frequency_penalty=0.3, logit_bias={"40": 2.0, "47": -3.0, "61": 1.5}, min_tokens=n - 1)


def handoff_cfg(pipeline: str, mode: str | None):
    return make_cfg(pipeline=pipeline, handoff_mode=mode or "auto", catchup_threshold=2,
                    catchup_threshold_md_loaded=2, catchup_max_rounds=2)


def continued(prompt, given, sp: SamplingParams) -> list[int]:
    """One local engine, `given` passed as output tokens already generated (a handoff's state)."""
    from .test_logprobs_paths import _MODEL, local

    local(prompt[:1], SamplingParams(max_tokens=1))            # builds the shared model once
    model = _MODEL[0]
    eng = TorchEngine(model, model.spec, EngineConfig(num_blocks=512, max_num_batched_tokens=512), model.dtype)
    eng.add_request(EngineRequest("c", tuple(prompt), sp, output_token_ids=tuple(given)))
    out: list[int] = []
    while eng.has_work():
        for o in eng.step():
            out += o.ids
    return out


async def test_the_adjustments_change_the_tokens_and_given_outputs_count_as_output():
    n = 40
    toks, _ = await local_off_loop(PROMPT, params(n))
    plain, _ = await local_off_loop(PROMPT, SamplingParams(max_tokens=n, temperature=0.8, seed=77))
    assert len(toks) == len(plain) == n and toks != plain
    # Given its first 10 tokens as output (a handoff's state), the request goes on exactly as it did:
    # presence / frequency penalties and min_tokens count them as output.
    assert await asyncio.to_thread(continued, PROMPT, toks[:10], params(n)) == toks[10:]


@pytest.mark.parametrize("pipeline,mode", [("P-MD", None), ("P-RLD-MD", "one-shot"), ("P-RLD-MD", "catch-up"),
                                           ("P-RLD", None)])
async def test_every_path_gives_the_local_engines_tokens(deploy, pipeline, mode):  # noqa: F811
    _, side, _ = await deploy(handoff_cfg(pipeline, mode))
    n = 300 if pipeline == "P-RLD-MD" else 40
    toks, _ = await local_off_loop(PROMPT, params(n))
    assert len(toks) == n
    out, _ = await run_on(side, "pen-" + pipeline + (mode or ""), PROMPT, params(n), pipeline, mode)
    assert list(out.output_ids) == toks
    tl = out.record.to_dict()
    assert tl["pipeline"] == pipeline
    if pipeline == "P-RLD-MD":
        at = tl["handoff_position"]
        assert 0 < at < n and tl["tokens_by_role"] == {"prefill": 1, "rld": at - 1, "md": n - at}


async def redrive_after_losing_rld(name: str, sp: SamplingParams, kill_at: int = 10) -> list[int]:
    """`sp` on P-RLD-MD one-shot with RLD's links closed after `kill_at` tokens: the tokens the client
    got, checked to be the outcome's, re-driven once onto MD, and every node quiet afterwards."""
    emb = Embedded(handoff_cfg("P-RLD-MD", "one-shot"))
    side = await emb.start()
    got: list[int] = []
    lost: list[int] = []

    async def lose() -> None:
        for link in list(emb.net.links):
            if "rld0" in (link.local, link.peer):
                await link.close(CloseCode.GOING_AWAY, "rld0 lost")

    async def emit(run) -> None:
        got.extend(run.ids)
        if not lost and len(got) >= kill_at:
            lost.append(len(got))
            asyncio.get_running_loop().create_task(lose())

    try:
        out = await side.router.run(name, PROMPT, sp, emit, "P-RLD-MD", "one-shot")
        await side.router.drain()
        assert lost and side.router.counts.as_dict()["redrives"] == 1
        assert list(out.output_ids) == got
        assert dict(out.record.tokens_by_role)["md"] > 0
        await wait_quiescent(side.state)
    finally:
        await emb.stop()
    return got


async def test_a_redrive_after_rld_is_lost_gives_the_local_engines_tokens():
    n = 120
    toks, _ = await local_off_loop(PROMPT, params(n))
    assert await redrive_after_losing_rld("pen-redrive", params(n)) == toks
