"""Decoding Hugging Face config.json into a ModelSpec, and what it rejects."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pddgw.engines.model import rope_inv_freq
from pddgw.engines.model_spec import ModelSpec, RopeScaling, UnsupportedModelError, llama_spec
from pddgw.engines.weights import build_tiny, load_model, save_hf_checkpoint


def _cfg(**kw):
    d = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
    d.update(kw)
    return {k: v for k, v in d.items() if v is not None}


def test_llama_defaults_and_transformers4_rope_keys():
    s = ModelSpec.from_hf_config(_cfg(rope_theta=500000.0, rope_scaling={
        "type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert (s.arch, s.num_kv_heads, s.head_dim) == ("llama", 4, 16)
    assert s.rope_theta == 500000.0
    assert s.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert not s.tie_word_embeddings and not s.attention_bias and not s.qk_norm
    assert s.bos_token_id == 1 and s.eos_token_ids == (2,)
    assert s.max_position_embeddings == 512


def test_transformers5_rope_parameters_and_eos_list():
    s = ModelSpec.from_hf_config(_cfg(
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        eos_token_id=[2, 7, 9], bos_token_id=None, num_key_value_heads=1, head_dim=32))
    assert s.rope_theta == 1e6 and s.rope_scaling is None
    assert s.eos_token_ids == (2, 7, 9) and s.bos_token_id is None
    assert (s.num_kv_heads, s.head_dim) == (1, 32)
    # rope_scaling null (common in 4.x configs) = default RoPE
    assert ModelSpec.from_hf_config(_cfg(rope_scaling=None, rope_theta=1e4)).rope_scaling is None


def test_family_differences():
    q2 = ModelSpec.from_hf_config(_cfg(model_type="qwen2", sliding_window=4096,
                                       use_sliding_window=False))
    assert q2.attention_bias and not q2.o_proj_bias and not q2.qk_norm
    assert q2.max_position_embeddings == 512          # window off: no cap
    q3 = ModelSpec.from_hf_config(_cfg(model_type="qwen3", head_dim=32))
    assert q3.qk_norm and not q3.attention_bias and q3.head_dim == 32
    q3b = ModelSpec.from_hf_config(_cfg(model_type="qwen3", attention_bias=True))
    assert q3b.attention_bias and q3b.o_proj_bias
    llb = ModelSpec.from_hf_config(_cfg(attention_bias=True))
    assert llb.o_proj_bias
    m = ModelSpec.from_hf_config(_cfg(model_type="mistral", sliding_window=None))
    assert not m.attention_bias and m.max_position_embeddings == 512


def test_sliding_window_caps_context():
    m = ModelSpec.from_hf_config(_cfg(model_type="mistral", sliding_window=128))
    assert m.max_position_embeddings == 128
    m = ModelSpec.from_hf_config(_cfg(model_type="mistral", sliding_window=4096))
    assert m.max_position_embeddings == 512
    q = ModelSpec.from_hf_config(_cfg(model_type="qwen2", use_sliding_window=True,
                                      sliding_window=100, max_window_layers=1))
    assert q.max_position_embeddings == 100           # layer 1 slides
    q = ModelSpec.from_hf_config(_cfg(model_type="qwen2", use_sliding_window=True,
                                      sliding_window=100, max_window_layers=2))
    assert q.max_position_embeddings == 512           # no layer slides


@pytest.mark.parametrize("kw,match", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
    ({"model_type": None}, "unsupported model_type None"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' unsupported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
     "missing 'high_freq_factor'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type"),
    ({"num_hidden_layers": None}, "missing required key 'num_hidden_layers'"),
    ({"model_type": "mistral", "attention_bias": True}, "attention_bias"),
])
def test_unsupported_configs_are_named(kw, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelSpec.from_hf_config(_cfg(**kw))


def test_spec_validation():
    base = ModelSpec.from_hf_config(_cfg())
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dataclasses.replace(base, num_kv_heads=3)
    with pytest.raises(ValueError, match="outside vocab"):
        dataclasses.replace(base, eos_token_ids=(1000,))
    with pytest.raises(ValueError, match="arch must be one of"):
        dataclasses.replace(base, arch="gpt2")
    with pytest.raises(ValueError, match="head_dim must be even"):
        dataclasses.replace(base, head_dim=15)


def test_to_hf_config_round_trip():
    for cfg in (_cfg(), _cfg(model_type="qwen2", tie_word_embeddings=True),
                _cfg(model_type="qwen3", attention_bias=True, head_dim=32, eos_token_id=[2, 3]),
                _cfg(model_type="mistral", num_key_value_heads=2),
                _cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 256})):
        s = ModelSpec.from_hf_config(cfg)
        assert ModelSpec.from_hf_config(json.loads(json.dumps(s.to_hf_config()))) == s


def test_generation_config_eos_overrides(tmp_path):
    save_hf_checkpoint(build_tiny(0, torch.float32, "cpu"), tmp_path)
    model, _ = load_model(str(tmp_path), "float32", "cpu")
    assert model.spec.eos_token_ids == (257, 259)      # config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [259, 3]}))
    model, _ = load_model(str(tmp_path), "float32", "cpu")
    assert model.spec.eos_token_ids == (259, 3)


def test_rope_inv_freq_bands():
    plain = rope_inv_freq(16, 500000.0, None)
    assert torch.allclose(plain, 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    scaled = rope_inv_freq(16, 500000.0, RopeScaling(8.0, 1.0, 4.0, 64))
    wavelen = 2 * torch.pi / plain
    high = wavelen < 16        # short wavelengths: kept
    low = wavelen > 64         # long wavelengths: divided by factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert torch.equal(scaled[high], plain[high])
    assert torch.allclose(scaled[low], plain[low] / 8.0)
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


def test_llama_spec_is_what_a_plain_llama_config_decodes_to():
    plain = llama_spec(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))
    assert plain == ModelSpec.from_hf_config(_cfg())
    assert plain.head_dim == 16
    wide = llama_spec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                      num_kv_heads=2, head_dim=128)
    assert (wide.head_dim, wide.q_size, wide.eos_token_ids, wide.bos_token_id) == (128, 256, (), None)
    with pytest.raises(ValueError, match="hidden_size must be a multiple of num_heads"):
        llama_spec(vocab_size=512, hidden_size=100, intermediate_size=256, num_layers=2, num_heads=3,
                   num_kv_heads=1)
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        llama_spec(vocab_size=512, hidden_size=96, intermediate_size=256, num_layers=2, num_heads=3,
                   num_kv_heads=2)
