"""model.dtype = "auto" (the default): the checkpoint's dtype where this machine computes it natively."""

import json

import pytest

from pddgw import cli
from pddgw.config import ConfigError, ModelConfig, load_config
from pddgw.engines import dtypes, gguf
from pddgw.engines.weights import load_spec_for

SMOLLM2 = gguf.named_model_file("smollm2")
# A loadable config.json (load_spec) for a random Llama without weights.
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5}


def _hf(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("config, found", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),
    ({"dtype": "bfloat16"}, "bfloat16"),           # newer transformers' key
    ({"torch_dtype": "torch.float16"}, "float16"),
    ({"torch_dtype": "float32"}, "float32"),
    ({}, "float32"),
])
def test_a_hugging_face_checkpoints_dtype_is_its_config_jsons(tmp_path, config, found):
    assert dtypes.checkpoint_dtype(_hf(tmp_path, **config)) == found


def test_the_tiny_model_is_float32_and_a_quantized_gguf_dequantizes_into_bfloat16():
    assert dtypes.checkpoint_dtype(None) == dtypes.checkpoint_dtype("tiny") == "float32"
    if SMOLLM2 is not None:
        assert gguf.read_gguf(SMOLLM2).file_type == 3        # MOSTLY_Q4_1
        assert dtypes.checkpoint_dtype("smollm2") == "bfloat16"


@pytest.mark.parametrize("found, cuda, bf16, chosen", [
    ("bfloat16", False, True, "bfloat16"),
    ("bfloat16", False, False, "float32"),         # emulated bfloat16 is slower than float32
    ("float16", False, True, "bfloat16"),          # oneDNN has no float16 GEMM on most CPUs
    ("float16", False, False, "float32"),
    ("float16", True, False, "float16"),           # a CUDA device computes it natively
    ("bfloat16", True, False, "bfloat16"),
    ("float32", False, True, "float32"),           # never narrowed
])
def test_auto_keeps_a_16_bit_checkpoint_where_it_is_native(monkeypatch, tmp_path, found, cuda, bf16, chosen):
    monkeypatch.setattr(dtypes, "_cuda", lambda: cuda)
    monkeypatch.setattr(dtypes, "cpu_has_bf16", lambda: bf16)
    model = ModelConfig(path=_hf(tmp_path, torch_dtype=found, **LLAMA))
    assert model.dtype == "auto" and dtypes.model_dtype(model) == chosen
    assert load_spec_for(model)[2] == chosen           # the KV dtype every role sizes transfers by
    # An explicit dtype is never changed.
    assert dtypes.model_dtype(ModelConfig(path=model.path, dtype="float64")) == "float64"
    line = dtypes.why(model)
    assert line == (f"{chosen} (auto: the checkpoint's)" if chosen == found else
                    f"{chosen} (auto: the checkpoint's {found}, "
                    f"{'native bfloat16 on this CPU' if bf16 else 'no native bfloat16 on this CPU'})")


def test_cpu_flags_are_read_from_proc_cpuinfo():
    head = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx512f {}\nbugs\t\t: spectre\n"
    assert dtypes.bf16_flags(head.format("avx512_bf16")) and dtypes.bf16_flags(head.format("amx_bf16 amx_tile"))
    assert not dtypes.bf16_flags(head.format("avx512_fp16")) and not dtypes.bf16_flags("")


def test_auto_is_the_default_and_the_flag_and_key_accept_it(tmp_path):
    assert ModelConfig().dtype == "auto" and load_config(None).model.dtype == "auto"
    p = tmp_path / "c.toml"
    p.write_text('[model]\ndtype = "auto"\n')
    assert load_config(str(p)).model.dtype == "auto"
    p.write_text('[model]\ndtype = "bf16"\n')
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(str(p))
    args = cli.build_parser().parse_args(["generate", "--model", "tiny", "--dtype", "auto", "--prompt", "x"])
    assert cli._config_with_overrides(args).model.dtype == "auto"
    assert dtypes.why(ModelConfig(profile="llama3-70b")) == "the precisions of profile 'llama3-70b' (cost model)"
