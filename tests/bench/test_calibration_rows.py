"""The expert-parallel DeepSeek-V3 rows of calibration.toml (DeepSeek's online service, vLLM wide-EP),
cache-hit prefill rows, rows the profiles cannot price yet, and the +-25 % summary.  Exact, no timing:
the fixture's published numbers are set from the prediction, so no expectation moves with pricing."""

import dataclasses
import json

import pytest

from pddgw.bench import calibration as bench
from pddgw.sim import calibration as cal
from pddgw.sim import profiles
from pddgw.sim.roofline import Parallel, SeqWork, step_cost


def _rows(engine: str) -> list[cal.Measurement]:
    return [m for m in cal.MEASUREMENTS if m.engine == engine]


def test_deepseek_online_service_rows_parse():
    prefill, decode = _rows("DeepSeek online")
    assert (prefill.hardware, prefill.model, prefill.kind) == ("H800-SXM", "deepseek-v3", "prefill_tok_s")
    assert (prefill.tp, prefill.dp, prefill.ep, prefill.per_gpus) == (1, 32, 32, 8)
    assert (prefill.batch, prefill.prompt, prefill.cached, prefill.output) == (288, 4096, 2306, 1)
    assert prefill.published == 73_700.0 and prefill.scale == 0.25
    assert (decode.hardware, decode.kind, decode.tp, decode.dp, decode.ep, decode.per_gpus) == (
        "H800-SXM", "decode_tok_s", 1, 144, 144, 8)
    assert (decode.batch, decode.prompt, decode.output, decode.cached) == (144 * 88, 4989, 2, 0)
    assert decode.published == 14_800.0
    for m in (prefill, decode):
        assert "Day 6: One More Thing, DeepSeek-V3/R1 Inference System Overview" in m.source
        assert "2025-03-01" in m.source and "Statistics of DeepSeek's Online Service" in m.source
        assert "assumed" in m.conditions or "derived" in m.conditions


def test_vllm_wide_ep_rows_parse():
    rows = _rows("vLLM wide-EP")
    assert [(m.kind, m.dp, m.ep, m.batch, m.prompt, m.output, m.published) for m in rows] == [
        ("prefill_tok_s", 8, 8, 32, 2000, 1, 6_510.0),
        ("prefill_tok_s", 16, 16, 64, 2000, 1, 7_010.0),
        ("prefill_tok_s", 32, 32, 128, 2000, 1, 5_100.0),
        ("decode_tok_s", 32, 32, 32 * 256, 3000, 2, 2_180.0),
        ("decode_tok_s", 72, 72, 72 * 256, 3000, 2, 2_070.0),
        ("decode_tok_s", 96, 96, 96 * 256, 3000, 2, 1_970.0),
    ]
    assert {(m.hardware, m.model, m.tp, m.per_gpus, m.cached) for m in rows} == {
        ("H200-SXM", "deepseek-v3", 1, 1, 0)}
    assert all("DeepSeek @ 2.2k tok/s/H200 with Wide-EP" in m.source and "2025-12-17" in m.source for m in rows)


def test_a_cached_prefix_is_not_computed_but_counted():
    # DeepSeek online prefill: 288 prompts of 4,096 tokens, the first 2,306 of each a cache hit;
    # the step computes 1,790 tokens per prompt, the throughput counts all 4,096 (per node: / 4).
    (m, _) = _rows("DeepSeek online")
    step = step_cost(profiles.model("deepseek-v3"), profiles.hardware("H800-SXM"), Parallel(tp=1, dp=32, ep=32),
                     [SeqWork(4096 - 2306, 2306)] * 288)
    value, seconds, bound = cal.predict(m)
    assert seconds == step.seconds and bound == step.bound
    assert value == pytest.approx(288 * 4096 / step.seconds / 4, rel=1e-12)
    assert cal.measured_seconds(m) == pytest.approx(288 * 4096 / (73_700 * 4), rel=1e-12)
    assert bench.run([m]).rows[0].setup == (
        "DeepSeek online, H800-SXM TP1xDP32 EP32, deepseek-v3, prefill 288x4096 (2306 cached)")
    with pytest.raises(ValueError, match=r"cached must be in \[0, prompt 10\), got 10"):
        dataclasses.replace(m, prompt=10, cached=10)


def _at_ratio(m: cal.Measurement, ratio: float) -> cal.Measurement:
    """m with the published number at which predicted time / measured time is `ratio`."""
    value = cal.predict(m)[0]
    return dataclasses.replace(m, published=value / ratio if m.tokens is None else value * ratio)


def test_the_summary_counts_rows_within_25_percent():
    base = cal.Measurement("fixture", "H100-SXM", 1, "llama3-8b", 1, 100, 3, "decode_ms", 1.0, "", "src")
    tput = dataclasses.replace(base, kind="prefill_tok_s", output=1)
    fixture = [_at_ratio(base, 0.5), _at_ratio(tput, 0.9), _at_ratio(base, 1.1), _at_ratio(tput, 2.0),
               dataclasses.replace(base, hardware="X9000"), dataclasses.replace(base, model="nope-1b")]
    report = bench.run(fixture)
    assert [r.ratio for r in report.rows] == pytest.approx([0.5, 0.9, 1.1, 2.0], rel=1e-9)
    assert (report.within_25pct, report.within_20pct) == (2, 2)
    assert report.summary == "2 of 4 rows within +-25 %, 2 skipped"
    assert [s.reason for s in report.skipped] == [
        "skipped: hardware 'X9000' is not in pddgw.sim.profiles.HARDWARE",
        "skipped: model 'nope-1b' is not a pddgw.sim.profiles model or shipped config"]
    assert report.skipped[0].setup == "fixture, X9000 TP1, llama3-8b, batch 1, 100 in / 3 out"
    text = bench.render(report)
    assert text.splitlines()[1] == "2 of 4 rows within +-25 %, 2 skipped; 2 within +-20 %"
    assert "fixture, X9000 TP1, llama3-8b, batch 1, 100 in / 3 out, published 1 [1]: skipped: hardware" in text
    # Both ends of +-25 % are in, just outside is out.
    row = report.rows[0]
    edges = [dataclasses.replace(row, ratio=r) for r in (0.7499, 0.75, 1.0, 1.25, 1.2501)]
    assert bench.within(edges, 0.25) == 3 and bench.within(edges, 0.2) == 1
    assert bench.run(fixture[:4]).summary == "2 of 4 rows within +-25 %"


def test_json_carries_the_summary(capsys):
    bench.main(["--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["summary"] == f"{data['within_25pct']} of {len(data['rows'])} rows within +-25 %"
    assert data["skipped"] == [] and len(data["rows"]) == len(cal.MEASUREMENTS)
