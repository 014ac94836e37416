"""Cost-model calibration: the roofline step time against published LLM-serving measurements.

`python -m pddgw.bench.calibration [--json]`

Each row is one number a public source measured (engine, GPU, parallelism,
model, batch, prompt and output lengths as it states them) next to what
`pddgw.sim.roofline.step_cost` predicts for the same work on the
`pddgw.sim.profiles` hardware: one prefill step of all prompts, then
output - 1 decode steps of the whole batch, the context one token longer
each.  Compared, by what the source reports: prefill_tok_s (prompt tokens /
prefill step), decode_ms (mean decode step), decode_tok_s (batch / mean
decode step), latency_ms (prefill + every decode step), user_tok_s (output
tokens / that, one stream).  Large expert-parallel throughputs are
published per node or GPU (`per_gpus`), and shown in that unit; a model
ending in "@fp8" is that profile with FP8 weights and KV.

`ratio` is predicted time / measured time (> 1: the model is slower);
`comm_share` is the part of the predicted steps that is communication (TP
all-reduces, EP all-to-alls), never overlapped with compute.  Nothing is
timed; the output is deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pddgw.sim import profiles
from pddgw.sim.profiles import ModelProfile
from pddgw.sim.roofline import Parallel, SeqWork, StepCost, step_cost
from pddgw.tables import add_output_args, emit, format_table

Kind = Literal["prefill_tok_s", "decode_ms", "decode_tok_s", "latency_ms", "user_tok_s"]
UNITS: dict[str, str] = {"prefill_tok_s": "prefill tok/s", "decode_ms": "decode ms/step",
                         "decode_tok_s": "decode tok/s", "latency_ms": "request ms",
                         "user_tok_s": "tok/s (1 user)"}

GPT_FAST = ("https://github.com/pytorch-labs/gpt-fast/blob/0f925b5d4ce457b89a7ca6c9ce50f42bf2576945/README.md "
            "(Tensor Parallelism table)")
LMDEPLOY = ("https://github.com/InternLM/lmdeploy/blob/3e391df4673326f79363eebe030876861a9b7090/"
            "docs/en/benchmark/a100_fp16.md (lmdeploy v0.1.0a1, static inference, llama2-70b)")
TRTLLM = ("https://github.com/NVIDIA/TensorRT-LLM/blob/138f96d45f90b9667426f7c47297d8c06bafac73/"
          "docs/source/performance.md (Low Latency, A100 FP16, data from v0.5)")
SPLITWISE = ("Splitwise (Patel et al., ISCA 2024) profiling data, precision not stated: "
             "https://github.com/Mutinifni/splitwise-sim/blob/378088013a54df6f2052c27ff5ae6ea7619c3ecc/"
             "data/perf_model.csv")
TRTLLM_FP8 = ("https://github.com/NVIDIA/TensorRT-LLM/blob/138f96d45f90b9667426f7c47297d8c06bafac73/"
              "docs/source/performance.md (Low Latency, H100 GPUs (FP8), data from v0.5)")
SGLANG_EP = ("LMSYS blog 'Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on "
             "96 H100 GPUs' (SGLang team, 2025-05-05), https://lmsys.org/blog/2025-05-05-large-scale-ep/")
DEEPSEEK_PROFILE = ("DeepSeek's published profile (github.com/deepseek-ai/profile-data README: prefill EP32 TP1, "
                    "4K prompts, 16K tokens per GPU; decode EP128 TP1, 4K prompts, 128 requests per GPU; two "
                    "micro-batches, balanced routing simulated) as throughput per node in "
                    + SGLANG_EP + ", 'Profile Results' tables, column 'DeepSeek Profile'")
VLLM_CI = "https://buildkite.com/vllm/performance-benchmark/builds/"
VLLM_TEST = ("benchmark_latency per vllm .buildkite/nightly-benchmarks/tests/latency-tests.json "
             "(d5ce924): dummy weights, model dtype (bf16), mean of 15 iterations")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One published number and the conditions it was measured under."""

    engine: str
    hardware: str      # pddgw.sim.profiles.HARDWARE name
    tp: int
    model: str         # pddgw.sim.profiles.MODELS name
    batch: int         # concurrent sequences
    prompt: int        # prompt tokens per sequence
    output: int        # generated tokens per sequence (1: prefill only)
    kind: Kind
    published: float   # in the unit of `kind`
    conditions: str    # what the source states beyond the columns
    source: str
    # The instance's shape beyond tp (pddgw.sim.roofline.Parallel): DP-attention ranks of tp
    # GPUs each (GPUs = tp x dp), experts over ep of them (0 = all).  Dense rows: 1 and 0.
    dp: int = 1
    ep: int = 0
    # The published throughput is per this many GPUs (8: per node); 0 = the whole instance.
    per_gpus: int = 0

    @property
    def parallel(self) -> Parallel:
        return Parallel(tp=self.tp, dp=self.dp, ep=self.ep)

    @property
    def scale(self) -> float:
        """Published unit over the whole instance: per_gpus / gpus (1 = the instance)."""
        return self.per_gpus / (self.tp * self.dp) if self.per_gpus else 1.0

    def __post_init__(self) -> None:
        if self.kind != "prefill_tok_s" and self.output < 2:
            raise ValueError(f"a {self.kind} measurement needs output >= 2 (at least one decode step)")
        if self.per_gpus and self.kind not in ("prefill_tok_s", "decode_tok_s"):
            raise ValueError(f"per_gpus applies to throughputs (prefill_tok_s, decode_tok_s), not {self.kind}")


