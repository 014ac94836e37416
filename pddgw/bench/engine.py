"""Engine throughput: pddgw's TorchEngine against transformers' `generate` and vLLM, same weights, one run.

`python -m pddgw.bench.engine [--json] [--quick] [--dtype D] [--threads N] [--repeats R]
    [--device cpu|cuda] [--cuda-graphs on|off] [--vllm-python PATH] [--vllm-eager] [--no-breakdown]`

A random Llama checkpoint (logits spread so greedy picks do not flip on rounding) is loaded
by every side (`pddgw.harness.sides`); after a warm-up each repeat runs every case on every
side, alternating which goes first, and the median time counts.  Cases: greedy decode at
b=1/8/32 (decode time from every request's first token to the last), sampled decode at
b=8/32 (`ratio_greedy`), b=32 with penalties and a JSON-schema mask (`ratio_sampled`, pddgw
only), and prefill (time to the first token).

Reported: tok/s per side and the ratios, whether greedy tokens matched (`tokens_match`,
`vllm_tokens_match`; expected in float32 only), how many requests each two sides decoded alike
(`equal_requests`: in bfloat16, how far any two engines agree), and pddgw's per-step phases
(`sides.Breakdown`).  vLLM needs `--vllm-python` (or PDDGW_VLLM_PYTHON); without it the
report says why it is absent.  Results: docs/results/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pddgw.engines.model_spec import ModelSpec, llama_spec
from pddgw.harness.engines import add_torch_args, chosen_settings, parse_torch_args
from pddgw.harness.sides import Breakdown, Case, Sampling, Variant, case_prompts, started, time_cases
from pddgw.tables import add_output_args, emit, format_table, ratio, to_stderr

VARIANTS: tuple[Variant, ...] = ("penalties", "json_schema")


@dataclass(frozen=True, slots=True)
class Settings:
    model: ModelSpec                 # a plain Llama (`llama_spec`): what `build_checkpoint` writes
    decode_batches: tuple[int, ...]
    decode_prompt_len: int
    decode_output_len: int
    prefill_batch: int
    prefill_prompt_len: int
    repeats: int
    sampled_batches: tuple[int, ...] = (8, 32)     # decode batches also run sampled
    sampling: Sampling = Sampling()
    variant_batches: tuple[int, ...] = (32,)       # sampled batches also run with each of VARIANTS

    def __post_init__(self) -> None:
        if self.decode_output_len < 2 or min(self.decode_batches + (self.prefill_batch, self.repeats)) < 1:
            raise ValueError(f"need decode_output_len >= 2 (decode = tokens after the first), batches and "
                             f"repeats >= 1: {self}")
        if not set(self.sampled_batches) <= set(self.decode_batches):
            raise ValueError(f"sampled_batches {self.sampled_batches} must be decode batches")
        if not set(self.variant_batches) <= set(self.sampled_batches):
            raise ValueError(f"variant_batches {self.variant_batches} must be sampled batches")
        longest = max(self.decode_prompt_len + self.decode_output_len, self.prefill_prompt_len + 1)
        if longest > self.model.max_position_embeddings:
            raise ValueError(f"sequences of {longest} tokens exceed the model's context")


FULL = Settings(
    model=llama_spec(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=6,
                     num_heads=12, num_kv_heads=4, bos_token_id=1),
    decode_batches=(1, 8, 32), decode_prompt_len=64, decode_output_len=32,
    prefill_batch=4, prefill_prompt_len=256, repeats=3)

QUICK = Settings(
    # head_dim 32: the smallest vLLM's CPU attention supports.
    model=llama_spec(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=2, num_kv_heads=1, max_position_embeddings=256, bos_token_id=1),
    decode_batches=(1, 8, 32), decode_prompt_len=8, decode_output_len=4,
    prefill_batch=2, prefill_prompt_len=16, repeats=1)


@dataclass(frozen=True, slots=True)
class Row:
    case: str
    kind: Literal["decode", "prefill"]
    batch: int
    prompt_len: int
    output_len: int
    measured_tokens: int
    pddgw_s: float
    transformers_s: float | None     # None: a variant row (pddgw only)
    pddgw_tok_s: float
    transformers_tok_s: float | None
    ratio: float | None              # pddgw tok/s / transformers tok/s
    tokens_match: bool | None        # pddgw's greedy tokens == transformers'; None: sampled
    sampling: str = "greedy"         # or "temperature=T top_p=P seed=S+i"
    ratio_greedy: float | None = None
    variant: Variant | None = None
    ratio_sampled: float | None = None
    vllm_s: float | None = None
    vllm_tok_s: float | None = None
    ratio_vllm: float | None = None  # pddgw tok/s / vLLM tok/s
    vllm_tokens_match: bool | None = None
    equal_requests: dict[str, int] | None = None   # greedy: `equal_requests`; None: sampled
    breakdown: Breakdown | None = None


@dataclass(frozen=True, slots=True)
class Report:
    benchmark: str
    dtype: str
    threads: int
    transformers_version: str
    transformers_attention: str
    settings: Settings
    rows: list[Row]
    device: str = "cpu"
    cuda_graphs: str = "default"     # "on"/"off" as passed, or why it was not
    vllm: str = ""                   # "vLLM 0.x (torch y), N threads" or "not available (why)"
    vllm_version: str | None = None


def cases(s: Settings) -> list[Case]:
    """Every decode batch, each sampled one right after its greedy twin and its variants right
    after it, then prefill."""
    out = []
    for b in s.decode_batches:
        out.append(decode := Case("decode", b, s.decode_prompt_len, s.decode_output_len))
        if b in s.sampled_batches:
            out.append(dataclasses.replace(decode, sampling=s.sampling))
        if b in s.variant_batches:
            out += [dataclasses.replace(decode, sampling=s.sampling, variant=v) for v in VARIANTS]
    return out + [Case("prefill", s.prefill_batch, s.prefill_prompt_len, 1)]


SIDES = ("pddgw", "transformers", "vllm")


def equal_requests(outputs: dict[str, list[tuple[tuple[int, ...], ...]]]) -> dict[str, int]:
    """Output ids per side, one batch per repeat -> for each pair of sides ("pddgw=vllm"), how many
    of the batch's requests had the same ids to the end in every repeat."""
    out = {}
    for a, b in itertools.combinations([n for n in SIDES if n in outputs], 2):
        runs = list(zip(outputs[a], outputs[b]))
        out[f"{a}={b}"] = sum(all(x[r] == y[r] for x, y in runs) for r in range(len(runs[0][0])))
    return out


