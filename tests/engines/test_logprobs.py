"""Log-probabilities through the engine (`SamplingParams.logprobs`).

The tiny model in float64; the reference is an independent dense forward
(`LlamaModel.forward_dense`, no KV cache) and torch.log_softmax of its last
row.  The engine reports float32 values (`sampler.logprobs` computes in
float32), so values are compared within 1e-5 and ids exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from pddgw.config import CostModelConfig, EngineConfig
from pddgw.sim.costmodel_engine import CostModelEngine
from pddgw.engines.naive import naive_greedy
from pddgw.core.tokens import TokenLogprobs
from pddgw.engines.types import MAX_LOGPROBS, EngineRequest, RequestError, SamplingParams
from pddgw.sim import profiles

from .conftest import make_engine

TOL = 1e-5
PROMPT = (5, 77, 12, 300, 41, 9, 66, 120, 3, 250, 17, 88, 200, 33, 7, 64, 90)


def steps(engine) -> dict[str, tuple[list[int], list[TokenLogprobs]]]:
    """Run to the end: per request its tokens and logprobs (checking they come together)."""
    out: dict[str, tuple[list[int], list[TokenLogprobs]]] = {}
    while engine.has_work():
        for o in engine.step():
            toks, lps = out.setdefault(o.request_id, ([], []))
            assert len(o.logprobs) in (0, len(o.ids)), o
            toks += o.ids
            lps += o.logprobs
    return out


def dense_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the last row of a full dense recompute: float64 [vocab]."""
    with torch.inference_mode():
        logits = model.forward_dense(torch.tensor(ids, dtype=torch.int64))[-1]
    return torch.log_softmax(logits.to(torch.float64), dim=-1)


def check_against_dense(model, prompt, tokens: list[int], lps: list[TokenLogprobs], k: int) -> None:
    assert len(lps) == len(tokens)
    seq = list(prompt)
    for tok, lp in zip(tokens, lps):
        ref = dense_logprobs(model, seq)
        assert abs(lp.logprob - float(ref[tok])) < TOL, (lp.logprob, float(ref[tok]))
        top = torch.topk(ref, k)
        assert lp.top_ids == tuple(top.indices.tolist())                     # ids exact, most probable first
        assert all(abs(a - b) < TOL for a, b in zip(lp.top_logprobs, top.values.tolist()))
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        seq.append(tok)


def test_greedy_logprob_is_the_log_softmax_max_and_top_alternatives_are_exact(tiny64):
    eng = make_engine(tiny64)
    eng.add_request(EngineRequest("a", PROMPT, SamplingParams(max_tokens=6, logprobs=3)))
    toks, lps = steps(eng)["a"]
    assert toks == naive_greedy(tiny64, list(PROMPT), 6)
    check_against_dense(tiny64, PROMPT, toks, lps, 3)
    for t, lp in zip(toks, lps):
        # Greedy: the sampled token is the most probable one, its logprob the max.
        assert lp.top_ids[0] == t and lp.top_logprobs[0] == lp.logprob
        assert len(lp.top_ids) == len(lp.top_logprobs) == 3
    eng.check_integrity()


def test_sampled_tokens_are_scored_by_the_raw_distribution_not_the_temperature(tiny64):
    eng = make_engine(tiny64)
    sp = SamplingParams(max_tokens=8, temperature=1.7, top_k=40, seed=11, logprobs=MAX_LOGPROBS)
    eng.add_request(EngineRequest("t", PROMPT, sp))
    toks, lps = steps(eng)["t"]
    check_against_dense(tiny64, PROMPT, toks, lps, MAX_LOGPROBS)
    # The same request without logprobs draws the very same tokens.
    eng.add_request(EngineRequest("u", PROMPT, SamplingParams(max_tokens=8, temperature=1.7, top_k=40, seed=11)))
    assert steps(eng)["u"] == (toks, [])


def test_only_rows_that_asked_get_logprobs_and_each_its_own_k(tiny64):
    eng = make_engine(tiny64)
    prompts = {"none": PROMPT[:9], "zero": PROMPT[2:], "two": PROMPT[:13], "five": PROMPT[4:15]}
    ks = {"none": None, "zero": 0, "two": 2, "five": 5}
    for rid, p in prompts.items():                    # one batch: rows with different k, one without
        eng.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=4, logprobs=ks[rid])))
    got = steps(eng)
    assert got["none"][1] == [] and len(got["none"][0]) == 4
    for rid in ("zero", "two", "five"):
        toks, lps = got[rid]
        check_against_dense(tiny64, prompts[rid], toks, lps, ks[rid])
        assert all(len(lp.top_ids) == ks[rid] for lp in lps)


def test_extend_of_given_output_tokens_reports_only_the_sampled_ones(tiny64):
    # Output tokens handed in (a handoff / P's first token) are not sampled here: no logprobs for them.
    ref = naive_greedy(tiny64, list(PROMPT), 6)
    eng = make_engine(tiny64)
    eng.add_request(EngineRequest("h", PROMPT, SamplingParams(max_tokens=6, logprobs=1),
                                  output_token_ids=tuple(ref[:3])))
    out = []
    while eng.has_work():
        out += [o for o in eng.step() if o.ids]
    assert out[0].position == 3
    toks = [t for o in out for t in o.ids]
    assert toks == ref[3:]
    check_against_dense(tiny64, list(PROMPT) + ref[:3], toks, [lp for o in out for lp in o.logprobs], 1)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0, "3"])
def test_logprobs_out_of_range_is_refused_naming_the_field(bad):
    with pytest.raises(RequestError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_cost_model_reports_its_own_uniform_distribution():
    cfg = EngineConfig(implementation="costmodel", block_size=16, num_blocks=64,
                       costmodel=CostModelConfig(hardware="H100-SXM", tensor_parallel=8))
    eng = CostModelEngine(profiles.model("llama3.1-70b"), profiles.hardware("H100-SXM"), cfg)
    eng.add_request(EngineRequest("c", PROMPT, SamplingParams(max_tokens=3, seed=4, logprobs=2)))
    eng.add_request(EngineRequest("d", PROMPT, SamplingParams(max_tokens=3, seed=4)))
    got = steps(eng)
    toks, lps = got["c"]
    assert toks == got["d"][0] and got["d"][1] == []          # the same tokens; logprobs only where asked
    eos = set(eng.spec.eos_token_ids)
    uniform = -math.log(eng.spec.vocab_size - len(eos))
    top = tuple(t for t in range(10) if t not in eos)[:2]
    assert lps == [TokenLogprobs(uniform, top, (uniform, uniform))] * 3
