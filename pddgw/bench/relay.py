"""A relaying P's decode next to long prefill chunks: its TPOT and the prefill rate, per cap.

    python -m pddgw.bench.relay [--json] [--caps 0,2048,1024,512,256] [--chunk 8192]
                                [--prompt 8192] [--prefills 2] [--profile deepseek-v4-pro
                                --hardware H100-SXM --dp 24] [--no-real]

A prefill node with `relay = true` decodes its relayed requests in the same
steps as its prefill chunks (one engine, one scheduler).  `engine.
mixed_step_tokens` caps the other tokens of a step that decodes: TPOT falls
toward one short chunk's time, the prefill rate with it.  Per cap (0 = none),
on a fresh engine: one relayed request decodes while `--prefills` prompts of
`--prompt` tokens are prefilled in chunks of up to `--chunk` tokens (per DP
rank); reported: the relayed request's mean time per token over that window
and the prompt tokens prefilled per second, each with its ratio to no cap
(wall-timed runs: a warm-up, then the caps interleaved, median of `--repeat`).

Two engines, the same scheduler: the real torch engine (a random Llama, wall
time of each step, 2-core CPU: what the machine does) and the cost-model
engine (`--profile` on `--dp` ranks of `--hardware`: the modeled step times
`pddgw sim` and `pddgw plan` price).  The cost model prices exactly the steps
the scheduler makes, so the same cap changes both the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from pddgw.config import Config, ConfigError, CostModelConfig, EngineConfig, ModelConfig
from pddgw.core.sampling import SamplingParams
from pddgw.engines.model_spec import llama_spec
from pddgw.engines.paged import PagedEngine
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest
from pddgw.engines.weights import build_random
from pddgw.tables import add_output_args, emit, format_table, ratio

SEED = 11
RELAY_PROMPT = 64


@dataclass(frozen=True, slots=True)
class Row:
    engine: str
    cap: int                   # engine.mixed_step_tokens (0: none)
    steps: int
    decoded: int               # relayed tokens made while the prompts were prefilled
    tpot_ms: float
    prefill_tok_s: float
    tpot_ratio: float          # over the uncapped row's
    prefill_ratio: float


def real_engine(cap: int, chunk: int, prompt: int, prefills: int) -> PagedEngine:
    """A random Llama small enough for a 2-core CPU, long enough for the prompts."""
    spec = llama_spec(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                      num_kv_heads=4, max_position_embeddings=1 << 16, eos_token_ids=(1,))
    tokens = prompt * prefills + RELAY_PROMPT + 4096
    cfg = EngineConfig(num_blocks=-(-tokens // 16) + 64, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=chunk, mixed_step_tokens=cap, cpu_threads=0)
    return TorchEngine(build_random(spec, SEED, torch.float32, "cpu"), spec, cfg, torch.float32)


def model_engine(cap: int, chunk: int, profile: str, hardware: str, dp: int) -> PagedEngine:
    from pddgw.sim.costmodel_engine import CostModelEngine

    cfg = EngineConfig(implementation="costmodel", block_size=64, num_blocks=0, max_num_seqs=16,
                       max_num_batched_tokens=chunk, mixed_step_tokens=cap,
                       costmodel=CostModelConfig(hardware=hardware, data_parallel=dp))
    eng, _ = CostModelEngine.from_config(Config(model=ModelConfig(profile=profile)), cfg)
    return eng


def measure(eng: PagedEngine, prompt: int, prefills: int, timed: bool) -> tuple[int, int, float]:
    """-> (steps, relayed tokens, seconds) while the prompts are prefilled beside one decode."""
    vocab = eng.spec.vocab_size
    relay = [2 + i % (vocab - 2) for i in range(RELAY_PROMPT)]
    eng.add_request(EngineRequest("relay", tuple(relay), SamplingParams(max_tokens=1 << 14, ignore_eos=True,
                                                                         seed=1)))
    while not any(o.ids for o in eng.step()):      # its prompt, then its first token
        pass
    for k in range(prefills):
        ids = tuple(2 + (i * 7 + k * 131) % (vocab - 2) for i in range(prompt))
        eng.add_request(EngineRequest(f"p{k}", ids, SamplingParams(max_tokens=1, ignore_eos=True)))
    left, steps, decoded, seconds = prefills, 0, 0, 0.0
    while left:
        t0 = time.perf_counter()
        outs = eng.step()
        seconds += eng.step_seconds() if not timed else time.perf_counter() - t0
        steps += 1
        for o in outs:
            if o.request_id == "relay":
                decoded += len(o.ids)
            elif o.done:
                left -= 1
    eng.abort("relay")
    return steps, decoded, seconds


def rows_for(name: str, make, caps: list[int], prompt: int, prefills: int, timed: bool,
             repeat: int = 1) -> list[Row]:
    """One row per cap; timed (wall) runs: a warm-up first, then each cap's median of `repeat`,
    the caps interleaved."""
    if timed:
        measure(make(caps[0]), prompt, prefills, timed)
    runs: dict[int, list[tuple[int, int, float]]] = {cap: [] for cap in caps}
    for _ in range(repeat if timed else 1):
        for cap in caps:
            runs[cap].append(measure(make(cap), prompt, prefills, timed))
    got = []
    for cap in caps:
        steps, decoded, _ = runs[cap][0]
        got.append((cap, steps, decoded, statistics.median(r[2] for r in runs[cap])))
    base = next((g for g in got if g[0] == 0), got[0])
    tpot0, rate0 = base[3] / max(1, base[2]), prompt * prefills / base[3]
    out = []
    for cap, steps, decoded, secs in got:
        tpot, rate = secs / max(1, decoded), prompt * prefills / secs
        out.append(Row(name, cap, steps, decoded, round(tpot * 1000, 2), round(rate, 1),
                       ratio(tpot, tpot0), ratio(rate, rate0)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pddgw.bench.relay", description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default="0,2048,1024,512,256", help="engine.mixed_step_tokens values, 0 = no cap")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens per rank")
    ap.add_argument("--prompt", type=int, default=8192, help="tokens of each prompt prefilled")
    ap.add_argument("--prefills", type=int, default=2)
    ap.add_argument("--profile", default="deepseek-v4-pro", help="the cost model's model shape")
    ap.add_argument("--hardware", default="H100-SXM")
    ap.add_argument("--dp", type=int, default=24, help="the cost model's DP-attention ranks")
    ap.add_argument("--model-prompt", type=int, default=65536, help="prompt tokens for the cost model")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per cap (median)")
    ap.add_argument("--no-real", action="store_true", help="the cost model only")
    add_output_args(ap)
    a = ap.parse_args(argv)
    caps = [int(c) for c in a.caps.split(",")]
    try:
        rows = rows_for(f"{a.profile} {a.dp} x {a.hardware} (modeled)",
                        lambda cap: model_engine(cap, a.chunk, a.profile, a.hardware, a.dp),
                        caps, a.model_prompt, a.prefills * a.dp, timed=False)
    except ConfigError as e:
        ap.error(str(e))
    if not a.no_real:
        rows += rows_for("torch, random Llama 4 x 256 (CPU wall)",
                         lambda cap: real_engine(cap, a.chunk, a.prompt, a.prefills), caps, a.prompt, a.prefills,
                         timed=True, repeat=a.repeat)
    table = format_table(("engine", "mixed_step_tokens", "steps", "relayed tokens", "TPOT ms", "prefill tok/s",
                          "TPOT x", "prefill x"),
                         [(r.engine, r.cap or "none", r.steps, r.decoded, r.tpot_ms, r.prefill_tok_s, r.tpot_ratio,
                           r.prefill_ratio) for r in rows])
    emit({"rows": rows}, a.json, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