def measure(sides: Sequence, todo: Sequence[Case], prompts: Sequence[list[list[int]]], repeats: int,
            progress: Callable[[str], None], breakdown: bool = False) -> list[Row]:
    """A row per case from `time_cases` ("pddgw" and "transformers" sides required, "vllm" optional)."""
    s_of, tokens = time_cases(sides, todo, prompts, repeats, progress)
    ours_side = next(side for side in sides if side.name == "pddgw")
    tps = {(c, n): c.measured_tokens / s for (c, n), s in s_of.items()}
    greedy = {c.prompt_key: tps[(c, "pddgw")] for c in todo if c.sampling is None}
    plain = {c.prompt_key: tps[(c, "pddgw")] for c in todo if c.sampling is not None and c.variant is None}
    rows = []
    for c, p in zip(todo, prompts):
        ours, s = tps[(c, "pddgw")], c.sampling

        equal = None if s is not None else equal_requests({n: tokens[(c, n)] for n in SIDES if (c, n) in tokens})

        def matched(name: str) -> bool | None:       # every request equal to pddgw's, every repeat
            pair = f"pddgw={name}"
            return None if equal is None or pair not in equal else equal[pair] == c.batch  # noqa: B023

        rows.append(Row(
            c.label, c.kind, c.batch, c.prompt_len, c.output_len, c.measured_tokens, s_of[(c, "pddgw")],
            s_of.get((c, "transformers")), ours, tps.get((c, "transformers")),
            ratio(ours, tps.get((c, "transformers"))), matched("transformers"),
            sampling="greedy" if s is None else f"temperature={s.temperature} top_p={s.top_p} seed={s.seed}+i",
            ratio_greedy=None if s is None else ratio(ours, greedy.get(c.prompt_key)), variant=c.variant,
            ratio_sampled=None if c.variant is None else ratio(ours, plain.get(c.prompt_key)),
            vllm_s=s_of.get((c, "vllm")), vllm_tok_s=tps.get((c, "vllm")),
            ratio_vllm=ratio(ours, tps.get((c, "vllm"))), vllm_tokens_match=matched("vllm"),
            equal_requests=equal,
            breakdown=ours_side.breakdown(p, c.output_len, c.kind, s, c.variant) if breakdown else None))
    return rows


