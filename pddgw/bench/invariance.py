"""Batch invariance: do a request's greedy tokens depend on the path it takes through the engine?

`python -m pddgw.bench.invariance [--json] [--quick] [--dtypes D,D] [--prompts N]
    [--output-len L] [--threads N] [--device cpu|cuda]`

Invariant 1 of DESIGN.md (same output, any path) holds exactly only where
every reduction a token goes through is computed in the same order on every
path.  This bench measures how often that fails on the built-in tiny model
(`weights.build_tiny(0)`, TorchEngine, greedy, EOS ignored), per dtype:

  1. N seeded prompts of printable ASCII ids, lengths spread over a range.
  2. Paths, each compared with (a) token by token:
       alone    (a) each request alone in a fresh engine: the reference.
       batch    (b) all N together, plus filler requests, in one engine:
                    every prefill in one step, every decode step batched.
       mixed        all N in one engine, one arriving per step: prefills
                    share steps with the others' decodes.
       extend   (c) fresh engine per request; (a)'s first g tokens given as
                    `EngineRequest.output_token_ids`, computed in one
                    extend (the token-ID handoff of P-MD / catch-up), then
                    decoding on from position g.
       chunked  (d) alone, with max_num_batched_tokens = a few tokens: the
                    prompt prefilled in chunks.
     Per path: the fraction of requests whose tokens differ from (a), the
     mean and min first divergence position (output position), and how
     many positions had logits differing in any bit from (a)'s while the
     contexts were still equal (up to and including the first divergence;
     logits are captured around `torch_engine.sample`, keyed by the
     request's seed, which greedy decoding ignores).
  3. Op diagnostics: which reductions give a row a different result by
     batch composition, each over random inputs in the model dtype (bit
     comparisons, fraction of trials that differ):
       linear oneDNN    the engine's prepacked GEMM (CPU): rows alone vs
                        inside a larger M
       linear F.linear  the unpacked GEMM (what CUDA and float64 run)
       rms_norm         rows alone vs in a batch
       decode attn      one sequence's decode alone vs batched with a longer
                        one (a wider block table: more masked keys)
       extend vs decode a token's attention inside a multi-token extend vs
                        the same token as a decode
       chunked extend   the last rows of an extend computed as their own
                        chunk vs inside the whole extend

What we found (CPU, 1 thread, 32 prompts x 256 tokens; rerun rather than
trust these lines): the engine's GEMMs (oneDNN-prepacked on the CPU, any
M), RMSNorm and the greedy sampler are row-invariant bit for bit (the
unpacked F.linear, on CUDA and in float64, is not in float32).  Decode
attention gathers whole blocks and always masks, so the batch and mixed
paths give bit-identical logits.  What remains is extend attention (paths c
and d): SDPA's result for a row depends on how many query rows share the
call, so float32 logits differ in the last bits and a rare bfloat16 rounding
flip can move a near-tie argmax tens of tokens later; exact would need a
batch-invariant attention kernel (as would cuBLAS / Triton GEMMs on CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from pddgw.core.sampling import SamplingParams
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest
from pddgw.engines.weights import DTYPES, build_tiny, tiny_spec
from pddgw.harness.engines import (BLOCK_SIZE, add_torch_args, drain, engine_config, parse_torch_args, patched,
                                   random_prompts)
from pddgw.tables import add_output_args, emit, format_table, to_stderr

PATHS = ("batch", "mixed", "extend", "chunked")
SEED = 0
PRINTABLE = (32, 127)          # prompt ids: printable ASCII
FILLER_SEED = 1 << 20          # filler requests' seeds (identify them; greedy ignores seeds)


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


# ---- generation on each path ------------------------------------------------------

OutputIds = list[int]                        # one request's output token ids
Logits = dict[tuple[int, int], bytes]         # (seed, output position) -> the row's bytes


def captured_logits(store: Logits) -> contextlib.AbstractContextManager[None]:
    """Record every sampled row's logits (keyed by seed and position) while the engine samples."""
    import pddgw.engines.torch_engine as engine_mod

    def recording(real: Callable) -> Callable:
        def sample(logits: torch.Tensor, params, positions):
            rows = logits.detach().to("cpu")
            for r, (p, pos) in enumerate(zip(params, positions)):
                store[(p.seed, pos)] = rows[r].numpy().tobytes()
            return real(logits, params, positions)
        return sample

    return patched(engine_mod, "sample", recording)


