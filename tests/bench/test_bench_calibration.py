"""Smoke test of `python -m pddgw.bench.calibration`: JSON shape, coverage, and one prediction recomputed."""

import json

import pytest

from pddgw.bench import calibration as bench
from pddgw.sim import profiles
from pddgw.sim.roofline import SeqWork, step_cost

ROW_KEYS = {"setup", "kind", "unit", "published", "predicted", "ratio", "bound", "engine", "hardware", "tp",
            "model", "batch", "prompt", "output", "conditions", "source"}


def test_main_json(capsys):
    bench.main(["--json"])
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    assert data["benchmark"] == "calibration"
    assert len(rows) == len(bench.MEASUREMENTS)
    assert all(set(r) == ROW_KEYS and r["ratio"] > 0 and r["source"] for r in rows)
    assert {r["hardware"] for r in rows} == {"A100-80G", "H100-SXM", "H200-SXM"}
    assert {"prefill_tok_s", "decode_ms"} <= {r["kind"] for r in rows}
    assert data["within_20pct"] == sum(0.8 <= r["ratio"] <= 1.2 for r in rows)

    # TensorRT-LLM 0.5, A100 TP4, Llama-2-70B: 2048-token prompt, first token in 377 ms.
    trt = next(r for r in rows if r["engine"].startswith("TensorRT-LLM"))
    assert trt["published"] == 2048 / 0.377
    step = step_cost(profiles.model("llama2-70b"), profiles.hardware("A100-80G"), 4, [SeqWork(2048, 0)])
    assert trt["predicted"] == pytest.approx(2048 / step.seconds, rel=1e-12)
    assert trt["ratio"] == pytest.approx(step.seconds / 0.377, rel=1e-12)


def test_request_latency_replays_prefill_then_decodes():
    # vLLM CI latency test: 8 x 32-token prompts, 128 outputs = 1 prefill step + 127 decode steps.
    m = next(m for m in bench.MEASUREMENTS if m.kind == "latency_ms" and m.hardware == "H200-SXM" and m.tp == 4)
    model, hw = profiles.model(m.model), profiles.hardware(m.hardware)
    total = step_cost(model, hw, 4, [SeqWork(32, 0)] * 8).seconds + sum(
        step_cost(model, hw, 4, [SeqWork(1, 32 + i)] * 8).seconds for i in range(127))
    value, seconds, bound = bench.predict(m)
    assert (value, seconds, bound) == (pytest.approx(total * 1e3), pytest.approx(total), "memory")


def test_table(capsys):
    bench.main([])
    out = capsys.readouterr().out
    assert "ratio = predicted time / measured time" in out
    assert "sources:" in out and "[1] " in out


def test_a_moe_row_is_replayed_on_its_instance_shape():
    # A DeepSeek-V3 decode row on 16 H100s as DP-attention 16 x TP 1: the prediction is the
    # roofline of that shape, not of TP 16.
    from pddgw.sim.roofline import Parallel

    m = bench.Measurement("example", "H100-SXM", 1, "deepseek-v3", 16, 1000, 3, "decode_ms", 50.0,
                          "shape check", "test", dp=16)
    model, hw = profiles.model("deepseek-v3"), profiles.hardware("H100-SXM")
    steps = [step_cost(model, hw, Parallel(tp=1, dp=16), [SeqWork(1, 1000 + i)] * 16).seconds for i in range(2)]
    value, seconds, bound = bench.predict(m)
    assert value == pytest.approx(sum(steps) / 2 * 1e3, rel=1e-12) and bound == "memory"
    assert step_cost(model, hw, Parallel(tp=16), [SeqWork(1, 1000)] * 16).seconds != steps[0]
    assert bench.run([m]).rows[0].setup.startswith("example, H100-SXM TP1xDP16, deepseek-v3")
