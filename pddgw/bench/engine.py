"""Engine throughput: pddgw's TorchEngine against transformers' `generate`, same weights, one run.

`python -m pddgw.bench.engine [--json] [--quick] [--dtype D] [--threads N] [--repeats R]`

Procedure:
  1. Build a random Llama (GQA, 32000-token vocab) with transformers' own
     class from a fixed seed, weights scaled so the logits are well spread
     (greedy picks do not flip on float rounding), and save it as a
     safetensors checkpoint in a temporary directory.
  2. Load that one checkpoint twice: `pddgw.engines.weights.load_model` for
     the TorchEngine and `from_pretrained` for transformers (its default
     attention implementation, as a user gets it).
  3. Warm both up, then for each repeat run every case on both engines,
     alternating which goes first, and keep the best time of each:
       decode b=1, 8, 32  B equal-length prompts, N greedy output tokens each
                          (EOS ignored).  Decode time runs from the moment
                          every request has its first token (prefill done)
                          to the last token: B * (N - 1) tokens.
       prefill            B prompts of L tokens, one output token: time to
                          the first token, B * L prompt tokens.
     transformers' per-step times come from a stopping criterion that only
     records a timestamp.  Every pddgw run uses a fresh engine (the prefix
     cache would otherwise serve the repeated prompts) with room for the
     whole batch in one step and in the pool.
  4. Report tok/s of both, pddgw / transformers, and whether every request's
     greedy tokens were identical on both sides (`tokens_match`).

Prompts have equal lengths, so transformers' left padding is a no-op and
neither side computes wasted tokens.  `tokens_match` is expected in float32;
in bfloat16 the two round differently (pddgw's attention accumulates in
float32), so greedy picks may diverge there.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pddgw.bench.common import add_output_args, best, emit, format_table, ratio
from pddgw.config import EngineConfig
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest, SamplingParams
from pddgw.engines.weights import DTYPES, load_model

BLOCK_SIZE = 16
SEED = 0


@dataclass(frozen=True, slots=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads:
            raise ValueError(f"bad head layout: {self}")


@dataclass(frozen=True, slots=True)
class Settings:
    """What one benchmark run measures."""

    model: ModelShape
    decode_batches: tuple[int, ...]
    decode_prompt_len: int
    decode_output_len: int
    prefill_batch: int
    prefill_prompt_len: int
    repeats: int

    def __post_init__(self) -> None:
        if self.decode_output_len < 2:
            raise ValueError("decode_output_len must be >= 2 (decode = tokens after the first)")
        if min(self.decode_batches) < 1 or self.prefill_batch < 1 or self.repeats < 1:
            raise ValueError(f"batches and repeats must be >= 1: {self}")
        longest = max(self.decode_prompt_len + self.decode_output_len, self.prefill_prompt_len + 1)
        if longest > self.model.max_position_embeddings:
            raise ValueError(f"sequences of {longest} tokens exceed the model's context")


FULL = Settings(
    model=ModelShape(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=6,
                     num_heads=12, num_kv_heads=4),
    decode_batches=(1, 8, 32), decode_prompt_len=64, decode_output_len=32,
    prefill_batch=4, prefill_prompt_len=256, repeats=3)

QUICK = Settings(
    model=ModelShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=256),
    decode_batches=(1, 8, 32), decode_prompt_len=8, decode_output_len=4,
    prefill_batch=2, prefill_prompt_len=16, repeats=1)


@dataclass(frozen=True, slots=True)
class Case:
    kind: Literal["decode", "prefill"]
    batch: int
    prompt_len: int
    output_len: int

    @property
    def label(self) -> str:
        return f"{self.kind} b={self.batch}"

    @property
    def measured_tokens(self) -> int:
        if self.kind == "prefill":
            return self.batch * self.prompt_len
        return self.batch * (self.output_len - 1)


@dataclass(frozen=True, slots=True)
class Run:
    """One timed generation: seconds to the point every request had its first token, and to the end."""

    to_first: float
    total: float
    tokens: tuple[tuple[int, ...], ...]    # greedy output ids per request

    def seconds(self, kind: str) -> float:
        return self.to_first if kind == "prefill" else self.total - self.to_first


@dataclass(frozen=True, slots=True)
class Row:
    case: str
    kind: Literal["decode", "prefill"]
    batch: int
    prompt_len: int
    output_len: int
    measured_tokens: int
    pddgw_s: float
    transformers_s: float
    pddgw_tok_s: float
    transformers_tok_s: float
    ratio: float | None              # pddgw tok/s / transformers tok/s
    tokens_match: bool


@dataclass(frozen=True, slots=True)
class Report:
    benchmark: str
    dtype: str
    threads: int
    transformers_version: str
    transformers_attention: str
    settings: Settings
    rows: list[Row]


# ---- model ------------------------------------------------------------------------

def build_checkpoint(shape: ModelShape, directory: str) -> None:
    """A seeded random Llama saved by transformers (float32 safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                      intermediate_size=shape.intermediate_size,
                      num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                      num_key_value_heads=shape.num_kv_heads,
                      max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=None,
                      pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            elif name == "lm_head.weight":
                # Logit std ~4 over 32000 ids: top-1 vs top-2 gaps dwarf float32
                # differences between the two implementations.
                p.copy_(4.0 * r / p.shape[1] ** 0.5)
            else:
                p.copy_(r / p.shape[1] ** 0.5)
    model.save_pretrained(directory)


def make_prompts(batch: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + salt)
    # Skip the low ids (bos/pad/eos in most vocabularies).
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


# ---- the two sides ------------------------------------------------------------------

class PddgwSide:
    name = "pddgw"

    def __init__(self, model, dtype: torch.dtype):
        self.model = model
        self.dtype = dtype

    def run(self, prompts: list[list[int]], output_len: int) -> Run:
        batch, plen = len(prompts), len(prompts[0])
        blocks = batch * (-(-(plen + output_len) // BLOCK_SIZE)) + 1
        cfg = EngineConfig(block_size=BLOCK_SIZE, num_blocks=blocks, max_num_seqs=batch,
                           max_num_batched_tokens=max(batch * plen, batch))
        engine = TorchEngine(self.model, self.model.spec, cfg, self.dtype)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(batch)}
        gc.collect()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", tuple(p),
                                             SamplingParams(max_tokens=output_len, ignore_eos=True)))
        t_first = None
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
            if t_first is None and all(out.values()):
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        engine.check_integrity()
        tokens = tuple(tuple(out[f"r{i}"]) for i in range(batch))
        if t_first is None or any(len(t) != output_len for t in tokens):
            raise RuntimeError(f"pddgw generated {sorted({len(t) for t in tokens})} tokens per "
                               f"request, expected {output_len}")
        return Run(t_first - t0, t_end - t0, tokens)


