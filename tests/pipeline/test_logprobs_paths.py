"""Log-probabilities on every path: the same sequence as one local engine, every position once.

The embedded deployment (in-process links, shaped WAN) on the tiny model in
float64, each request forced onto P-MD, P-RLD-MD (one-shot, catch-up) or
P-RLD.  P's first token's logprobs travel with the KV to the decoder that
emits position 0; RLD's eager tokens carry theirs; MD's extend of handed-off
tokens emits nothing again.  Tokens and alternative ids must be identical to
one local engine's; values within 1e-5 (the sampler computes them in float32
from the float64 logits, and an extend vs single decodes may round those
logits differently in the last bit).
"""

from __future__ import annotations

import asyncio

import pytest

from pddgw.config import EngineConfig
from pddgw.engines.torch_engine import TorchEngine
from pddgw.core.tokens import TokenLogprobs, TokenRun
from pddgw.engines.types import EngineRequest, SamplingParams
from pddgw.engines.weights import build_tiny
from pddgw.net import frames
from pddgw.pipeline.events import StreamError, StreamReader, Tokens
from pddgw.pipeline.ordering import StreamMerger
from pddgw import messages as m

from .pdd_client import chat
from .test_embedded import deploy, make_cfg, prompt_of  # noqa: F401  (deploy is a fixture)

TOL = 1e-5
_MODEL = []


def local(prompt, sp: SamplingParams) -> tuple[list[int], list[TokenLogprobs]]:
    """One local engine: the yardstick."""
    if not _MODEL:
        _MODEL.append(build_tiny(0, "float64", "cpu"))
    model = _MODEL[0]
    eng = TorchEngine(model, model.spec, EngineConfig(num_blocks=512, max_num_batched_tokens=512), model.dtype)
    eng.add_request(EngineRequest("ref", tuple(prompt), sp))
    toks: list[int] = []
    lps: list[TokenLogprobs] = []
    while eng.has_work():
        for o in eng.step():
            toks += o.ids
            lps += o.logprobs
    return toks, lps


async def local_off_loop(prompt, sp: SamplingParams) -> tuple[list[int], list[TokenLogprobs]]:
    """`local` on a thread: the deployment's heartbeats keep running meanwhile."""
    return await asyncio.to_thread(local, prompt, sp)


def assert_same(got: list[TokenLogprobs], want: list[TokenLogprobs]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.top_ids == b.top_ids, i
        assert abs(a.logprob - b.logprob) <= TOL, (i, a, b)
        assert all(abs(x - y) <= TOL for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True)), (i, a, b)


async def run_on(side, rid: str, prompt, sp: SamplingParams, pipeline: str, mode: str | None = None):
    runs: list[TokenRun] = []

    async def emit(run: TokenRun) -> None:
        runs.append(run)

    out = await side.router.run(rid, tuple(prompt), sp, emit, pipeline, mode)
    return out, runs


def check_runs(runs: list[TokenRun], toks: list[int], lps: list[TokenLogprobs]) -> None:
    """Every position once, in order, each run with one logprobs entry per token."""
    pos = 0
    for r in runs:
        assert r.position == pos and len(r.logprobs) == len(r.ids), r
        pos = r.end
    assert [t for r in runs for t in r.ids] == toks
    assert_same([lp for r in runs for lp in r.logprobs], lps)


@pytest.mark.parametrize("pipeline,mode", [("P-MD", None), ("P-RLD-MD", "one-shot"), ("P-RLD-MD", "catch-up"),
                                           ("P-RLD", None)])
