"""Smoke test of `python -m pddgw.bench.pipeline`: structure and what must hold in any run (no timings)."""

from pathlib import Path

import orjson

from pddgw.bench import pipeline as bench

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "mooncake_synthetic_trace.jsonl.gz"


def test_conversations_json(capsys):
    assert bench.main(["--conversations", "2", "--turns", "2", "--output-tokens", "8", "--arrival-s", "0.1",
                       "--json"]) == 0
    res = orjson.loads(capsys.readouterr().out)
    pdd, naive = res["pdd"], res["naive"]
    assert pdd["requests"] == naive["requests"] == 4
    assert naive["pipeline_share"] == {"P-MD": 1.0} and naive["rld_token_share"] == 0.0
    assert abs(sum(pdd["pipeline_share"].values()) - 1.0) < 1e-9
    # Naive sends every prompt's whole KV; PDD only what MD misses.
    assert 0 < pdd["wan_kv_mb"] < naive["wan_kv_mb"]
    assert res["ttft_p50_ratio"] == round(pdd["ttft_p50_ms"] / naive["ttft_p50_ms"], 3)


def test_trace_replay_scales_blocks(capsys):
    reqs = bench.load_trace(str(TRACE), 3, 16, 0.1, seed=0)
    # Requests 0 and 1 of the trace share no block; their prompts share no prefix block.
    assert [len(r["prompt"]) for r in reqs] == [round(n * 16 / 512) for n in (40160, 36640, 23769)]
    assert reqs[0]["prompt"][:16] != reqs[1]["prompt"][:16]
    assert [r["t_s"] for r in reqs] == [0.0, 0.0, 0.04]
    assert bench.main(["--trace", str(TRACE), "--requests", "3", "--output-scale", "0.05", "--json"]) == 0
    res = orjson.loads(capsys.readouterr().out)
    assert res["pdd"]["requests"] == res["naive"]["requests"] == 3
