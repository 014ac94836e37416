"""What CUDA graphs need from the Triton kernels (interpreted on CPU without CUDA):
a decode launch plan that depends on shapes only, and the graph runner's padded,
full-width decode steps generating what the eager engine does."""

from __future__ import annotations

import pytest
import torch
from .kernel_cases import make_q

from pddgw.config import EngineConfig
from pddgw.engines.cuda_graphs import CudaGraphRunner
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest, SamplingParams
from pddgw.engines.weights import build_tiny
from pddgw.kernels import triton_ops as T
from tests.engines.conftest import run_to_end


def _plan(launches):
    """Everything of the launches but the tensors' contents: kernel, grid, scalars, constexprs."""
    out = []
    for ln in launches:
        scalars = tuple(a if not isinstance(a, torch.Tensor) else (tuple(a.shape), a.dtype)
                        for a in ln.args)
        out.append((ln.kernel, ln.grid, scalars, tuple(sorted(ln.constexprs.items())),
                    ln.num_warps, ln.num_stages))
    return out


def test_decode_plan_depends_on_shapes_not_lengths():
    """Same batch and table width, very different lengths: one launch plan (splits included),
    so a graph captured once serves every step of its bucket."""
    block_size, width = 4, 16
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(40, block_size, 2, 16, generator=g) for _ in range(2))
    tables = torch.randint(0, 40, (3, width), generator=g, dtype=torch.int32)
    q = make_q(3, 4, 16, torch.float32)
    plans = []
    for lens in ([1, 1, 1], [48, 3, 17], [5, 64, 64]):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        for splits in (None, 4):
            kw = {} if splits is None else {"num_splits": splits, "block_n": 16}
            _, launches = T.attention_launches(q, k_cache, v_cache, tables, seq_lens, None, 0.25,
                                               num_sms=2, interpret=True, **kw)
            plans.append((splits, _plan(launches)))
    auto = [pl for s, pl in plans if s is None]
    forced = [pl for s, pl in plans if s == 4]
    assert auto[0] == auto[1] == auto[2] and forced[0] == forced[1] == forced[2]
    assert len(forced[0]) == 2                     # attention + split merge


def _run(graphed: bool) -> tuple[dict[str, list[int]], TorchEngine]:
    model = build_tiny(0, torch.float32, "cpu")
    cfg = EngineConfig(num_blocks=10, block_size=8, max_num_batched_tokens=16, max_num_seqs=4,
                       attention_backend="triton")
    eng = TorchEngine(model, model.spec, cfg, torch.float32)
    if graphed:
        runner = CudaGraphRunner(model, eng.pool.caches, eng.ops, max_num_seqs=4,
                                 max_blocks=eng.inputs.max_blocks, device=eng.device,
                                 buckets=(1, 2, 4), graphs=False)
        runner.capture()
        eng.model = runner
    for i, p in enumerate([[65], [70, 71, 72, 73, 74], [80, 81, 82]]):
        eng.add_request(EngineRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=4)))
    out = run_to_end(eng)
    eng.check_integrity()
    return out, eng


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="interpreter on a CPU engine; with CUDA, tests/engines/test_cuda_graphs.py "
                           "replays real graphs")
def test_padded_full_width_decode_steps_equal_eager_on_triton():
    graphed, eng = _run(True)
    assert eng.model.num_replayed >= 2
    eager, _ = _run(False)
    assert graphed == eager and all(len(v) == 4 for v in graphed.values())
