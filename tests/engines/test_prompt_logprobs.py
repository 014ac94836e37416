"""Prompt log-probabilities through the engine (`SamplingParams.prompt_logprobs`).

The tiny model in float64; the reference is an independent dense forward
(`LlamaModel.forward_dense`, no KV cache) of the whole prompt in float64 and
torch.log_softmax of each row: row p scores prompt token p + 1.  The engine
scores in the logits' dtype (float64 here), so the values agree to 1e-9 and
the ids exactly, whatever the chunking, batching, prefix cache or preemption.
"""

from __future__ import annotations

import pytest
import torch

from pddgw.config import CostModelConfig, EngineConfig
from pddgw.core.tokens import TokenLogprobs
from pddgw.engines.types import EngineRequest, RequestError, SamplingParams
from pddgw.sim import profiles
from pddgw.sim.costmodel_engine import CostModelEngine

from .conftest import make_engine

TOL = 1e-9
PROMPT = tuple((7 * i * i + 3 * i + 5) % 383 for i in range(45))    # 45 tokens: chunks of 16 cross blocks


def reference(model, prompt) -> torch.Tensor:
    """float64 [len(prompt) - 1, vocab]: row p = log p(. | prompt[: p + 1])."""
    with torch.inference_mode():
        logits = model.forward_dense(torch.tensor(prompt, dtype=torch.int64))
    return torch.log_softmax(logits.to(torch.float64), dim=-1)[:-1]


def check(model, prompt, got: tuple[TokenLogprobs, ...], k: int) -> None:
    ref = reference(model, prompt)
    assert len(got) == len(prompt) - 1
    for p, lp in enumerate(got):
        tok = prompt[p + 1]
        assert abs(lp.logprob - float(ref[p, tok])) < TOL, (p, lp.logprob, float(ref[p, tok]))
        top = torch.topk(ref[p], k)
        assert lp.top_ids == tuple(top.indices.tolist()), p
        assert all(abs(a - b) < TOL for a, b in zip(lp.top_logprobs, top.values.tolist(), strict=True))


def run(engine) -> dict[str, dict]:
    """Step to the end; per request: tokens, prompt logprobs (and how many outputs carried them)."""
    out: dict[str, dict] = {}
    while engine.has_work():
        for o in engine.step():
            r = out.setdefault(o.request_id, {"tokens": [], "prompt": (), "carriers": 0, "computed": 0})
            r["tokens"] += o.ids
            if o.prompt_logprobs:
                r["prompt"] = o.prompt_logprobs
                r["carriers"] += 1
                r["computed"] = o.num_computed_tokens
    return out


@pytest.mark.parametrize("budget", [64, 16, 5])
def test_prompt_logprobs_equal_a_float64_dense_forward_whatever_the_chunking(tiny64, budget):
    eng = make_engine(tiny64, max_num_batched_tokens=budget, max_num_seqs=4)
    eng.add_request(EngineRequest("a", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=4)))
    r = run(eng)["a"]
    check(tiny64, PROMPT, r["prompt"], 4)
    assert r["carriers"] == 1 and r["computed"] >= len(PROMPT)   # once, when the prompt is computed
    # The output tokens are those of the same request without prompt logprobs.
    eng.add_request(EngineRequest("b", PROMPT, SamplingParams(max_tokens=3)))
    plain = run(eng)["b"]
    assert plain["tokens"] == r["tokens"] and plain["prompt"] == ()
    eng.check_integrity()


def test_only_the_asking_request_of_a_batch_gets_them_each_with_its_own_k(tiny64):
    eng = make_engine(tiny64, max_num_batched_tokens=32, max_num_seqs=4)
    other = PROMPT[::-1][:30]
    eng.add_request(EngineRequest("k0", PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=0)))
    eng.add_request(EngineRequest("none", other, SamplingParams(max_tokens=4, logprobs=2)))
    eng.add_request(EngineRequest("k7", other, SamplingParams(max_tokens=4, prompt_logprobs=7)))
    out = run(eng)
    check(tiny64, PROMPT, out["k0"]["prompt"], 0)
    assert all(lp.top_ids == () for lp in out["k0"]["prompt"])
    check(tiny64, other, out["k7"]["prompt"], 7)
    assert out["none"]["prompt"] == ()
    eng.check_integrity()


def test_a_cached_prefix_is_recomputed_for_a_request_that_asks(tiny64):
    eng = make_engine(tiny64)
    eng.add_request(EngineRequest("warm", PROMPT, SamplingParams(max_tokens=1)))
    run(eng)
    hits = eng.stats().prefix_hit_tokens
    # The same prompt again: 32 tokens would come from the cache, but the scorer needs their logits.
    eng.add_request(EngineRequest("a", PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1)))
    check(tiny64, PROMPT, run(eng)["a"]["prompt"], 1)
    assert eng.stats().prefix_hit_tokens == hits
    eng.add_request(EngineRequest("c", PROMPT, SamplingParams(max_tokens=1)))
    run(eng)
    assert eng.stats().prefix_hit_tokens == hits + 32                  # others still hit
    eng.check_integrity()


def test_preempted_mid_prompt_the_recompute_reports_them_once(tiny64):
    # 6 blocks of 16: "a" (45 tokens, 3 blocks + growth) and "b" compete; "b" is preempted.
    eng = make_engine(tiny64, num_blocks=6, max_num_batched_tokens=16, max_num_seqs=4)
    eng.add_request(EngineRequest("a", PROMPT[:40], SamplingParams(max_tokens=20, ignore_eos=True)))
    eng.add_request(EngineRequest("b", PROMPT[5:45], SamplingParams(max_tokens=20, ignore_eos=True,
                                                                    prompt_logprobs=2)))
    out = run(eng)
    assert eng.stats().preemptions >= 1
    assert out["b"]["carriers"] == 1
    check(tiny64, PROMPT[5:45], out["b"]["prompt"], 2)
    eng.check_integrity()


def test_a_one_token_prompt_has_nothing_to_score(tiny64):
    eng = make_engine(tiny64)
    eng.add_request(EngineRequest("a", (42,), SamplingParams(max_tokens=2, prompt_logprobs=3)))
    r = run(eng)["a"]
    assert r["prompt"] == () and len(r["tokens"]) == 2
    assert eng._scoring == {}


def test_an_aborted_request_leaves_nothing_behind(tiny64):
    eng = make_engine(tiny64, max_num_batched_tokens=16, max_num_seqs=4)
    eng.add_request(EngineRequest("a", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=3)))
    eng.step()
    assert eng.abort("a")
    assert eng._scoring == {}
    eng.check_integrity()


def test_the_field_is_checked_and_an_engine_without_a_model_refuses_it():
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)
    cfg = EngineConfig(implementation="costmodel", block_size=16, num_blocks=64,
                       costmodel=CostModelConfig(hardware="H100-SXM", tensor_parallel=8))
    eng = CostModelEngine(profiles.model("llama3.1-70b"), profiles.hardware("H100-SXM"), cfg)
    with pytest.raises(RequestError, match="prompt_logprobs: this engine"):
        eng.add_request(EngineRequest("a", (1, 2, 3), SamplingParams(prompt_logprobs=1)))