MEASUREMENTS: tuple[Measurement, ...] = (
    # ---- A100 80GB SXM -------------------------------------------------------------
    Measurement("gpt-fast", "A100-80G", 4, "llama2-70b", 1, 5, 200, "user_tok_s", 38.01,
                "bf16, torch.compile, batch 1; A100s power-limited to 330 W; 5-token prompt; 200 new "
                "tokens is generate.py's CLI default (the README does not say; the prompt is 1 step)",
                GPT_FAST),
    Measurement("gpt-fast", "A100-80G", 8, "llama2-70b", 1, 5, 200, "user_tok_s", 62.50,
                "as above, 8 GPUs", GPT_FAST),
    Measurement("TensorRT-LLM 0.5", "A100-80G", 4, "llama2-70b", 1, 2048, 1, "prefill_tok_s", 2048 / 0.377,
                "FP16, batch 1, input 2048: 1st-token latency 377 ms", TRTLLM),
    Measurement("LMDeploy TurboMind", "A100-80G", 4, "llama2-70b", 1, 2048, 1, "prefill_tok_s", 2048 / 0.402,
                "FP16, batch 1, 2048 in / 128 out: first-token latency 0.402 s (mean)", LMDEPLOY),
    Measurement("LMDeploy TurboMind", "A100-80G", 4, "llama2-70b", 1, 2048, 128, "decode_ms", 31.0,
                "FP16, batch 1, 2048 in / 128 out: per-token latency 0.031 s (50th percentile)", LMDEPLOY),
    Measurement("LMDeploy TurboMind", "A100-80G", 4, "llama2-70b", 64, 2048, 2048, "decode_ms", 55.0,
                "FP16, batch 64, 2048 in / 2048 out: per-token latency 0.055 s (50th percentile)", LMDEPLOY),
    Measurement("Splitwise profile", "A100-80G", 4, "llama2-70b", 1, 8192, 1, "prefill_tok_s", 8192 / 2.27845,
                "DGX-A100, batch 1, prompt 8192: prompt_time 2278.45 ms (median of 5)", SPLITWISE),
    Measurement("Splitwise profile", "A100-80G", 4, "llama2-70b", 1, 512, 128, "decode_ms", 44.99,
                "DGX-A100, batch 1, prompt 512, 128 tokens: token_time 44.99 ms (median)", SPLITWISE),
    Measurement("vLLM CI", "A100-80G", 4, "llama3-70b", 8, 32, 128, "latency_ms", 3990.59,
                f"A100-SXM4-80GB, Meta-Llama-3-70B-Instruct; {VLLM_TEST}", VLLM_CI + "9523"),
    Measurement("vLLM CI", "A100-80G", 1, "llama3-8b", 8, 32, 128, "latency_ms", 1579.27,
                f"A100-SXM4-80GB, Meta-Llama-3-8B; {VLLM_TEST}", VLLM_CI + "9523"),
    # ---- H100 SXM ----------------------------------------------------------------------
    Measurement("vLLM CI", "H100-SXM", 4, "llama3-70b", 8, 32, 128, "latency_ms", 2444.47,
                f"8xH100 node, Meta-Llama-3-70B-Instruct; {VLLM_TEST}", VLLM_CI + "9555"),
    Measurement("vLLM CI", "H100-SXM", 1, "llama3-8b", 8, 32, 128, "latency_ms", 997.542,
                f"8xH100 node, Meta-Llama-3-8B; {VLLM_TEST}", VLLM_CI + "9555"),
    Measurement("Splitwise profile", "H100-SXM", 4, "llama2-70b", 1, 2048, 1, "prefill_tok_s", 2048 / 0.20068,
                "DGX-H100, batch 1, prompt 2048: prompt_time 200.68 ms (median of 5)", SPLITWISE),
    Measurement("Splitwise profile", "H100-SXM", 4, "llama2-70b", 1, 8192, 1, "prefill_tok_s", 8192 / 0.95358,
                "DGX-H100, batch 1, prompt 8192: prompt_time 953.58 ms (median of 5)", SPLITWISE),
    Measurement("Splitwise profile", "H100-SXM", 4, "llama2-70b", 1, 512, 128, "decode_ms", 29.72,
                "DGX-H100, batch 1, prompt 512, 128 tokens: token_time 29.72 ms (median)", SPLITWISE),
    Measurement("TensorRT-LLM 0.5", "H100-SXM", 4, "llama2-70b@fp8", 1, 2048, 1, "prefill_tok_s", 2048 / 0.109,
                "FP8 (--enable_fp8 --fp8_kv_cache), batch 1, input 2048: 1st-token latency 109 ms", TRTLLM_FP8),
    Measurement("TensorRT-LLM 0.5", "H100-SXM", 1, "llama2-7b@fp8", 1, 2048, 1, "prefill_tok_s", 2048 / 0.036,
                "FP8 (--enable_fp8 --fp8_kv_cache), batch 1, input 2048: 1st-token latency 36 ms", TRTLLM_FP8),
    # ---- MoE, expert parallel: DeepSeek-V3 (FP8 checkpoint) on H100 and H800 nodes ------
    # SGLang: prefill on 4 nodes, attention DP32 (TP1) and experts EP32, two-batch overlap,
    # DeepEP normal mode; 16,384 tokens per GPU per step (stated for the 4K case, assumed for
    # 1K and 2K): 16 / 8 / 4 prompts per GPU.
    Measurement("SGLang", "H100-SXM", 1, "deepseek-v3", 32 * 16, 1024, 1, "prefill_tok_s", 57_674.0,
                "4 x 8 H100 (EP32, DP-attention 32), prompt 1K: 57,674 tok/s per node ('Prefill Phase'); "
                "16,384 tokens per GPU assumed as in the 4K profile", SGLANG_EP, dp=32, ep=32, per_gpus=8),
    Measurement("SGLang", "H100-SXM", 1, "deepseek-v3", 32 * 8, 2048, 1, "prefill_tok_s", 54_543.0,
                "as above, prompt 2K: 54,543 tok/s per node", SGLANG_EP, dp=32, ep=32, per_gpus=8),
    Measurement("SGLang", "H100-SXM", 1, "deepseek-v3", 32 * 4, 4096, 1, "prefill_tok_s", 50_302.0,
                "as above, prompt 4K, 16,384 tokens per GPU, default EPLB: 50,302 tok/s per node "
                "('Overall Throughput' table)", SGLANG_EP, dp=32, ep=32, per_gpus=8),
    # SGLang decode: 9 nodes, DP-attention 72 and EP72, DeepEP low-latency mode, 256
    # sequences per GPU at a 2,000-token KV; one decode step replayed.
    Measurement("SGLang", "H100-SXM", 1, "deepseek-v3", 72 * 256, 2000, 2, "decode_tok_s", 22_282.0,
                "9 x 8 H100 (EP72, DP-attention 72), 256 sequences per GPU, KV length 2,000: 22,282 tok/s "
                "per node ('Decode Phase'; decode table 'SGLang (Default)')", SGLANG_EP, dp=72, ep=72, per_gpus=8),
    Measurement("DeepSeek profile", "H800-SXM", 1, "deepseek-v3", 32 * 4, 4096, 1, "prefill_tok_s", 62_713.0,
                "4 x 8 H800, EP32 TP1, prompt 4,096, 16,384 tokens per GPU: 62,713 tok/s per node",
                DEEPSEEK_PROFILE, dp=32, ep=32, per_gpus=8),
    Measurement("DeepSeek profile", "H800-SXM", 1, "deepseek-v3", 128 * 128, 4096, 2, "decode_tok_s", 18_598.0,
                "16 x 8 H800, EP128 TP1, 128 requests per GPU, KV length 4,096: 18,598 tok/s per node",
                DEEPSEEK_PROFILE, dp=128, ep=128, per_gpus=8),
    # ---- H200 SXM ----------------------------------------------------------------------
    Measurement("vLLM CI", "H200-SXM", 4, "llama3-70b", 8, 32, 128, "latency_ms", 2077.53,
                f"H200, Meta-Llama-3-70B-Instruct; {VLLM_TEST}", VLLM_CI + "9515"),
    Measurement("vLLM CI", "H200-SXM", 1, "llama3-8b", 8, 32, 128, "latency_ms", 833.421,
                f"H200, Meta-Llama-3-8B; {VLLM_TEST}", VLLM_CI + "9515"),
)


