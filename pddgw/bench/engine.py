"""Engine throughput: pddgw's TorchEngine against transformers' `generate` and vLLM, same weights, one run.

`python -m pddgw.bench.engine [--json] [--quick] [--dtype D] [--threads N] [--repeats R]
    [--device cpu|cuda] [--cuda-graphs on|off] [--vllm-python PATH] [--vllm-eager] [--no-breakdown]`

A random Llama (GQA, 32000-token vocab, logits well spread so greedy picks
do not flip on float rounding) is saved once as a safetensors checkpoint and
loaded by every side (`pddgw.harness.sides`: a fresh pddgw engine per run
with room for the whole batch in one step; transformers' `from_pretrained`
with its default attention, timed by a stopping criterion; vLLM, below).
After a warm-up, each repeat runs every case on every side, alternating
which goes first; the best time of each counts:

  decode b=1, 8, 32   B equal-length prompts, N greedy tokens each (EOS
                      ignored); decode time runs from the moment every
                      request has its first token to the last: B * (N - 1).
  decode b=8, 32      the same prompts sampled (temperature 0.8, top-p 0.95,
    sampled           no top-k, request i seeded SEED + i), right after the
                      greedy case: `ratio_greedy` = sampled / greedy pddgw
                      tok/s.  transformers samples with its own RNG
                      (`tokens_match` None); vLLM runs greedy only.
  decode b=32         pddgw only, right after the plain sampled case on its
    +penalties,       prompts: repetition 1.1, presence 0.5, frequency 0.5;
    +json_schema      a JSON-schema mask (`json_schema()`: no output can end
                      the object before N tokens; a byte tokenizer and its
                      EOS for the matcher).  `ratio_sampled` = tok/s over the
                      plain sampled row's.
  prefill             B prompts of L tokens, one output token: time to the
                      first token, B * L prompt tokens.

Reported: tok/s of each side, pddgw / transformers and pddgw / vLLM, whether
every request's greedy tokens were identical (`tokens_match`,
`vllm_tokens_match`; expected in float32, in bfloat16 the sides round
differently), and pddgw's per-step phases from one more run per case
(scheduling = `step` minus `_forward`, packing = `_forward` minus the model
and the sampler, attention = every `paged_attention` call, the rest of the
model, sampling; ms per decode step, or of the prefill step).

vLLM: `--vllm-python DIR/bin/python` (default: env PDDGW_VLLM_PYTHON), a
vLLM environment driven in a subprocess, one engine for every run (sized
for the largest batch, prefix caching off).  Without it the report says
"vLLM: not available (--vllm-python not given)", or why it failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pddgw.core.sampling import SamplingParams
from pddgw.engines.model_spec import ModelSpec, llama_spec
from pddgw.engines.weights import DTYPES, load_model
from pddgw.harness.engines import add_torch_args, parse_torch_args, random_prompts
from pddgw.harness.sides import (SEED, Breakdown, PddgwSide, TransformersSide, VllmSide,
                                 VllmUnavailable, build_checkpoint, request_params)
from pddgw.tables import add_output_args, best, emit, format_table, ratio, to_stderr


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampled decode cases' settings (no top-k: the top-p-only path of the sampler)."""

    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = SEED            # request i gets seed + i

    def params(self, i: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed + i)


def json_schema(min_chars: int) -> str:
    """The JSON-schema variant's grammar: a 3-field object whose first field is a string of at
    least `min_chars` characters (an output of fewer tokens cannot finish it)."""
    return json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "minLength": min_chars}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]})


