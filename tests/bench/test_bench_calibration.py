"""Smoke test of `python -m pddgw.bench.calibration`: JSON shape, coverage, and one prediction recomputed."""

import json

import pytest

from pddgw.bench import calibration as bench
from pddgw.sim import calibration as cal
from pddgw.sim import profiles
from pddgw.sim.roofline import SeqWork, step_cost

ROW_KEYS = {"setup", "kind", "unit", "published", "predicted", "ratio", "bound", "comm_share", "engine",
            "hardware", "tp", "model", "batch", "prompt", "output", "conditions", "source"}


def test_main_json(capsys):
    bench.main(["--json"])
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    assert data["benchmark"] == "calibration"
    assert len(rows) == len(cal.MEASUREMENTS)
    assert all(set(r) == ROW_KEYS and r["ratio"] > 0 and r["source"] for r in rows)
    assert {r["hardware"] for r in rows} == {"A100-80G", "H100-SXM", "H200-SXM", "H800-SXM"}
    assert {"prefill_tok_s", "decode_ms", "decode_tok_s"} <= {r["kind"] for r in rows}
    assert data["within_20pct"] == sum(0.8 <= r["ratio"] <= 1.2 for r in rows)
    assert data["within_25pct"] == sum(0.75 <= r["ratio"] <= 1.25 for r in rows)
    assert all(0 <= r["comm_share"] < 1 for r in rows)
    # At least six MoE rows (expert-parallel DeepSeek-V3 deployments), each citing its source.
    moe = [r for r in rows if r["model"] == "deepseek-v3"]
    assert len(moe) >= 6 and all(
        any(s in r["source"] for s in ("lmsys.org/blog/2025-05-05-large-scale-ep", "open-infra-index",
                                       "blog.vllm.ai/2025/12/17/large-scale-serving")) for r in moe)

    # TensorRT-LLM 0.5, A100 TP4, Llama-2-70B: 2048-token prompt, first token in 377 ms.
    trt = next(r for r in rows if r["engine"].startswith("TensorRT-LLM"))
    assert trt["published"] == 2048 / 0.377
    step = step_cost(profiles.model("llama2-70b"), profiles.hardware("A100-80G"), 4, [SeqWork(2048, 0)])
    assert trt["predicted"] == pytest.approx(2048 / step.seconds, rel=1e-12)
    assert trt["ratio"] == pytest.approx(step.seconds / 0.377, rel=1e-12)


def test_request_latency_replays_prefill_then_decodes():
    # vLLM CI latency test: 8 x 32-token prompts, 128 outputs = 1 prefill step + 127 decode steps.
    m = next(m for m in cal.MEASUREMENTS if m.kind == "latency_ms" and m.hardware == "H200-SXM" and m.tp == 4)
    model, hw = profiles.model(m.model), profiles.hardware(m.hardware)
    total = step_cost(model, hw, 4, [SeqWork(32, 0)] * 8).seconds + sum(
        step_cost(model, hw, 4, [SeqWork(1, 32 + i)] * 8).seconds for i in range(127))
    value, seconds, bound = cal.predict(m)
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

    m = cal.Measurement("example", "H100-SXM", 1, "deepseek-v3", 16, 1000, 3, "decode_ms", 50.0,
                          "shape check", "test", dp=16)
    model, hw = profiles.model("deepseek-v3"), profiles.hardware("H100-SXM")
    steps = [step_cost(model, hw, Parallel(tp=1, dp=16), [SeqWork(1, 1000 + i)] * 16).seconds for i in range(2)]
    value, seconds, bound = cal.predict(m)
    assert value == pytest.approx(sum(steps) / 2 * 1e3, rel=1e-12) and bound == "memory"
    assert step_cost(model, hw, Parallel(tp=16), [SeqWork(1, 1000)] * 16).seconds != steps[0]
    assert bench.run([m]).rows[0].setup.startswith("example, H100-SXM TP1xDP16, deepseek-v3")


def test_a_per_node_expert_parallel_prefill_row():
    # SGLang, 4 x 8 H100 as DP-attention 32 x EP32: 128 prompts of 4,096 tokens (16,384 per GPU),
    # 50,302 tok/s per node measured.
    from pddgw.sim.roofline import Parallel

    m = next(m for m in cal.MEASUREMENTS if m.engine == "SGLang" and m.prompt == 4096)
    assert (m.batch, m.dp, m.ep, m.per_gpus, m.scale) == (128, 32, 32, 8, 0.25)
    step = step_cost(profiles.model("deepseek-v3"), profiles.hardware("H100-SXM"), Parallel(tp=1, dp=32, ep=32),
                     [SeqWork(4096, 0)] * 128)
    row = bench.run([m]).rows[0]
    # Per node: the instance's 128 x 4096 tokens per step, over its 4 nodes.
    assert row.predicted == pytest.approx(128 * 4096 / step.seconds / 4, rel=1e-12)
    assert row.ratio == pytest.approx(step.seconds / (128 * 4096 / (50_302 * 4)), rel=1e-12)
    assert row.comm_share == pytest.approx(step.comm_s / step.seconds, rel=1e-12)
    assert row.unit == "prefill tok/s per node" and row.bound == "compute"