class Runner:
    """Fresh engines over one model; greedy requests whose seed names them (seed = index + 1)."""

    def __init__(self, model, dtype: torch.dtype, device: str, s: Settings):
        self.model, self.dtype, self.device, self.s = model, dtype, device, s

    def engine(self, max_num_seqs: int, max_num_batched_tokens: int = 0) -> TorchEngine:
        cfg = engine_config(max_num_seqs, self.s.prompt_lens[1] + self.s.output_len, self.device,
                            max_num_batched_tokens)
        return TorchEngine(self.model, self.model.spec, cfg, self.dtype)

    def request(self, rid: str, prompt: Sequence[int], seed: int, done: Sequence[int] = ()) -> EngineRequest:
        sp = SamplingParams(max_tokens=self.s.output_len, ignore_eos=True, seed=seed)
        return EngineRequest(rid, tuple(prompt), sp, output_token_ids=tuple(done))

    def alone(self, prompts: list[list[int]], logits: Logits) -> list[OutputIds]:
        with captured_logits(logits):
            return [self.one(p, i + 1) for i, p in enumerate(prompts)]

    def one(self, prompt: Sequence[int], seed: int, done: Sequence[int] = (), chunk: int = 0) -> OutputIds:
        """One request alone in a fresh engine (`done`: output ids already given; `chunk`: the
        engine's max_num_batched_tokens) -> its output ids after `done`."""
        e = self.engine(1, chunk)
        e.add_request(self.request("r", prompt, seed, done))
        return drain(e)["r"]

    def path(self, name: str, prompts: list[list[int]], alone: list[OutputIds],
             logits: Logits) -> list[OutputIds]:
        n, s = len(prompts), self.s
        reqs = [self.request(f"r{i}", p, i + 1) for i, p in enumerate(prompts)]
        with captured_logits(logits):
            if name == "extend":
                return [alone[i][:s.extend_tokens] + self.one(p, i + 1, alone[i][:s.extend_tokens])
                        for i, p in enumerate(prompts)]
            if name == "chunked":
                return [self.one(p, i + 1, chunk=s.chunk) for i, p in enumerate(prompts)]
            if name == "batch":
                fill = [self.request(f"f{j}", p, FILLER_SEED + j)
                        for j, p in enumerate(random_prompts(SEED + 1, s.filler, s.prompt_lens, PRINTABLE))]
                e = self.engine(n + s.filler)
                for r in [*reqs, *fill]:
                    e.add_request(r)
                got = drain(e)
            else:                                       # mixed: one arrival per step
                got = drain(self.engine(n), reqs)
            return [got[f"r{i}"] for i in range(n)]


def first_divergence(a: OutputIds, b: OutputIds) -> int | None:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(dtype: str, path: str, alone: list[OutputIds], other: list[OutputIds], ref_logits: Logits,
            logits: Logits, start: int) -> PathResult:
    divs = [first_divergence(a, b) for a, b in zip(alone, other)]
    hit = [d for d in divs if d is not None]
    compared = differing = 0
    for i, (a, d) in enumerate(zip(alone, divs)):
        last = len(a) - 1 if d is None else d          # contexts equal up to here
        for pos in range(start, last + 1):
            key = (i + 1, pos)
            if key in logits and key in ref_logits:
                compared += 1
                differing += logits[key] != ref_logits[key]
    return PathResult(dtype, path, len(alone), len(hit), len(hit) / len(alone),
                      sum(hit) / len(hit) if hit else None, min(hit) if hit else None,
                      compared, differing)


def measure_paths(dtype_name: str, s: Settings, device: str,
                  progress: Callable[[str], None]) -> list[PathResult]:
    dtype = DTYPES[dtype_name]
    runner = Runner(build_tiny(0, dtype, device), dtype, device, s)
    prompts = random_prompts(SEED, s.num_prompts, s.prompt_lens, PRINTABLE)
    ref_logits: Logits = {}
    alone = runner.alone(prompts, ref_logits)
    out = []
    for name in PATHS:
        logits: Logits = {}
        got = runner.path(name, prompts, alone, logits)
        start = s.extend_tokens if name == "extend" else 0
        out.append(compare(dtype_name, name, alone, got, ref_logits, logits, start))
        progress(f"{dtype_name} {name}: {out[-1].differing}/{len(prompts)} requests differ")
    return out


# ---- op diagnostics -------------------------------------------------------------------