async def test_every_path_streams_the_local_engines_logprobs(deploy, pipeline, mode):  # noqa: F811
    ws, side, _ = await deploy(make_cfg(pipeline=pipeline, handoff_mode=mode or "auto", catchup_threshold=2,
                                        catchup_threshold_md_loaded=2, catchup_max_rounds=2))
    p = prompt_of(120)
    n = 300 if pipeline == "P-RLD-MD" else 40
    sp = SamplingParams(max_tokens=n, temperature=0.8, seed=77, logprobs=3)
    toks, lps = await local_off_loop(p, sp)
    assert len(lps) == n
    out, runs = await run_on(side, "lp-" + pipeline + (mode or ""), p, sp, pipeline, mode)
    assert list(out.output_ids) == toks
    check_runs(runs, toks, lps)
    tl = out.record.to_dict()
    assert tl["pipeline"] == pipeline
    if pipeline == "P-RLD-MD":
        at = tl["handoff_position"]
        # P's first token, RLD's and MD's: all carried logprobs.
        assert 0 < at < n and tl["tokens_by_role"] == {"prefill": 1, "rld": at - 1, "md": n - at}
    # The same request without logprobs: the same tokens, runs without logprobs.
    out2, runs2 = await run_on(side, "plain-" + pipeline + (mode or ""), p,
                               SamplingParams(max_tokens=n, temperature=0.8, seed=77), pipeline, mode)
    assert list(out2.output_ids) == toks and all(r.logprobs == () for r in runs2)


async def test_greedy_first_token_from_p_through_md_and_the_websocket_door(deploy):  # noqa: F811
    ws, side, _ = await deploy(make_cfg(pipeline="P-MD"))
    p = prompt_of(70)
    toks, lps = await local_off_loop(p, SamplingParams(max_tokens=6, logprobs=2))
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=6, temperature=0,
                   include=["message.output_text.logprobs"], top_logprobs=2)
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == toks
    tok = side.door.tok
    got = [c for d in r.deltas for c in d["logprobs"]]
    assert sum(len(d["pddgw"]["token_ids"]) for d in r.deltas) == len(got)
    for c, t, lp in zip(got, toks, lps, strict=True):
        assert c["token"] == tok.decode([t]) and c["bytes"] == list(tok.decode([t]).encode())
        assert abs(c["logprob"] - lp.logprob) <= TOL and c["logprob"] == c["top_logprobs"][0]["logprob"]  # greedy
        assert [x["token"] for x in c["top_logprobs"]] == [tok.decode([i]) for i in lp.top_ids]
    part = r.final["response"]["output"][0]["content"][0]
    assert part["logprobs"] == got
    # Not asked for: absent from the deltas and the output_text part.
    r2 = await chat(ws, prompt_token_ids=p, max_output_tokens=6, temperature=0)
    assert all("logprobs" not in d for d in r2.deltas)
    assert "logprobs" not in r2.final["response"]["output"][0]["content"][0]


async def test_out_of_range_top_logprobs_is_an_error_event_naming_it(deploy):  # noqa: F811
    ws, side, _ = await deploy(make_cfg(pipeline="P-MD"))
    r = await chat(ws, prompt_token_ids=prompt_of(20), max_output_tokens=2,
                   include=["message.output_text.logprobs"], top_logprobs=21)
    assert r.final["type"] == "error" and r.final["error"]["param"] == "top_logprobs", r.final


# ---- the wire message and the router's edge -------------------------------------------


def entry(i: int, k: int = 2) -> TokenLogprobs:
    return TokenLogprobs(-0.25 * i, tuple(range(i, i + k)), tuple(-0.1 * (j + 1) for j in range(k)))


def test_logprobs_message_round_trips_and_is_bounded():
    pieces = m.logprob_pieces("r", 5, [entry(i) for i in range(m.MAX_LOGPROB_POSITIONS + 3)])
    assert [(p.position, len(p.logprobs)) for p in pieces] == [(5, m.MAX_LOGPROB_POSITIONS),
                                                                (5 + m.MAX_LOGPROB_POSITIONS, 3)]
    for p in pieces:
        assert frames.decode(frames.encode_bytes(p)).msg == p
    assert [e for p in pieces for e in p.entries()] == [entry(i) for i in range(m.MAX_LOGPROB_POSITIONS + 3)]
    floor = m.logprob_pieces("r", 0, [TokenLogprobs(float("-inf"), (1,), (float("-inf"),))])[0]
    assert floor.logprobs == (-9999.0,) and floor.top_logprobs == (-9999.0,)
    for bad in [dict(logprobs=(0.5,)), dict(logprobs=(float("nan"),)), dict(logprobs=()),
                dict(logprobs=(-1.0,) * (m.MAX_LOGPROB_POSITIONS + 1)), dict(top_n=21),
                dict(top_ids=(1, 2, 3)), dict(top_logprobs=(True, -1.0))]:
        fields = dict(request_id="r", position=0, top_n=2, logprobs=(-1.0,), top_logprobs=(-1.0, -2.0),
                      top_ids=(1, 2)) | bad
        with pytest.raises(ValueError):
            m.Logprobs(**fields)
    # Sampling fields carry the request's k (None: none).
    sub = m.Submit(request_id="r", kv="import", hold=False, prompt=(1,), sampling=SamplingParams(logprobs=4))
    assert frames.decode(frames.encode_bytes(sub)).msg.sampling.logprobs == 4
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


