"""Shared engine fixtures: the tiny model in float64 (clear margins, exact comparisons)."""

from __future__ import annotations

import pytest
import torch

from pddgw.config import EngineConfig
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest, SamplingParams
from pddgw.engines.weights import build_tiny


@pytest.fixture(scope="session")
def tiny64():
    return build_tiny(0, torch.float64, "cpu")


def make_engine(model, **overrides) -> TorchEngine:
    cfg = EngineConfig(**{"num_blocks": 128, "block_size": 16, "max_num_batched_tokens": 64,
                          "max_num_seqs": 32, **overrides})
    return TorchEngine(model, model.spec, cfg, torch.float64)


def run_to_end(engine: TorchEngine) -> dict[str, list[int]]:
    """Step until idle; sampled tokens per request, checking positions are contiguous."""
    out: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    while engine.has_work():
        for o in engine.step():
            got = out.setdefault(o.request_id, [])
            if o.ids:
                start = first.setdefault(o.request_id, o.position)
                assert o.position == start + len(got), (o, start, len(got))
                got += o.ids
    return out


def greedy_batch(model, prompts, max_tokens: int = 16, dtype: torch.dtype | None = None) -> list[list[int]]:
    """Greedy tokens of `prompts` decoded together in one engine (paged KV, batched steps)."""
    cfg = EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=256, max_num_seqs=8)
    engine = TorchEngine(model, model.spec, cfg, dtype or model.dtype)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=max_tokens)))
    with torch.inference_mode():
        out = run_to_end(engine)
    return [out[f"r{i}"] for i in range(len(prompts))]


def req(rid: str, prompt, max_tokens: int = 8, **kw) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, **{k: kw.pop(k) for k in
                              ("temperature", "seed", "top_k", "top_p", "stop_token_ids")
                              if k in kw})
    return EngineRequest(rid, tuple(prompt), sampling, **kw)
