"""Batch invariance: do a request's greedy tokens depend on the path it takes through the engine?

`python -m pddgw.bench.invariance [--json] [--quick] [--dtypes D,D] [--prompts N]
    [--output-len L] [--threads N] [--device cpu|cuda]`

Invariant 1 of docs/architecture.md (same output, any path) holds exactly only where every
reduction is computed in the same order on every path.  On the tiny model
(`weights.build_tiny(0)`, TorchEngine, greedy, EOS ignored), per dtype, N seeded prompts run:

  alone    each request alone in a fresh engine: the reference
  batch    all N together plus fillers, every prefill in one step, decodes batched
  mixed    all N in one engine, one arriving per step
  extend   the reference's first g tokens given as `output_token_ids` (one extend), then on
  chunked  alone, prefilled a few tokens per chunk

Per path: the share of requests whose tokens differ from `alone`, the first divergence, and
the positions whose logits differ in any bit while contexts were equal.  Ops: how often a
row's result changes with batch composition (GEMMs: packed for AMX tiles in bfloat16 where the
CPU has them, else oneDNN, and plain `F.linear`; rms_norm, decode and extend attention).
Results: docs/results/benchmarks.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from pddgw.engines.weights import DTYPES, build_tiny
from pddgw.harness.engines import add_torch_args, chosen_settings, parse_torch_args, random_prompts
from pddgw.harness.invariance import Logits, OutputIds, op_differences, run_path
from pddgw.tables import add_output_args, emit, format_table, to_stderr

PATHS = ("batch", "mixed", "extend", "chunked")
SEED = 0
PRINTABLE = (32, 127)          # prompt ids: printable ASCII


@dataclass(frozen=True, slots=True)
class Settings:
    num_prompts: int
    output_len: int
    extend_tokens: int          # g: (a)'s first g tokens handed to the extend path
    filler: int                 # extra requests in the batch path
    chunk: int                  # max_num_batched_tokens of the chunked path
    prompt_lens: tuple[int, int]    # [min, max] prompt length
    dtypes: tuple[str, ...]
    op_trials: int

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.output_len < 2 or self.op_trials < 1:
            raise ValueError(f"need prompts >= 1, output_len >= 2, op_trials >= 1: {self}")
        if not 0 < self.extend_tokens < self.output_len:
            raise ValueError(f"extend_tokens must be in [1, output_len): {self}")
        if not 1 <= self.prompt_lens[0] <= self.prompt_lens[1] or self.chunk < 1:
            raise ValueError(f"bad prompt_lens or chunk: {self}")
        if unknown := set(self.dtypes) - set(DTYPES):
            raise ValueError(f"unknown dtypes {sorted(unknown)}")


# Outputs long enough for a bfloat16 KV rounding flip to reach an argmax (~1 minute on 1 core).
FULL = Settings(num_prompts=32, output_len=256, extend_tokens=128, filler=8, chunk=8,
                prompt_lens=(8, 80), dtypes=("bfloat16", "float32"), op_trials=40)
QUICK = Settings(num_prompts=4, output_len=12, extend_tokens=6, filler=3, chunk=4,
                 prompt_lens=(4, 24), dtypes=("bfloat16", "float32"), op_trials=8)


@dataclass(frozen=True, slots=True)
class PathResult:
    dtype: str
    path: str
    requests: int
    differing: int                      # requests whose tokens differ from alone's
    fraction: float
    first_divergence_mean: float | None     # output position, over the differing requests
    first_divergence_min: int | None
    logits_compared: int                # positions with equal contexts on both paths
    logits_differing: int               # of those, logits differing in any bit


@dataclass(frozen=True, slots=True)
class OpResult:
    dtype: str
    op: str
    trials: int
    differing: int                      # trials where some row's result differs in any bit
    fraction: float


@dataclass(frozen=True, slots=True)
class Report:
    benchmark: str
    model: str
    device: str
    threads: int
    settings: Settings
    paths: list[PathResult]
    ops: list[OpResult]


def first_divergence(a: OutputIds, b: OutputIds) -> int | None:
    """The first output position where a and b differ (one ending first counts), None: equal."""
    end = None if len(a) == len(b) else min(len(a), len(b))
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), end)


def compare(dtype: str, path: str, alone: list[OutputIds], other: list[OutputIds], ref_logits: Logits,
            logits: Logits, start: int) -> PathResult:
    divs = [first_divergence(a, b) for a, b in zip(alone, other)]
    hit = [d for d in divs if d is not None]
    # Positions from `start` whose contexts were equal: up to and including the first divergence.
    keys = [(i + 1, pos) for i, (a, d) in enumerate(zip(alone, divs))
            for pos in range(start, len(a) if d is None else d + 1)]
    keys = [k for k in keys if k in logits and k in ref_logits]
    return PathResult(dtype, path, len(alone), len(hit), len(hit) / len(alone),
                      sum(hit) / len(hit) if hit else None, min(hit, default=None),
                      len(keys), sum(logits[k] != ref_logits[k] for k in keys))


def measure_paths(dtype_name: str, s: Settings, device: str, progress: Callable[[str], None]) -> list[PathResult]:
    dtype = DTYPES[dtype_name]
    run = partial(run_path, model=build_tiny(0, dtype, device), dtype=dtype, device=device,
                  prompts=random_prompts(SEED, s.num_prompts, s.prompt_lens, PRINTABLE), output_len=s.output_len,
                  longest=s.prompt_lens[1] + s.output_len, extend_tokens=s.extend_tokens, chunk=s.chunk,
                  fillers=random_prompts(SEED + 1, s.filler, s.prompt_lens, PRINTABLE))
    alone, ref_logits = run("alone")
    out = []
    for name in PATHS:
        got, logits = run(name, alone=alone)
        start = s.extend_tokens if name == "extend" else 0
        out.append(compare(dtype_name, name, alone, got, ref_logits, logits, start))
        progress(f"{dtype_name} {name}: {out[-1].differing}/{s.num_prompts} requests differ")
    return out


def run_benchmark(s: Settings, device: str = "cpu", progress: Callable[[str], None] = lambda _m: None) -> Report:
    paths = [p for dt in s.dtypes for p in measure_paths(dt, s, device, progress)]
    op_results = [OpResult(dt, op, s.op_trials, c, c / s.op_trials) for dt in s.dtypes
                  for op, c in op_differences(DTYPES[dt], device, s.op_trials, SEED + 2).items()]
    return Report("invariance", "tiny (build_tiny(0))", device, torch.get_num_threads(), s, paths, op_results)


def render(r: Report) -> str:
    s = r.settings
    head = (f"batch invariance: greedy tokens of each path vs the request alone, model {r.model}, "
            f"device={r.device} threads={r.threads}\n"
            f"{s.num_prompts} prompts of {s.prompt_lens[0]}-{s.prompt_lens[1]} tokens, {s.output_len} "
            f"output tokens; extend after {s.extend_tokens}; batch + {s.filler} fillers; "
            f"chunks of {s.chunk}\n")
    paths = format_table(
        ["dtype", "path", "requests", "tokens differ", "fraction", "first div mean", "first div min",
         "logits differ"],
        [(p.dtype, p.path, p.requests, p.differing, f"{p.fraction:.3f}",
          None if p.first_divergence_mean is None else f"{p.first_divergence_mean:.1f}",
          p.first_divergence_min, f"{p.logits_differing}/{p.logits_compared}") for p in r.paths])
    ops = format_table(
        ["dtype", "op (row alone vs with others)", "trials", "differ", "fraction"],
        [(o.dtype, o.op, o.trials, o.differing, f"{o.fraction:.2f}") for o in r.ops])
    return head + paths + "\n\nreductions, bit comparisons\n" + ops


def main(argv: Sequence[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.invariance",
                                     description=__doc__.split("\n")[0])
    add_output_args(parser)
    parser.add_argument("--quick", action="store_true", help="few prompts and tokens (smoke test)")
    parser.add_argument("--dtypes", default="", help="comma-separated, default bfloat16,float32")
    parser.add_argument("--prompts", type=int, default=0, help="number of prompts")
    parser.add_argument("--output-len", type=int, default=0, help="output tokens per request")
    add_torch_args(parser)
    args = parse_torch_args(parser, argv, ("prompts", "output_len", "threads"))
    s = chosen_settings(args, QUICK, FULL, dtypes=tuple(d.strip() for d in args.dtypes.split(",") if d.strip()),
                        num_prompts=args.prompts, output_len=args.output_len, extend_tokens=args.output_len // 2)
    report = run_benchmark(s, args.device, progress=to_stderr)
    emit(report, args.json, render(report))
    return report


if __name__ == "__main__":
    main()
