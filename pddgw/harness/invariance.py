"""Runners of `python -m pddgw.bench.invariance` (its docstring says what the paths and ops are); blocking."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pddgw.core.sampling import SamplingParams
from pddgw.engines import torch_engine
from pddgw.engines.model import linear, pack_weight, rms_norm
from pddgw.engines.types import EngineRequest
from pddgw.engines.weights import tiny_spec
from pddgw.harness.engines import BLOCK_SIZE, drain, engine_config, patched
from pddgw.kernels import get_ops

OPS = ("linear packed", "linear F.linear", "rms_norm", "decode attn", "extend vs decode", "chunked extend")
FILLER_SEED = 1 << 20          # filler requests' seeds (identify them; greedy ignores seeds)

OutputIds = list[int]                        # one request's output token ids
Logits = dict[tuple[int, int], bytes]         # (request's seed, output position) -> the sampled row's bytes


def run_path(path: str, model, dtype: torch.dtype, device: str, prompts: list[list[int]], output_len: int,
             longest: int, alone: Sequence[OutputIds] = (), extend_tokens: int = 0,
             fillers: Sequence[Sequence[int]] = (), chunk: int = 0) -> tuple[list[OutputIds], Logits]:
    """Each prompt's `output_len` greedy output ids on `path`, and every logits row `torch_engine.sample`
    got meanwhile.  Paths: alone (first: the others' reference), batch (plus `fillers`), mixed, extend
    (`alone`'s first `extend_tokens` ids given), chunked (`chunk` tokens a step).  Request i has seed
    i + 1 (greedy ignores it: it names the request); `longest` sizes the engines' pools."""
    logits: Logits = {}

    def recording(real: Callable) -> Callable:
        def sample(rows: torch.Tensor, params, positions):
            for row, p, pos in zip(rows.detach().to("cpu"), params, positions):
                logits[(p.seed, pos)] = row.numpy().tobytes()
            return real(rows, params, positions)
        return sample

    def engine(max_num_seqs: int, max_num_batched_tokens: int = 0) -> torch_engine.TorchEngine:
        cfg = engine_config(max_num_seqs, longest, device, max_num_batched_tokens)
        return torch_engine.TorchEngine(model, model.spec, cfg, dtype)

    def request(rid: str, prompt: Sequence[int], seed: int, done: Sequence[int] = ()) -> EngineRequest:
        sp = SamplingParams(max_tokens=output_len, ignore_eos=True, seed=seed)
        return EngineRequest(rid, tuple(prompt), sp, output_token_ids=tuple(done))

    def one(i: int, done: Sequence[int] = (), max_num_batched_tokens: int = 0) -> OutputIds:
        """Request i alone (`done`: output ids already given) -> its output ids after `done`."""
        return drain(engine(1, max_num_batched_tokens), [request("r", prompts[i], i + 1, done)])["r"]

    n, g = len(prompts), extend_tokens
    with patched(torch_engine, "sample", recording):
        if path == "alone":
            return [one(i) for i in range(n)], logits
        if path == "extend":
            return [alone[i][:g] + one(i, alone[i][:g]) for i in range(n)], logits
        if path == "chunked":
            return [one(i, max_num_batched_tokens=chunk) for i in range(n)], logits
        reqs = [request(f"r{i}", p, i + 1) for i, p in enumerate(prompts)]
        if path == "batch":                     # every request added before the first step
            e = engine(n + len(fillers))
            for r in reqs + [request(f"f{j}", p, FILLER_SEED + j) for j, p in enumerate(fillers)]:
                e.add_request(r)
            got = drain(e)
        else:                                   # mixed: one arrival per step
            got = drain(engine(n), reqs)
        return [got[f"r{i}"] for i in range(n)], logits


def op_differences(dtype: torch.dtype, device: str, trials: int, seed: int) -> dict[str, int]:
    """Per op of `OPS` (in order), of `trials` random inputs on the tiny model's shapes, how many
    gave a row whose result alone differs in any bit from the same row computed beside others."""
    ops, spec = get_ops("auto", device), tiny_spec()
    hid, hd, heads = spec.hidden_size, spec.head_dim, spec.num_heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    def ints(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    counts = dict.fromkeys(OPS, 0)
    nb, scale = 64, hd ** -0.5
    kc, vc = rand(nb, BLOCK_SIZE, spec.num_kv_heads, hd), rand(nb, BLOCK_SIZE, spec.num_kv_heads, hd)
    for _ in range(trials):
        # GEMM and RMSNorm: rows [0, m) alone vs inside 64 rows (oneDNN changes its reduction above 32).
        m = int(torch.randint(1, 32, (1,), generator=g))
        x, w = rand(64, hid), rand(3 * hid, hid, scale=hid ** -0.5)
        if (packed := pack_weight(w)) is not None:
            counts["linear packed"] += not torch.equal(linear(x[:m], w, None, packed), linear(x, w, None, packed)[:m])
        counts["linear F.linear"] += not torch.equal(linear(x[:m], w, None, None), linear(x, w, None, None)[:m])
        nw = rand(hid, scale=0.1) + 1
        counts["rms_norm"] += not torch.equal(rms_norm(x[:m], nw, 1e-5), rms_norm(x, nw, 1e-5)[:m])
        # Attention over one sequence of length n in the paged cache.
        n = int(torch.randint(2, 12 * BLOCK_SIZE, (1,), generator=g))
        table = torch.randperm(nb, generator=g)[:12].to(device=device, dtype=torch.int32)      # [12] blocks
        used = table[None, : -(-n // BLOCK_SIZE)]
        q = rand(1, heads, hd)
        alone = ops.paged_decode_attention(q, kc, vc, used, ints(n), scale)
        other = torch.randperm(nb, generator=g)[:12].to(device=device, dtype=torch.int32)
        both = ops.paged_decode_attention(torch.cat([q, rand(1, heads, hd)]), kc, vc, torch.stack([table, other]),
                                          ints(n, 12 * BLOCK_SIZE), scale)
        counts["decode attn"] += not torch.equal(alone, both[:1])
        t = min(n, 6)                                   # an extend of the last t tokens
        qe = torch.cat([rand(t - 1, heads, hd), q])
        ext = ops.extend_attention(qe, kc, vc, used, ints(0, t), ints(n), scale)
        counts["extend vs decode"] += not torch.equal(ext[-1:], alone)
        last2 = ops.extend_attention(qe[-2:], kc, vc, used, ints(0, 2), ints(n), scale)
        counts["chunked extend"] += not torch.equal(last2, ext[-2:])
    return counts