def measure_ops(dtype_name: str, s: Settings, device: str) -> list[OpResult]:
    """Bit comparisons of one row's result alone vs with others, per op (module docstring, 3)."""
    from pddgw.engines.model import linear, pack_weight, rms_norm
    from pddgw.kernels import get_ops

    dtype = DTYPES[dtype_name]
    ops = get_ops("auto", device)
    spec = tiny_spec()
    hid, kvh, hd, heads = spec.hidden_size, spec.num_kv_heads, spec.head_dim, spec.num_heads
    g = torch.Generator().manual_seed(SEED + 2)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    counts = dict.fromkeys(("linear oneDNN", "linear F.linear", "rms_norm", "decode attn",
                            "extend vs decode", "chunked extend"), 0)
    trials = s.op_trials
    nb = 64
    kc, vc = rand(nb, BLOCK_SIZE, kvh, hd), rand(nb, BLOCK_SIZE, kvh, hd)
    scale = hd ** -0.5
    i32 = dict(dtype=torch.int32, device=device)

    def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
        return not torch.equal(a, b)

    for _ in range(trials):
        # GEMM and RMSNorm: rows [0, m) alone vs inside 32 rows.
        m = int(torch.randint(1, 32, (1,), generator=g))
        x, w = rand(32, hid), rand(3 * hid, hid, scale=hid ** -0.5)
        packed = pack_weight(w)
        if packed is not None:
            counts["linear oneDNN"] += differs(linear(x[:m], w, None, packed), linear(x, w, None, packed)[:m])
        counts["linear F.linear"] += differs(linear(x[:m], w, None, None), linear(x, w, None, None)[:m])
        nw = rand(hid, scale=0.1) + 1
        counts["rms_norm"] += differs(rms_norm(x[:m], nw, 1e-5), rms_norm(x, nw, 1e-5)[:m])
        # Attention over one sequence of length n in the paged cache.
        n = int(torch.randint(2, 12 * BLOCK_SIZE, (1,), generator=g))
        table = torch.randperm(nb, generator=g)[:12].to(**i32)                         # [12] blocks
        used = table[None, : -(-n // BLOCK_SIZE)]
        q = rand(1, heads, hd)
        alone = ops.paged_decode_attention(q, kc, vc, used, torch.tensor([n], **i32), scale)
        other = torch.randperm(nb, generator=g)[:12].to(**i32)
        both = ops.paged_decode_attention(torch.cat([q, rand(1, heads, hd)]), kc, vc,
                                          torch.stack([table, other]),
                                          torch.tensor([n, 12 * BLOCK_SIZE], **i32), scale)
        counts["decode attn"] += differs(alone, both[:1])
        t = min(n, 6)                                   # an extend of the last t tokens
        qe = torch.cat([rand(t - 1, heads, hd), q])
        ext = ops.extend_attention(qe, kc, vc, used, torch.tensor([0, t], **i32),
                                   torch.tensor([n], **i32), scale)
        counts["extend vs decode"] += differs(ext[-1:], alone)
        last2 = ops.extend_attention(qe[-2:], kc, vc, used, torch.tensor([0, 2], **i32),
                                     torch.tensor([n], **i32), scale)
        counts["chunked extend"] += differs(last2, ext[-2:])
    return [OpResult(dtype_name, op, trials, c, c / trials) for op, c in counts.items()]


# ---- driver ---------------------------------------------------------------------------

def run_benchmark(s: Settings, device: str = "cpu",
                  progress: Callable[[str], None] = lambda _m: None) -> Report:
    paths: list[PathResult] = []
    op_results: list[OpResult] = []
    for dt in s.dtypes:
        paths += measure_paths(dt, s, device, progress)
        op_results += measure_ops(dt, s, device)
    return Report("invariance", "tiny (build_tiny(0))", device, torch.get_num_threads(), s, paths, op_results)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


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
        [(p.dtype, p.path, p.requests, p.differing, f"{p.fraction:.3f}", _num(p.first_divergence_mean),
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
    s = QUICK if args.quick else FULL
    if args.dtypes:
        s = replace(s, dtypes=tuple(d.strip() for d in args.dtypes.split(",") if d.strip()))
    if args.prompts:
        s = replace(s, num_prompts=args.prompts)
    if args.output_len:
        s = replace(s, output_len=args.output_len, extend_tokens=max(1, args.output_len // 2))
    report = run_benchmark(s, args.device, progress=to_stderr)
    emit(report, args.json, render(report))
    return report


if __name__ == "__main__":
    main()