# Shapes the calibration needs beyond pddgw.sim.profiles.MODELS.
# meta-llama/Llama-2-7b-hf config.json: 32 layers of 4096, 32 heads (no GQA), MLP 11008.
EXTRA_MODELS: dict[str, ModelProfile] = {p.name: p for p in (
    ModelProfile(name="llama2-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
                 intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, eos_token_ids=(2,),
                 bos_token_id=1, arch="llama", rope_theta=10000.0, rms_norm_eps=1e-5),
)}
FP8_SUFFIX = "@fp8"


def model_profile(name: str) -> ModelProfile:
    """A calibration row's model: a profile (or EXTRA_MODELS) name, "@fp8" for FP8 weights and KV."""
    base, fp8 = (name[: -len(FP8_SUFFIX)], True) if name.endswith(FP8_SUFFIX) else (name, False)
    prof = EXTRA_MODELS[base] if base in EXTRA_MODELS else profiles.model(base)
    if fp8:
        prof = dataclasses.replace(prof, name=name, weight_bytes_per_param=1.0, kv_bytes_per_value=1)
    return prof


@dataclass(frozen=True, slots=True)
class Row:
    setup: str
    kind: str
    unit: str
    published: float
    predicted: float
    ratio: float           # predicted time / measured time
    bound: str             # what bounds the modeled steps: "compute", "memory" or both
    comm_share: float      # communication's share of the predicted time
    engine: str
    hardware: str
    tp: int
    model: str
    batch: int
    prompt: int
    output: int
    conditions: str
    source: str