class TransformersSide:
    name = "transformers"

    def __init__(self, model):
        self.model = model

    def run(self, prompts: list[list[int]], output_len: int) -> Run:
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class _Stamp(StoppingCriteria):
            """Records when each generation step finished; never stops anything."""

            def __call__(self, input_ids, scores, **kwargs):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        ids = torch.tensor(prompts, dtype=torch.int64)                 # [B, L]
        mask = torch.ones_like(ids)     # equal lengths: left padding is empty
        gc.collect()
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = self.model.generate(input_ids=ids, attention_mask=mask,
                                      max_new_tokens=output_len, min_new_tokens=output_len,
                                      do_sample=False, pad_token_id=0,
                                      stopping_criteria=StoppingCriteriaList([_Stamp()]))
        t_end = time.perf_counter()
        new = gen[:, ids.shape[1]:]                                    # [B, N]
        if new.shape[1] != output_len or len(stamps) != output_len:
            raise RuntimeError(f"transformers generated {new.shape[1]} tokens in {len(stamps)} "
                               f"steps, expected {output_len}")
        return Run(stamps[0] - t0, t_end - t0, tuple(tuple(r) for r in new.tolist()))


# ---- driver -------------------------------------------------------------------------

def cases(s: Settings) -> list[Case]:
    out = [Case("decode", b, s.decode_prompt_len, s.decode_output_len) for b in s.decode_batches]
    out.append(Case("prefill", s.prefill_batch, s.prefill_prompt_len, 1))
    return out


