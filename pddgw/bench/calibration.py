"""Cost-model calibration: the roofline step time against published LLM-serving measurements.

`python -m pddgw.bench.calibration [--json]`

Each row is one number a public source measured (engine, GPU, tensor
parallelism, model, batch, prompt and output lengths as the source states
them) next to what `pddgw.sim.roofline.step_cost` predicts for the same
work with the `pddgw.sim.profiles` hardware profiles.  A measurement is
replayed step by step: one prefill step of all prompts, then output - 1
decode steps of the whole batch with the context growing by one token each.
What is compared depends on what the source reports:

  prefill_tok_s  prompt tokens / prefill step (time to first token)
  decode_ms      mean decode step (inter-token latency)
  latency_ms     prefill + all decode steps (end-to-end request latency)
  user_tok_s     output tokens / (prefill + all decode steps), one stream

`ratio` is predicted time / measured time for every kind: > 1 means the
model is slower than the measurement, < 1 faster.  Nothing is timed here;
the output is deterministic.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pddgw.bench.common import add_output_args, emit, format_table
from pddgw.sim import profiles
from pddgw.sim.roofline import Parallel, SeqWork, step_cost

Kind = Literal["prefill_tok_s", "decode_ms", "latency_ms", "user_tok_s"]
UNITS: dict[str, str] = {"prefill_tok_s": "prefill tok/s", "decode_ms": "decode ms/step",
                         "latency_ms": "request ms", "user_tok_s": "tok/s (1 user)"}

GPT_FAST = ("https://github.com/pytorch-labs/gpt-fast/blob/0f925b5d4ce457b89a7ca6c9ce50f42bf2576945/README.md "
            "(Tensor Parallelism table)")
LMDEPLOY = ("https://github.com/InternLM/lmdeploy/blob/3e391df4673326f79363eebe030876861a9b7090/"
            "docs/en/benchmark/a100_fp16.md (lmdeploy v0.1.0a1, static inference, llama2-70b)")
TRTLLM = ("https://github.com/NVIDIA/TensorRT-LLM/blob/138f96d45f90b9667426f7c47297d8c06bafac73/"
          "docs/source/performance.md (Low Latency, A100 FP16, data from v0.5)")
SPLITWISE = ("Splitwise (Patel et al., ISCA 2024) profiling data, precision not stated: "
             "https://github.com/Mutinifni/splitwise-sim/blob/378088013a54df6f2052c27ff5ae6ea7619c3ecc/"
             "data/perf_model.csv")
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

    @property
    def parallel(self) -> Parallel:
        return Parallel(tp=self.tp, dp=self.dp, ep=self.ep)

    def __post_init__(self) -> None:
        if self.kind != "prefill_tok_s" and self.output < 2:
            raise ValueError(f"a {self.kind} measurement needs output >= 2 (at least one decode step)")


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
    # ---- H200 SXM ----------------------------------------------------------------------
    Measurement("vLLM CI", "H200-SXM", 4, "llama3-70b", 8, 32, 128, "latency_ms", 2077.53,
                f"H200, Meta-Llama-3-70B-Instruct; {VLLM_TEST}", VLLM_CI + "9515"),
    Measurement("vLLM CI", "H200-SXM", 1, "llama3-8b", 8, 32, 128, "latency_ms", 833.421,
                f"H200, Meta-Llama-3-8B; {VLLM_TEST}", VLLM_CI + "9515"),
)


@dataclass(frozen=True, slots=True)
class Row:
    setup: str
    kind: str
    unit: str
    published: float
    predicted: float
    ratio: float           # predicted time / measured time
    bound: str             # what bounds the modeled steps: "compute", "memory" or both
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


def predict(m: Measurement) -> tuple[float, float, str]:
    """(predicted value in the unit of m.kind, predicted seconds, bound) for the measured work."""
    model, hw = profiles.model(m.model), profiles.hardware(m.hardware)
    par = m.parallel
    prefill = step_cost(model, hw, par, [SeqWork(m.prompt, 0)] * m.batch)
    # Decode step i (0-based) feeds output token i back in, on top of the prompt and the i earlier outputs.
    decodes = [step_cost(model, hw, par, [SeqWork(1, m.prompt + i)] * m.batch) for i in range(m.output - 1)]
    bound = "/".join(sorted({c.bound for c in ([prefill] if m.kind == "prefill_tok_s" else decodes)}))
    if m.kind == "prefill_tok_s":
        return m.batch * m.prompt / prefill.seconds, prefill.seconds, bound
    if m.kind == "decode_ms":
        s = statistics.fmean(c.seconds for c in decodes)
        return s * 1e3, s, bound
    total = prefill.seconds + sum(c.seconds for c in decodes)
    if m.kind == "latency_ms":
        return total * 1e3, total, bound
    return m.output / total, total, bound


def measured_seconds(m: Measurement) -> float:
    """The published number as seconds of the same span `predict` times."""
    if m.kind == "prefill_tok_s":
        return m.batch * m.prompt / m.published
    if m.kind == "user_tok_s":
        return m.output / m.published
    return m.published / 1e3


def run(measurements: Sequence[Measurement] = MEASUREMENTS) -> Report:
    rows = []
    for m in measurements:
        value, seconds, bound = predict(m)
        shape = f"TP{m.tp}" + (f"xDP{m.dp}" if m.dp > 1 else "") + (f" EP{m.ep}" if m.ep else "")
        setup = (f"{m.engine}, {m.hardware} {shape}, {m.model}, "
                 + (f"prefill {m.batch}x{m.prompt}" if m.kind == "prefill_tok_s"
                    else f"batch {m.batch}, {m.prompt} in / {m.output} out"))
        rows.append(Row(setup=setup, kind=m.kind, unit=UNITS[m.kind], published=m.published, predicted=value,
                        ratio=seconds / measured_seconds(m), bound=bound, engine=m.engine,
                        hardware=m.hardware, tp=m.tp, model=m.model, batch=m.batch, prompt=m.prompt,
                        output=m.output, conditions=m.conditions, source=m.source))
    return Report(benchmark="calibration", rows=rows,
                  within_20pct=sum(0.8 <= r.ratio <= 1.2 for r in rows))


def render(report: Report) -> str:
    head = ("cost model vs published measurements (ratio = predicted time / measured time)\n"
            f"{report.within_20pct} of {len(report.rows)} rows within +-20 %\n")
    sources = {s: i + 1 for i, s in enumerate(dict.fromkeys(r.source for r in report.rows))}
    table = format_table(
        ["setup", "metric", "published", "predicted", "ratio", "bound", "src"],
        [(r.setup, r.unit, r.published, r.predicted, r.ratio, r.bound, f"[{sources[r.source]}]")
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