def test_a_per_node_decode_throughput_row():
    # DeepSeek's decode profile: 16 x 8 H800, 128 requests per GPU at a 4,096-token KV, one step.
    from pddgw.sim.roofline import Parallel

    m = next(m for m in cal.MEASUREMENTS if m.kind == "decode_tok_s" and m.hardware == "H800-SXM")
    step = step_cost(profiles.model("deepseek-v3"), profiles.hardware("H800-SXM"),
                     Parallel(tp=1, dp=128, ep=128), [SeqWork(1, 4096)] * (128 * 128))
    value, seconds, _ = cal.predict(m)
    assert seconds == pytest.approx(step.seconds, rel=1e-12)
    assert value == pytest.approx(128 * 128 / step.seconds / 16, rel=1e-12)
    assert cal.measured_seconds(m) == pytest.approx(128 * 128 / (18_598 * 16), rel=1e-12)


def test_fp8_rows_run_fp8_weights_at_the_fp8_peak():
    fp8 = cal.model_profile("llama2-70b@fp8")
    bf16 = profiles.model("llama2-70b")
    assert fp8.weight_bytes * 2 == bf16.weight_bytes and fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.fp8_compute and not bf16.fp8_compute
    h100 = profiles.hardware("H100-SXM")
    # A 2K prefill at TP4 is compute-bound: FP8 halves the GEMMs' seconds (1,979 vs 989.5 TFLOPS);
    # the attention core (4 x 80 layers x 64 heads x 128 per causal pair) stays at the BF16 peak.
    a = step_cost(fp8, h100, 4, [SeqWork(2048, 0)])
    b = step_cost(bf16, h100, 4, [SeqWork(2048, 0)])
    attn = 4 * 80 * 64 * 128 * 2048 * 2049 / 2
    assert a.flops == b.flops
    assert a.compute_s == pytest.approx(((b.flops - attn) / 1979e12 + attn / 989.5e12) / 4 / h100.compute_efficiency,
                                        rel=1e-12)
    assert b.compute_s == pytest.approx(b.flops / 989.5e12 / 4 / h100.compute_efficiency, rel=1e-12)
    assert cal.model_profile("llama2-7b").num_kv_heads == 32
    with pytest.raises(ValueError, match="per_gpus applies to throughputs"):
        cal.Measurement("x", "H100-SXM", 1, "llama3-8b", 1, 10, 10, "decode_ms", 1.0, "", "", per_gpus=8)


def test_h800_is_h100_compute_with_a_narrower_nvlink():
    h800, h100 = profiles.hardware("H800-SXM"), profiles.hardware("H100-SXM")
    assert h800.interconnect_gb_s == 200.0 and h100.interconnect_gb_s == 450.0
    assert (h800.peak_tflops_bf16, h800.peak_tflops_fp8, h800.hbm_tb_s, h800.hbm_gb, h800.scaleout_gb_s) == (
        h100.peak_tflops_bf16, h100.peak_tflops_fp8, h100.hbm_tb_s, h100.hbm_gb, h100.scaleout_gb_s)
    assert (h800.compute_efficiency, h800.bandwidth_efficiency) == (h100.compute_efficiency, h100.bandwidth_efficiency)


ROW = ('[sources]\nnotes = "a published table"\n\n[[measurement]]\nengine = "e"\nhardware = "H100-SXM"\ntp = 1\n'
       'model = "llama3-8b"\nbatch = 1\nprompt = 10\noutput = 10\nkind = "decode_ms"\npublished = 5.0\n'
       'conditions = ""\nsource = "notes"\n')


def test_the_measurement_file_is_read_strictly():
    (m,) = cal.load_measurements(ROW)
    assert (m.engine, m.tp, m.published, m.source) == ("e", 1, 5.0, "a published table")
    with pytest.raises(ValueError, match=r"measurement 1 \(e, H100-SXM, llama3-8b\): unknown key\(s\) sorce"):
        cal.load_measurements(ROW + 'sorce = "notes"\n')
    with pytest.raises(ValueError, match=r"measurement 1 .*: source 'elsewhere' is not in \[sources\]"):
        cal.load_measurements(ROW.replace('source = "notes"', 'source = "elsewhere"'))
    with pytest.raises(ValueError, match=r"measurement 1 .*missing 1 required positional argument: 'published'"):
        cal.load_measurements(ROW.replace("published = 5.0\n", ""))
    with pytest.raises(ValueError, match=r"calibration.toml: unknown table\(s\) extra"):
        cal.load_measurements(ROW + "[extra]\n")
