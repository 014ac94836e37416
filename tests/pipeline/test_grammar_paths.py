"""Grammar-constrained output on every path: the same tokens as one local engine.

The mask depends only on the output tokens so far, and every node rebuilds its
matcher from them (P samples position 0 from an empty output; RLD and MD are
handed the tokens before theirs; a re-drive's MD is given the emitted tokens),
so P-MD, P-RLD-MD one-shot and catch-up, P-RLD and a re-drive all give one
engine's tokens.  The embedded deployment on the tiny model in float64 with
seeded sampling, as tests/pipeline/test_penalty_paths.py.
"""

from __future__ import annotations

import asyncio

import pytest

from pddgw.config import EngineConfig
from pddgw.core.sampling import SamplingParams
from pddgw.engines.tokenizer import ByteTokenizer
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest

from .test_embedded import deploy, prompt_of  # noqa: F401  (deploy is a fixture)
from .test_logprobs_paths import _MODEL, local, run_on
from .test_penalty_paths import handoff_cfg, redrive_after_losing_rld

PROMPT = prompt_of(120)


def params(n: int) -> SamplingParams:
    # Exactly n letters inside a JSON object, then EOS: every path runs n + 10 tokens (EOS included),
    # ended by the grammar.
    return SamplingParams(max_tokens=n + 40, temperature=0.9, seed=5, grammar=("regex", f'\\{{"v": "[a-z]{{{n}}}"\\}}'))


def local_grammar(prompt, sp: SamplingParams) -> list[int]:
    """One local engine with the byte vocabulary: the yardstick."""
    local(prompt[:1], SamplingParams(max_tokens=1))            # builds the shared model once
    model = _MODEL[0]
    eng = TorchEngine(model, model.spec, EngineConfig(num_blocks=512, max_num_batched_tokens=512), model.dtype,
                      tokenizer=ByteTokenizer(model.spec.vocab_size))
    eng.add_request(EngineRequest("g", tuple(prompt), sp))
    out: list[int] = []
    while eng.has_work():
        for o in eng.step():
            out += o.ids
    return out


def check(toks: list[int], n: int) -> None:
    assert len(toks) == n + 10 and toks[-1] in (ByteTokenizer.EOS, ByteTokenizer.IM_END_ID)
    text = bytes(toks[:-1]).decode()
    assert text.startswith('{"v": "') and text.endswith('"}') and text[7:-2].isalpha() and text[7:-2].islower()


@pytest.mark.parametrize("pipeline,mode", [("P-MD", None), ("P-RLD-MD", "one-shot"), ("P-RLD-MD", "catch-up"),
                                           ("P-RLD", None)])
async def test_every_path_gives_the_local_engines_tokens(deploy, pipeline, mode):  # noqa: F811
    _, side, _ = await deploy(handoff_cfg(pipeline, mode))
    n = 290 if pipeline == "P-RLD-MD" else 30
    toks = await asyncio.to_thread(local_grammar, PROMPT, params(n))
    check(toks, n)
    out, _ = await run_on(side, "gram-" + pipeline + (mode or ""), PROMPT, params(n), pipeline, mode)
    assert list(out.output_ids) == toks and out.finish_reason == "stop"
    tl = out.record.to_dict()
    assert tl["pipeline"] == pipeline
    if pipeline == "P-RLD-MD":
        at = tl["handoff_position"]
        assert 0 < at < len(toks) and tl["tokens_by_role"] == {"prefill": 1, "rld": at - 1, "md": len(toks) - at}


async def test_a_redrive_after_rld_is_lost_gives_the_local_engines_tokens():
    n = 110
    toks = await asyncio.to_thread(local_grammar, PROMPT, params(n))
    check(toks, n)
    assert await redrive_after_losing_rld("gram-redrive", params(n)) == toks