@dataclass(frozen=True, slots=True)
class Variant:
    """A sampled decode case with more asked of the sampler (pddgw only)."""

    name: Literal["penalties", "json_schema"]

    def apply(self, params: SamplingParams) -> SamplingParams:
        if self.name == "penalties":
            return dataclasses.replace(params, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
        return dataclasses.replace(params, ignore_eos=False, grammar=("json_schema", json_schema(params.max_tokens)))


VARIANTS = (Variant("penalties"), Variant("json_schema"))


@dataclass(frozen=True, slots=True)
class Settings:
    """What one benchmark run measures."""

    model: ModelSpec                 # a plain Llama (`llama_spec`): what `build_checkpoint` writes
    decode_batches: tuple[int, ...]
    decode_prompt_len: int
    decode_output_len: int
    prefill_batch: int
    prefill_prompt_len: int
    repeats: int
    sampled_batches: tuple[int, ...] = (8, 32)     # decode batches also run sampled (each a decode batch)
    sampling: Sampling = Sampling()
    variant_batches: tuple[int, ...] = (32,)       # sampled batches also run with each of VARIANTS

    def __post_init__(self) -> None:
        if self.decode_output_len < 2:
            raise ValueError("decode_output_len must be >= 2 (decode = tokens after the first)")
        if min(self.decode_batches) < 1 or self.prefill_batch < 1 or self.repeats < 1:
            raise ValueError(f"batches and repeats must be >= 1: {self}")
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
class Case:
    kind: Literal["decode", "prefill"]
    batch: int
    prompt_len: int
    output_len: int
    sampling: Sampling | None = None     # None: greedy
    variant: Variant | None = None       # sampled cases only: penalties / a grammar on top

    @property
    def label(self) -> str:
        return (f"{self.kind} b={self.batch}" + (" sampled" if self.sampling else "")
                + (f" +{self.variant.name}" if self.variant else ""))

    @property
    def prompt_key(self) -> tuple[str, int, int]:
        """Cases with the same key get the same prompts (a sampled case its greedy twin's)."""
        return self.kind, self.batch, self.prompt_len

    def params(self, i: int) -> SamplingParams:
        """Request i's sampling."""
        return request_params(i, self.output_len, self.sampling, self.variant)

    @property
    def measured_tokens(self) -> int:
        return self.batch * (self.prompt_len if self.kind == "prefill" else self.output_len - 1)


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
    ratio_greedy: float | None = None    # sampled rows: pddgw tok/s / pddgw's greedy tok/s, same batch
    variant: str | None = None           # "penalties" / "json_schema" (Variant), None: plain
    ratio_sampled: float | None = None   # variant rows: pddgw tok/s / the plain sampled row's, same batch
    vllm_s: float | None = None
    vllm_tok_s: float | None = None
    ratio_vllm: float | None = None  # pddgw tok/s / vLLM tok/s
    vllm_tokens_match: bool | None = None
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


def make_prompts(batch: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    # Skip the low ids (bos/pad/eos in most vocabularies).
    return random_prompts(1000 + salt, batch, length, (3, vocab))


def cases(s: Settings) -> list[Case]:
    """Every decode batch, each sampled one right after its greedy twin and its variants right
    after it, then prefill."""
    out = []
    for b in s.decode_batches:
        decode = Case("decode", b, s.decode_prompt_len, s.decode_output_len)
        out.append(decode)
        if b in s.sampled_batches:
            out.append(dataclasses.replace(decode, sampling=s.sampling))
        if b in s.variant_batches:
            out += [dataclasses.replace(decode, sampling=s.sampling, variant=v) for v in VARIANTS]
    return out + [Case("prefill", s.prefill_batch, s.prefill_prompt_len, 1)]


def case_prompts(todo: Sequence[Case], vocab: int) -> list[list[list[int]]]:
    """Prompts per case: one set per `prompt_key`, salted by its order (greedy cases as before)."""
    salts: dict[tuple[str, int, int], int] = {}
    for c in todo:
        salts.setdefault(c.prompt_key, len(salts))
    return [make_prompts(c.batch, c.prompt_len, vocab, salts[c.prompt_key]) for c in todo]


def measure(sides: Sequence, todo: Sequence[Case], prompts: Sequence[list[list[int]]],
            repeats: int, progress: Callable[[str], None],
            breakdown: bool = False) -> list[Row]:
    """Interleaved runs of every side ("pddgw" and "transformers" required, "vllm" optional; a
    side without `samples` sits out the sampled cases, one without `variants` the variant ones)."""
    times: dict[tuple[Case, str], list[float]] = {(c, side.name): [] for c in todo for side in sides}
    differ: set[tuple[Case, str]] = set()      # (case, side) whose tokens were not pddgw's in a repeat
    for rep in range(repeats):
        for c, p in zip(todo, prompts):
            got = {}
            for side in (sides if rep % 2 == 0 else sides[::-1]):
                if c.sampling is not None and not getattr(side, "samples", True):
                    continue
                if c.variant is not None and not getattr(side, "variants", False):
                    continue
                extra = {"variant": c.variant} if c.variant else {}   # only variant sides take one
                r = side.run(p, c.output_len, sampling=c.sampling, **extra)
                times[(c, side.name)].append(r.seconds(c.kind))
                got[side.name] = r.tokens
            differ |= {(c, n) for n, tokens in got.items() if tokens != got["pddgw"]}
            progress(f"repeat {rep + 1}/{repeats} {c.label}: " + ", ".join(
                f"{n} {t[-1] * 1e3:.0f} ms" for (case, n), t in times.items() if case == c and t))
    ours_side = next(side for side in sides if side.name == "pddgw")
    s_of = {(c, n): best(t) for (c, n), t in times.items() if t}
    tps = {(c, n): c.measured_tokens / s for (c, n), s in s_of.items()}
    greedy = {c.prompt_key: tps[(c, "pddgw")] for c in todo if c.sampling is None}
    plain = {c.prompt_key: tps[(c, "pddgw")] for c in todo if c.sampling is not None and c.variant is None}
    rows = []
    for c, p in zip(todo, prompts):
        ours, s = tps[(c, "pddgw")], c.sampling

        def matched(name: str) -> bool | None:
            return None if s is not None or (c, name) not in s_of else (c, name) not in differ

        rows.append(Row(
            c.label, c.kind, c.batch, c.prompt_len, c.output_len, c.measured_tokens, s_of[(c, "pddgw")],
            s_of.get((c, "transformers")), ours, tps.get((c, "transformers")),
            ratio(ours, tps.get((c, "transformers"))), matched("transformers"),
            sampling="greedy" if s is None else f"temperature={s.temperature} top_p={s.top_p} seed={s.seed}+i",
            ratio_greedy=None if s is None else ratio(ours, greedy.get(c.prompt_key)),
            variant=None if c.variant is None else c.variant.name,
            ratio_sampled=None if c.variant is None else ratio(ours, plain.get(c.prompt_key)),
            vllm_s=s_of.get((c, "vllm")), vllm_tok_s=tps.get((c, "vllm")),
            ratio_vllm=ratio(ours, tps.get((c, "vllm"))), vllm_tokens_match=matched("vllm"),
            breakdown=ours_side.breakdown(p, c.output_len, c.kind, s, c.variant) if breakdown else None))
    return rows


def _engine_overrides(cuda_graphs: str | None, device: str) -> tuple[dict, str]:
    """EngineConfig fields for --cuda-graphs, and what the report says about it."""
    if cuda_graphs is None:
        return {}, "default"
    if cuda_graphs == "on" and not device.startswith("cuda"):
        return {}, f"on ignored: CUDA graphs need a CUDA device, not {device!r}"
    return {"cuda_graphs": cuda_graphs == "on"}, cuda_graphs


def run_benchmark(settings: Settings, dtype_name: str,
                  progress: Callable[[str], None] = lambda _m: None, *,
                  device: str = "cpu", cuda_graphs: str | None = None,
                  vllm_python: str | None = None, vllm_eager: bool = False,
                  breakdown: bool = True) -> Report:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dtype = DTYPES[dtype_name]
    overrides, graphs_note = _engine_overrides(cuda_graphs, device)
    todo = cases(settings)
    threads = torch.get_num_threads()
    vllm: VllmSide | None = None
    vllm_note = "not available (--vllm-python not given)"

    def unavailable(e: VllmUnavailable) -> str:
        progress(f"vLLM: not available: {e}")
        return f"not available ({str(e).splitlines()[0]})"

    with tempfile.TemporaryDirectory(prefix="pddgw-bench-") as d:
        build_checkpoint(settings.model, d)
        ours, _tok = load_model(d, dtype, device)
        theirs = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()
        if vllm_python:
            progress(f"starting vLLM ({vllm_python}) ...")
            longest = settings.model.max_position_embeddings
            try:
                vllm = VllmSide(vllm_python, d, dtype_name, threads, longest, max(c.batch for c in todo),
                                max(max(c.batch * c.prompt_len for c in todo), longest),
                                enforce_eager=vllm_eager)
                vllm_note = (f"vLLM {vllm.info['vllm_version']} (torch {vllm.info['torch_version']}), "
                             f"OMP_NUM_THREADS={vllm.info['omp_threads']} "
                             f"VLLM_CPU_OMP_THREADS_BIND={vllm.info['threads_bind']}, "
                             f"{'eager' if vllm_eager else 'compiled'}")
            except VllmUnavailable as e:
                vllm_note = unavailable(e)
    sides: list = [PddgwSide(ours, dtype, device, overrides), TransformersSide(theirs, device)]
    warm = make_prompts(2, 8, settings.model.vocab_size, -1)
    try:
        for side in sides:
            side.run(warm, 3)
        if vllm is not None:
            try:
                vllm.run(warm, 3)
                sides.append(vllm)
            except VllmUnavailable as e:     # started, but cannot run this model
                vllm_note = unavailable(e)
                vllm.close()
                vllm = None
        rows = measure(sides, todo, case_prompts(todo, settings.model.vocab_size), settings.repeats, progress,
                       breakdown=breakdown)
    finally:
        if vllm is not None:
            vllm.close()
    return Report(benchmark="engine", dtype=dtype_name, threads=threads,
                  transformers_version=transformers.__version__,
                  transformers_attention=str(theirs.config._attn_implementation),
                  settings=settings, rows=rows, device=device, cuda_graphs=graphs_note, vllm=vllm_note,
                  vllm_version=None if vllm is None else vllm.info["vllm_version"])


def render(report: Report) -> str:
    m, s = report.settings.model, report.settings.sampling
    head = (f"engine throughput: pddgw TorchEngine vs transformers {report.transformers_version} "
            f"generate ({report.transformers_attention}) vs vLLM, same weights\n"
            f"model: llama vocab={m.vocab_size} hidden={m.hidden_size} layers={m.num_layers} "
            f"heads={m.num_heads}/{m.num_kv_heads} inter={m.intermediate_size}  "
            f"dtype={report.dtype} device={report.device} threads={report.threads} "
            f"best of {report.settings.repeats}  cuda_graphs={report.cuda_graphs}\n"
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
    if any(r.breakdown for r in report.rows):
        out += "\n\npddgw per step, ms (decode: steps after the first token; prefill: its step)\n"
        out += format_table(
            ["case", "steps", "step", "sched/bookkeeping", "pack", "attention", "model other", "sampling"],
            [(r.case, b.steps, b.step_ms, b.scheduling_ms, b.pack_ms, b.attention_ms, b.model_other_ms,
              b.sampling_ms) for r in report.rows if (b := r.breakdown) is not None])
    return out


def main(argv: Sequence[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.engine", description=__doc__.split("\n")[0])
    add_output_args(parser)
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths (smoke test)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    add_torch_args(parser, "cpu or cuda[:N] for pddgw and transformers (vLLM runs its own build)")
    parser.add_argument("--repeats", type=int, default=0, help="runs per case, best kept")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default=None,
                        help="EngineConfig.cuda_graphs, where the engine has that field")
    parser.add_argument("--vllm-python", default=os.environ.get("PDDGW_VLLM_PYTHON") or None,
                        help="python of a vLLM venv (scripts/make_vllm_env.sh); "
                             "default: env PDDGW_VLLM_PYTHON, else no vLLM column")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM with enforce_eager (no torch.compile at start-up)")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip the per-step phase breakdown of pddgw")
    args = parse_torch_args(parser, argv, ("threads", "repeats"))
    settings = QUICK if args.quick else FULL
    if args.repeats:
        settings = dataclasses.replace(settings, repeats=args.repeats)
    report = run_benchmark(settings, args.dtype, progress=to_stderr, device=args.device,
                           cuda_graphs=args.cuda_graphs, vllm_python=args.vllm_python,
                           vllm_eager=args.vllm_eager, breakdown=not args.no_breakdown)
    emit(report, args.json, render(report))
    return report


if __name__ == "__main__":
    main()
