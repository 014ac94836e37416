"""Our decoder against `transformers` on random-weight checkpoints (float32, CPU).

Each checkpoint is built with transformers' own model class, given random
weights of realistic scale (norm weights and biases too, so a missing or
misplaced term changes the logits), saved with `save_pretrained`, and loaded
with `load_model`.  Our logits come from the paged forward with a real KV cache
(reference kernels, non-contiguous blocks): a 20-token prefill, a 5-token
chunked continuation, then a 1-token decode; they must match transformers'
full-sequence logits within 1e-4.  The other direction (our
`save_hf_checkpoint` read by transformers) is pinned too.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from pddgw.engines.attention import AttnMetadata  # noqa: E402
from pddgw.engines.model import LlamaModel  # noqa: E402
from pddgw.engines.model_spec import RopeScaling  # noqa: E402
from pddgw.engines.tokenizer import ByteTokenizer  # noqa: E402
from pddgw.engines.weights import (  # noqa: E402
    WeightsError,
    build_tiny,
    load_model,
    save_hf_checkpoint,
)
from pddgw.kernels import reference  # noqa: E402
from safetensors import safe_open  # noqa: E402

VOCAB = 320
TOL = 1e-4
CHUNKS = ((0, 20), (20, 25), (25, 26))    # prefill, chunked extend, decode


def _base(**kw):
    d = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    d.update(kw)
    return d


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # 64 puts the 8 frequencies of head_dim 16 in all three bands
               # (kept, blended, divided by factor).
               "original_max_position_embeddings": 64}

CASES = {
    "llama": ("LlamaConfig", _base()),
    "llama_tied_bias_llama3rope": ("LlamaConfig", _base(tie_word_embeddings=True,
                                                        attention_bias=True,
                                                        rope_parameters=dict(LLAMA3_ROPE))),
    "qwen2_tied": ("Qwen2Config", _base(tie_word_embeddings=True, rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3_qknorm": ("Qwen3Config", _base(head_dim=32, num_key_value_heads=1)),
    "mistral": ("MistralConfig", _base(num_attention_heads=8, head_dim=8, sliding_window=None)),
    # window == total sequence length (26): full causal attention exactly;
    # an off-by-one in the window semantics would change the last rows.
    "mistral_window": ("MistralConfig", _base(sliding_window=26)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * r)
            elif name.endswith("bias"):
                p.copy_(0.3 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            elif name == "lm_head.weight":
                p.copy_(2.0 * r / p.shape[1] ** 0.5)
            else:
                p.copy_(1.5 * r / p.shape[1] ** 0.5)


def _hf_model(kind: str, cfg: dict, seed: int = 0):
    config = getattr(transformers, kind)(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    _randomize(model, seed)
    return model


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()      # [L, V]


def _prompt(n: int = 26, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def paged_logits(model: LlamaModel, ids: list[int], chunks=CHUNKS, block_size: int = 4,
                 seed: int = 0) -> torch.Tensor:
    """Run one sequence chunk by chunk through the paged forward -> logits [L, V]."""
    s = model.spec
    nblk = (len(ids) + block_size - 1) // block_size
    num_blocks = 2 * nblk + 3
    caches = [(torch.zeros(num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=model.dtype),
               torch.zeros(num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=model.dtype))
              for _ in range(s.num_layers)]
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=g)[:nblk]        # scattered pages
    out = []
    for start, end in chunks:
        pos = torch.arange(start, end)
        slots = table[pos // block_size] * block_size + pos % block_size
        meta = AttnMetadata(slot_mapping=slots, block_tables=table[None].to(torch.int32),
                            cu_q_lens=torch.tensor([0, end - start], dtype=torch.int32),
                            seq_lens=torch.tensor([end], dtype=torch.int32),
                            is_decode=end - start == 1, ops=reference)
        out.append(model(torch.tensor(ids[start:end]), pos, meta, caches,
                         torch.arange(end - start)))
    return torch.cat(out)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    kind, cfg = CASES[case]
    hf = _hf_model(kind, cfg)
    hf.save_pretrained(tmp_path)
    ids = _prompt()
    expected = _hf_logits(hf, ids)
    assert expected.abs().max() > 1.0      # weights are not near zero: the check has teeth

    model, _ = load_model(str(tmp_path), torch.float32, "cpu")
    assert model.spec.arch == kind.removesuffix("Config").lower()
    got = paged_logits(model, ids)
    assert got.dtype == torch.float32 and got.shape == (26, VOCAB)
    assert (got - expected).abs().max().item() <= TOL
    dense = model.forward_dense(torch.tensor(ids))
    assert (dense - expected).abs().max().item() <= TOL


def test_case_features_are_exercised(tmp_path):
    """The configs really use what they are named for (else the test above is weaker)."""
    specs = {}
    for case, (kind, cfg) in CASES.items():
        d = tmp_path / case
        _hf_model(kind, cfg).save_pretrained(d)
        specs[case] = load_model(str(d), torch.float32, "cpu")[0].spec
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert ("lm_head.weight" in names) == (not specs[case].tie_word_embeddings)
    assert specs["llama_tied_bias_llama3rope"].rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    assert specs["llama_tied_bias_llama3rope"].attention_bias
    assert specs["llama_tied_bias_llama3rope"].tie_word_embeddings
    assert specs["qwen2_tied"].attention_bias and not specs["qwen2_tied"].o_proj_bias
    assert specs["qwen3_qknorm"].qk_norm and specs["qwen3_qknorm"].head_dim == 32
    assert specs["mistral_window"].max_position_embeddings == 26
    assert specs["llama"].rope_scaling is None and not specs["llama"].tie_word_embeddings


def test_llama3_rope_scaling_changes_logits(tmp_path):
    """Scaled and unscaled RoPE give different logits on these positions, so the
    transformers match of the scaled case pins the scaling itself."""
    kind, cfg = CASES["llama_tied_bias_llama3rope"]
    hf = _hf_model(kind, cfg)
    hf.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    plain, _ = load_model(str(tmp_path), torch.float32, "cpu")
    assert plain.spec.rope_scaling is None
    ids = _prompt()
    assert (plain.forward_dense(torch.tensor(ids)) - _hf_logits(hf, ids)).abs().max() > 1e-2


def test_our_checkpoint_loads_in_transformers(tmp_path):
    """save_hf_checkpoint -> transformers from_pretrained -> same logits (Qwen3 + tied)."""
    kind, cfg = CASES["qwen3_qknorm"]
    src = tmp_path / "src"
    _hf_model(kind, dict(cfg, tie_word_embeddings=True, attention_bias=True), seed=3
              ).save_pretrained(src)
    ours, _ = load_model(str(src), torch.float32, "cpu")
    out = tmp_path / "ours"
    save_hf_checkpoint(ours, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ids = _prompt(seed=5)
    assert (ours.forward_dense(torch.tensor(ids)) - _hf_logits(hf, ids)).abs().max() <= TOL
    again, _ = load_model(str(out), torch.float32, "cpu")
    for name, t in ours.hf_tensors().items():
        assert torch.equal(again.hf_tensors()[name], t), name


def test_tiny_model_is_a_llama_for_transformers(tmp_path):
    tiny = build_tiny(7, torch.float32, "cpu")
    save_hf_checkpoint(tiny, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids = ByteTokenizer().encode("The tiny model is a Llama.")
    assert (tiny.forward_dense(torch.tensor(ids)) - _hf_logits(hf, ids)).abs().max() <= TOL
    loaded, tok = load_model(str(tmp_path), "float32", "cpu")
    assert isinstance(tok, ByteTokenizer)
    assert torch.equal(loaded.forward_dense(torch.tensor(ids)),
                       tiny.forward_dense(torch.tensor(ids)))


def test_bfloat16_checkpoint_and_half_dtypes(tmp_path):
    kind, cfg = CASES["llama"]
    hf = _hf_model(kind, cfg).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ids = _prompt()
    # bf16 values, float32 math (a fresh load: `.float()` would keep RoPE's
    # inv_freq buffer rounded to bf16).
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager")
    expected = _hf_logits(hf32, ids)
    m32, _ = load_model(str(tmp_path), torch.float32, "cpu")
    assert (paged_logits(m32, ids) - expected).abs().max().item() <= TOL
    scale = expected.abs().max().item()
    for dt in (torch.bfloat16, torch.float16):
        m, _ = load_model(str(tmp_path), dt, "cpu")
        assert m.embed.dtype == dt
        got = paged_logits(m, ids)
        assert got.dtype == torch.float32
        # Half-precision activations: close to float32, not bit-equal.
        assert (got - expected).abs().max().item() <= 0.05 * scale
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_sharded_checkpoint(tmp_path):
    kind, cfg = CASES["llama"]
    hf = _hf_model(kind, cfg)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load_model(str(tmp_path), torch.float32, "cpu")
    ids = _prompt()
    assert (paged_logits(model, ids) - _hf_logits(hf, ids)).abs().max().item() <= TOL


def _rewrite(path, fn) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture
def llama_dir(tmp_path):
    kind, cfg = CASES["llama"]
    _hf_model(kind, cfg).save_pretrained(tmp_path)
    return tmp_path


def test_missing_tensor_is_named(llama_dir):
    _rewrite(llama_dir / "model.safetensors",
             lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"missing tensors 'model\.layers\.1\.mlp\.up_proj"):
        load_model(str(llama_dir), torch.float32, "cpu")


def test_unexpected_tensor_is_named(llama_dir):
    _rewrite(llama_dir / "model.safetensors",
             lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(WeightsError, match=r"unexpected tensors 'model\.layers\.0\.self_attn"
                                           r"\.q_proj\.bias'"):
        load_model(str(llama_dir), torch.float32, "cpu")


def test_wrong_shape_is_named(llama_dir):
    _rewrite(llama_dir / "model.safetensors",
             lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(WeightsError, match=r"'model\.norm\.weight' has shape \(63,\)"):
        load_model(str(llama_dir), torch.float32, "cpu")


def test_rotary_inv_freq_buffers_are_ignored(llama_dir):
    ids = _prompt()
    before = load_model(str(llama_dir), torch.float32, "cpu")[0].forward_dense(torch.tensor(ids))
    _rewrite(llama_dir / "model.safetensors", lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    after = load_model(str(llama_dir), torch.float32, "cpu")[0].forward_dense(torch.tensor(ids))
    assert torch.equal(before, after)


def test_tied_checkpoint_with_explicit_lm_head(tmp_path):
    kind, cfg = CASES["qwen2_tied"]
    _hf_model(kind, cfg).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    _rewrite(f, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    load_model(str(tmp_path), torch.float32, "cpu")           # equal copy: accepted
    _rewrite(f, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1.0}))
    with pytest.raises(WeightsError, match="lm_head.weight differs"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_without_tokenizer_json_bytes_are_used(llama_dir):
    # transformers writes no tokenizer.json.
    assert not (llama_dir / "tokenizer.json").exists()
    _, tok = load_model(str(llama_dir), torch.float32, "cpu")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == VOCAB
    conf = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps(dict(conf, vocab_size=200)))
    with pytest.raises(WeightsError, match="no tokenizer.json, and vocab_size 200"):
        load_model(str(llama_dir), torch.float32, "cpu")
