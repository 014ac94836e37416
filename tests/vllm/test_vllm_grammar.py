"""Grammar-constrained decoding on the vLLM engine: pddgw's logits processor masks the logits with
the same matcher state as the torch engine (engines/vllm_sampling.py), so a JSON-schema request's
tokens are the torch engine's, alone, in a batch with unconstrained rows, and after a handoff."""

from __future__ import annotations

import json

import pytest

from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest, SamplingParams
from pddgw.engines.vllm_engine import VllmEngine
from pddgw.engines.weights import tiny_spec

from .conftest import config, torch_engine_config, vllm_engine_config
from .test_vllm_engine import PROMPTS, greedy, run

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}
GRAMMAR = ("json_schema", json.dumps(SCHEMA))
EOS = set(tiny_spec().eos_token_ids)


@pytest.fixture(scope="module")
def engines(checkpoint):
    veng, _ = VllmEngine.from_config(config(checkpoint, vllm_engine_config()))
    teng, _ = TorchEngine.from_config(config(checkpoint, torch_engine_config()))
    yield veng, teng
    veng.shutdown()


def valid(tokens: list[int]) -> dict:
    """The output ends with EOS (the grammar finished it) and is the schema's object before it."""
    assert tokens and tokens[-1] in EOS, tokens
    obj = json.loads(bytes(tokens[:-1]).decode())
    assert set(obj) == {"city", "unit"} and isinstance(obj["city"], str) and len(obj["city"]) <= 6
    assert obj["unit"] in ("c", "f")
    return obj


@pytest.mark.parametrize("sp", [SamplingParams(max_tokens=80, temperature=0.0, grammar=GRAMMAR),
                                SamplingParams(max_tokens=80, temperature=0.9, seed=7, grammar=GRAMMAR),
                                SamplingParams(max_tokens=80, temperature=0.9, seed=7, grammar=GRAMMAR,
                                               presence_penalty=0.5, repetition_penalty=1.1)],
                         ids=["greedy", "sampled", "sampled+penalties"])
def test_json_schema_output_is_valid_and_the_torch_engines(engines, sp):
    veng, teng = engines
    prompt = PROMPTS[0]
    ref = run(teng, EngineRequest("ref", prompt, sp))["ref"]
    valid(ref)
    free = run(teng, EngineRequest("free", prompt, SamplingParams(max_tokens=len(ref), temperature=sp.temperature,
                                                                  seed=sp.seed, ignore_eos=True)))["free"]
    assert free != ref                                    # the mask changed the tokens
    # Alone, and in a batch with an unconstrained greedy row and a sampled one.
    assert run(veng, EngineRequest("a", prompt, sp))["a"] == ref
    batch = run(veng, EngineRequest("g", prompt, sp), EngineRequest("x", PROMPTS[1], greedy()),
                EngineRequest("y", PROMPTS[2], SamplingParams(max_tokens=12, temperature=1.0, seed=3)))
    assert batch["g"] == ref and batch["x"] == run(teng, EngineRequest("x", PROMPTS[1], greedy()))["x"]
    # A handoff: the first tokens were generated elsewhere; vLLM's matcher is fed them first.
    k = len(ref) // 2
    assert run(veng, EngineRequest("h", prompt, sp, output_token_ids=tuple(ref[:k])))["h"] == ref
    for eng in (veng, teng):
        eng.check_integrity()
        assert eng.stats().used_blocks == 0
