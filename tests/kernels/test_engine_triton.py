"""The engine on the Triton backend (interpreted on CPU, compiled on CUDA) generates what the
torch backend does."""

import torch

from pddgw.config import EngineConfig
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest, SamplingParams
from pddgw.engines.weights import build_tiny
from pddgw.kernels import reference
from tests.engines.conftest import run_to_end


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # compiled Triton needs CUDA tensors


def _run(backend: str, prompts) -> tuple[dict[str, list[int]], TorchEngine]:
    model = build_tiny(0, torch.float32, DEVICE)
    cfg = EngineConfig(num_blocks=32, block_size=16, max_num_batched_tokens=32, max_num_seqs=8,
                       attention_backend=backend, device=DEVICE)
    eng = TorchEngine(model, model.spec, cfg, torch.float32)
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=5)))
    out = run_to_end(eng)
    eng.check_integrity()
    return out, eng


def test_engine_tokens_equal_across_backends():
    # Lengths 1, 20 and 40: decode-only and mixed batches, chunked prefill (budget 32),
    # a sequence spanning three blocks.
    prompts = [[65], list(range(40, 60)), list(range(70, 110))]
    triton_out, eng = _run("triton", prompts)
    assert eng.ops is not reference
    torch_out, _ = _run("torch", prompts)
    assert triton_out == torch_out
    assert all(len(v) == 5 for v in triton_out.values())