@dataclass(frozen=True, slots=True)
class Report:
    benchmark: str
    rows: list[Row]
    within_20pct: int      # rows with 0.8 <= ratio <= 1.2
    within_25pct: int      # rows with 0.75 <= ratio <= 1.25


def _replay(m: Measurement) -> tuple[StepCost, list[StepCost]]:
    """(the prefill step of every prompt, the output - 1 decode steps of the whole batch)."""
    model, hw = model_profile(m.model), profiles.hardware(m.hardware)
    par = m.parallel
    prefill = step_cost(model, hw, par, [SeqWork(m.prompt, 0)] * m.batch)
    # Decode step i (0-based) feeds output token i back in, on top of the prompt and the i earlier outputs.
    decodes = [step_cost(model, hw, par, [SeqWork(1, m.prompt + i)] * m.batch) for i in range(m.output - 1)]
    return prefill, decodes


def predict(m: Measurement) -> tuple[float, float, str]:
    """(predicted value in the unit of m.kind, predicted seconds, bound) for the measured work."""
    value, seconds, bound, _ = _predict(m)
    return value, seconds, bound


def _predict(m: Measurement) -> tuple[float, float, str, float]:
    """predict's (value, seconds, bound) and the communication seconds of the compared steps."""
    prefill, decodes = _replay(m)
    steps = [prefill] if m.kind == "prefill_tok_s" else decodes
    bound = "/".join(sorted({c.bound for c in steps}))
    if m.kind == "prefill_tok_s":
        return m.batch * m.prompt / prefill.seconds * m.scale, prefill.seconds, bound, prefill.comm_s
    comm = statistics.fmean(c.comm_s for c in decodes)
    if m.kind in ("decode_ms", "decode_tok_s"):
        s = statistics.fmean(c.seconds for c in decodes)
        return (s * 1e3 if m.kind == "decode_ms" else m.batch / s * m.scale), s, bound, comm
    total = prefill.seconds + sum(c.seconds for c in decodes)
    comm = prefill.comm_s + sum(c.comm_s for c in decodes)
    if m.kind == "latency_ms":
        return total * 1e3, total, bound, comm
    return m.output / total, total, bound, comm