def measure(sides: Sequence, todo: Sequence[Case], prompts: Sequence[list[list[int]]],
            repeats: int, progress: Callable[[str], None]) -> list[Row]:
    times = {(c, side.name): [] for c in todo for side in sides}
    match = {c: True for c in todo}
    for rep in range(repeats):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for c, p in zip(todo, prompts):
            results = {}
            for side in order:
                r = side.run(p, c.output_len)
                times[(c, side.name)].append(r.seconds(c.kind))
                results[side.name] = r.tokens
            match[c] = match[c] and results["pddgw"] == results["transformers"]
            progress(f"repeat {rep + 1}/{repeats} {c.label}: " + ", ".join(
                f"{n} {times[(c, n)][-1] * 1e3:.0f} ms" for n in results))
    rows = []
    for c in todo:
        ours, theirs = best(times[(c, "pddgw")]), best(times[(c, "transformers")])
        ours_tps, theirs_tps = c.measured_tokens / ours, c.measured_tokens / theirs
        rows.append(Row(c.label, c.kind, c.batch, c.prompt_len, c.output_len, c.measured_tokens,
                        ours, theirs, ours_tps, theirs_tps, ratio(ours_tps, theirs_tps),
                        match[c]))
    return rows


def run_benchmark(settings: Settings, dtype_name: str,
                  progress: Callable[[str], None] = lambda _m: None) -> Report:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dtype = DTYPES[dtype_name]
    with tempfile.TemporaryDirectory(prefix="pddgw-bench-") as d:
        build_checkpoint(settings.model, d)
        ours, _tok = load_model(d, dtype, "cpu")
        theirs = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
    sides = (PddgwSide(ours, dtype), TransformersSide(theirs))
    todo = cases(settings)
    prompts = [make_prompts(c.batch, c.prompt_len, settings.model.vocab_size, i)
               for i, c in enumerate(todo)]
    warm = make_prompts(2, 8, settings.model.vocab_size, -1)
    for side in sides:
        side.run(warm, 3)
    rows = measure(sides, todo, prompts, settings.repeats, progress)
    return Report(benchmark="engine", dtype=dtype_name, threads=torch.get_num_threads(),
                  transformers_version=transformers.__version__,
                  transformers_attention=str(theirs.config._attn_implementation),
                  settings=settings, rows=rows)


def render(report: Report) -> str:
    m = report.settings.model
    head = (f"engine throughput: pddgw TorchEngine vs transformers {report.transformers_version} "
            f"generate ({report.transformers_attention}), same weights\n"
            f"model: llama vocab={m.vocab_size} hidden={m.hidden_size} layers={m.num_layers} "
            f"heads={m.num_heads}/{m.num_kv_heads} inter={m.intermediate_size}  "
            f"dtype={report.dtype} threads={report.threads} best of {report.settings.repeats}\n")
    table = format_table(
        ["case", "prompt", "output", "pddgw tok/s", "transformers tok/s", "ratio", "tokens_match"],
        [(r.case, r.prompt_len, r.output_len, r.pddgw_tok_s, r.transformers_tok_s, r.ratio,
          r.tokens_match) for r in report.rows])
    return head + table


def main(argv: Sequence[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.engine", description=__doc__.split("\n")[0])
    add_output_args(parser)
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths (smoke test)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    parser.add_argument("--repeats", type=int, default=0, help="runs per case, best kept")
    args = parser.parse_args(argv)
    if args.threads < 0 or args.repeats < 0:
        parser.error("--threads and --repeats must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = QUICK if args.quick else FULL
    if args.repeats:
        settings = dataclasses.replace(settings, repeats=args.repeats)
    report = run_benchmark(settings, args.dtype,
                           progress=lambda m: print(m, file=sys.stderr, flush=True))
    emit(report, args.json, render(report))
    return report


if __name__ == "__main__":
    main()