def run_benchmark(settings: Settings, dtype_name: str, progress: Callable[[str], None] = lambda _m: None, *,
                  device: str = "cpu", cuda_graphs: str | None = None, vllm_python: str | None = None,
                  vllm_eager: bool = False, breakdown: bool = True) -> Report:
    todo = cases(settings)
    with started(settings.model, dtype_name, device, cuda_graphs, todo, vllm_python, vllm_eager, progress) as (
            sides, about):
        rows = measure(sides, todo, case_prompts(todo, settings.model.vocab_size), settings.repeats, progress,
                       breakdown=breakdown)
    return Report(benchmark="engine", dtype=dtype_name, threads=torch.get_num_threads(), settings=settings,
                  rows=rows, device=device, **about)


def render(report: Report) -> str:
    m, s = report.settings.model, report.settings.sampling
    head = (f"engine throughput: pddgw TorchEngine vs transformers {report.transformers_version} "
            f"generate ({report.transformers_attention}) vs vLLM, same weights\n"
            f"model: llama vocab={m.vocab_size} hidden={m.hidden_size} layers={m.num_layers} "
            f"heads={m.num_heads}/{m.num_kv_heads} inter={m.intermediate_size}  "
            f"dtype={report.dtype} device={report.device} threads={report.threads} "
            f"median of {report.settings.repeats}  cuda_graphs={report.cuda_graphs}\n"
            f"vLLM: {report.vllm}\n")
    table = format_table(
        ["case", "prompt", "output", "pddgw tok/s", "transformers tok/s", "vllm tok/s",
         "pddgw/tf", "pddgw/vllm", "sampled/greedy", "/sampled", "tokens_match", "vllm_match"],
        [(r.case, r.prompt_len, r.output_len, r.pddgw_tok_s, r.transformers_tok_s, r.vllm_tok_s,
          r.ratio, r.ratio_vllm, r.ratio_greedy, r.ratio_sampled, r.tokens_match, r.vllm_tokens_match)
         for r in report.rows])
    out = head + table + (f"\nsampled: temperature {s.temperature}, top_p {s.top_p}, no top-k, request i "
                          f"seeded {s.seed}+i; sampled/greedy = pddgw tok/s over its greedy row's; "
                          f"tokens_match '-': transformers samples with its own RNG; no vLLM "
                          f"(greedy only); +penalties: repetition 1.1, presence 0.5, frequency 0.5; "
                          f"+json_schema: a JSON-schema mask; /sampled = pddgw tok/s over the plain "
                          f"sampled row's (pddgw only)")
    pairs = [k for k in (f"{a}={b}" for a, b in itertools.combinations(SIDES, 2))
             if any(r.equal_requests and k in r.equal_requests for r in report.rows)]
    out += "\n\ngreedy requests with the same tokens to the end, of the batch, every repeat\n"
    out += format_table(["case", *pairs], [(r.case, *(f"{r.equal_requests[k]}/{r.batch}" for k in pairs))
                                           for r in report.rows if r.equal_requests])
    if any(r.breakdown for r in report.rows):
        out += "\n\npddgw per step, ms (decode: steps after the first token; prefill: its step)\n"
        out += format_table(
            ["case", "steps", "step", "sched/bookkeeping", "pack", "attention", "model other", "sampling"],
            [(r.case, *dataclasses.astuple(r.breakdown)) for r in report.rows if r.breakdown])
    return out


def main(argv: Sequence[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.engine", description=__doc__.split("\n")[0])
    add_output_args(parser)
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths (smoke test)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    add_torch_args(parser, "cpu or cuda[:N] for pddgw and transformers (vLLM runs its own build)")
    parser.add_argument("--repeats", type=int, default=0, help="runs per case, the median kept")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default=None,
                        help="EngineConfig.cuda_graphs, where the engine has that field")
    parser.add_argument("--vllm-python", default=os.environ.get("PDDGW_VLLM_PYTHON") or None,
                        help="python of a vLLM venv (scripts/make_vllm_env.sh); "
                             "default: env PDDGW_VLLM_PYTHON, else no vLLM column")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM with enforce_eager (no torch.compile at start-up)")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-step phase breakdown of pddgw")
    args = parse_torch_args(parser, argv, ("threads", "repeats"))
    report = run_benchmark(chosen_settings(args, QUICK, FULL, repeats=args.repeats), args.dtype,
                           progress=to_stderr, device=args.device, cuda_graphs=args.cuda_graphs,
                           vllm_python=args.vllm_python, vllm_eager=args.vllm_eager,
                           breakdown=not args.no_breakdown)
    emit(report, args.json, render(report))
    return report


if __name__ == "__main__":
    main()