def measured_seconds(m: Measurement) -> float:
    """The published number as seconds of the same span `predict` times."""
    if m.kind == "prefill_tok_s":
        return m.batch * m.prompt / (m.published / m.scale)
    if m.kind == "decode_tok_s":
        return m.batch / (m.published / m.scale)
    if m.kind == "user_tok_s":
        return m.output / m.published
    return m.published / 1e3


def run(measurements: Sequence[Measurement] = MEASUREMENTS) -> Report:
    rows = []
    for m in measurements:
        value, seconds, bound, comm = _predict(m)
        shape = f"TP{m.tp}" + (f"xDP{m.dp}" if m.dp > 1 else "") + (f" EP{m.ep}" if m.ep else "")
        unit = UNITS[m.kind] + ({1: " per GPU", 8: " per node"}.get(m.per_gpus, f" per {m.per_gpus} GPUs")
                                if m.per_gpus else "")
        setup = (f"{m.engine}, {m.hardware} {shape}, {m.model}, "
                 + (f"prefill {m.batch}x{m.prompt}" if m.kind == "prefill_tok_s"
                    else f"batch {m.batch}, {m.prompt} in / {m.output} out"))
        rows.append(Row(setup=setup, kind=m.kind, unit=unit, published=m.published, predicted=value,
                        ratio=seconds / measured_seconds(m), bound=bound, comm_share=comm / seconds,
                        engine=m.engine, hardware=m.hardware, tp=m.tp, model=m.model, batch=m.batch,
                        prompt=m.prompt, output=m.output, conditions=m.conditions, source=m.source))
    return Report(benchmark="calibration", rows=rows,
                  within_20pct=sum(0.8 <= r.ratio <= 1.2 for r in rows),
                  within_25pct=sum(0.75 <= r.ratio <= 1.25 for r in rows))


def render(report: Report) -> str:
    head = ("cost model vs published measurements (ratio = predicted time / measured time)\n"
            f"{report.within_20pct} of {len(report.rows)} rows within +-20 %, "
            f"{report.within_25pct} within +-25 %\n")
    sources = {s: i + 1 for i, s in enumerate(dict.fromkeys(r.source for r in report.rows))}
    table = format_table(
        ["setup", "metric", "published", "predicted", "ratio", "bound", "comm", "src"],
        [(r.setup, r.unit, r.published, r.predicted, r.ratio, r.bound, f"{r.comm_share:.0%}",
          f"[{sources[r.source]}]")
         for r in report.rows])
    notes = "\n".join(f"[{i}] {s}" for s, i in sources.items())
    return f"{head}{table}\n\nsources:\n{notes}"


def main(argv: Sequence[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.calibration", description=__doc__.split("\n")[0])
    add_output_args(parser)
    args = parser.parse_args(argv)
    report = run()
    emit(report, args.json, render(report))
    return report


if __name__ == "__main__":
    main()