def test_router_edge_joins_pieces_with_their_tokens_and_refuses_mismatches():
    r = StreamReader("md0", "md", top_n=2)
    for p in m.logprob_pieces("r", 3, [entry(3), entry(4)]):
        assert r.event(p) is None
    ev = r.event(m.TokenItem("r", 3, (7, 8)))
    assert ev == Tokens("md0", TokenRun("r", 3, (7, 8), logprobs=(entry(3), entry(4)), role="md"))
    assert r.event(m.TokenItem("r", 5, (), True, "stop")) == Tokens("md0", TokenRun("r", 5, (), True, "stop",
                                                                                   role="md"))
    bad = [
        ([], m.TokenItem("r", 0, (1,))),                                             # missing
        (m.logprob_pieces("r", 1, [entry(1)]), m.TokenItem("r", 0, (1,))),          # wrong position
        (m.logprob_pieces("r", 0, [entry(0)]), m.TokenItem("r", 0, (1, 2))),        # too few
        (m.logprob_pieces("r", 0, [entry(0, 3)]), None),                            # wrong k
    ]
    for pieces, item in bad:
        r = StreamReader("md0", "md", top_n=2)
        with pytest.raises(StreamError):
            for p in pieces:
                r.event(p)
            r.event(item)
    with pytest.raises(StreamError):                                                 # nobody asked
        StreamReader("md0", "md").event(m.logprob_pieces("r", 0, [entry(0)])[0])


def test_merger_passes_the_first_sources_logprobs_once_in_order():
    mg = StreamMerger("r")
    assert mg.push(TokenRun("r", 2, (12, 13), logprobs=(entry(2), entry(3)), role="md")) == []
    runs = mg.push(TokenRun("r", 0, (10, 11, 12), logprobs=(entry(0), entry(1), entry(2, 3)),
                            role="rld"))                                             # overlaps MD's 2
    assert runs == [TokenRun("r", 0, (10, 11), logprobs=(entry(0), entry(1)), role="rld"),
                    TokenRun("r", 2, (12, 13), logprobs=(entry(2), entry(3)), role="md")]
    assert mg.push(TokenRun("r", 4, (14,), role="md")) == [TokenRun("r", 4, (14,), role="md")]
    with pytest.raises(ValueError):
        mg.push(TokenRun("r", 5, (15, 16), logprobs=(entry(5),), role="md"))


async def test_a_handed_off_request_redriven_keeps_logprobs(deploy, monkeypatch):  # noqa: F811
    """MD refuses the final handoff round: the re-drive emits from the emitted tokens on, with logprobs."""
    from pddgw.engines.types import RequestError
    from pddgw.pipeline.decode import DecodeWorker

    ws, side, _ = await deploy(make_cfg(pipeline="P-RLD-MD", handoff_mode="one-shot"))
    extend = DecodeWorker.extend
    refused: list[str] = []

    async def refuse_first_final(self, rid, start, ids, final):
        if final and not refused:
            refused.append(rid)
            raise RequestError(f"request {rid!r}: MD refuses the final round (test)")
        return await extend(self, rid, start, ids, final)

    monkeypatch.setattr(DecodeWorker, "extend", refuse_first_final)
    p = prompt_of(120)
    sp = SamplingParams(max_tokens=200, temperature=0.8, seed=5, logprobs=1)
    toks, lps = await local_off_loop(p, sp)
    out, runs = await run_on(side, "redrive", p, sp, "P-RLD-MD", "one-shot")
    assert list(out.output_ids) == toks and out.record.to_dict()["redrives"]
    check_runs(runs, toks, lps)
