"""`pddgw export-model` / weights.export_model: the tiny model as a Hugging Face directory.

Pinned: the ByteTokenizer expressed as a `tokenizers` tokenizer.json encodes and decodes
as ByteTokenizer does (ASCII, multi-byte UTF-8, special tokens and their ids); transformers
(AutoTokenizer + AutoModelForCausalLM) loads the directory and its greedy tokens and chat
template ids equal our engine's; `load_model(DIR)` serves the built-in model's tokens.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer

from pddgw import cli
from pddgw.engines.tokenizer import ByteTokenizer, HFTokenizer
from pddgw.engines.weights import build_tiny, byte_tokenizer_json, export_model, load_model

from .conftest import greedy_batch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = ("hello, world", "déjà vu — 東京 🚀\n\ttabs", "<|im_start|>typed<|im_end|> <bos>", "")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <|im_end|>"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-hf")
    assert cli.main(["export-model", str(d), "--model", "tiny"]) == 0
    return d


def test_byte_tokenizer_json_is_the_byte_tokenizer():
    ref = ByteTokenizer(384)
    raw = RawTokenizer.from_str(byte_tokenizer_json(ref))
    assert raw.get_vocab_size(with_added_tokens=True) == 384
    plain = RawTokenizer.from_str(byte_tokenizer_json(ref))
    plain.encode_special_tokens = True           # users' text, as HFTokenizer encodes it
    for text in TEXTS:
        assert plain.encode(text, add_special_tokens=False).ids == ref.encode(text) == list(text.encode())
        assert raw.decode(ref.encode(text)) == ref.decode(ref.encode(text)) == text
    # Special tokens keep ByteTokenizer's ids; in template text they are recognised as such.
    assert [raw.token_to_id(t) for t in ByteTokenizer.SPECIALS] == [256, 257, 258, 259, 260]
    assert raw.encode("<|im_start|>a<|im_end|>", add_special_tokens=False).ids == [258, 97, 259]
    assert raw.encode("a", add_special_tokens=True).ids == [256, 97]          # bos in front
    # Decoding drops specials and reserved ids, and a cut UTF-8 sequence is U+FFFD.
    ids = [256, 104, 0xC3, 0xA9, 259, 300, 383]
    assert raw.decode(ids) == ref.decode(ids) == "hé"
    assert raw.decode([104, 0xC3]) == ref.decode([104, 0xC3]) == "h\ufffd"


def test_exported_tokenizer_is_the_byte_tokenizer_through_hftokenizer(exported):
    ours, ref = HFTokenizer.from_dir(exported, 384), ByteTokenizer(384)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text)        # typed specials stay text
    assert ours.apply_chat_template(CHAT) == ref.apply_chat_template(CHAT)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=False) == \
        ref.apply_chat_template(CHAT, add_generation_prompt=False)
    assert (ours.bos_token_id, ours.eos_token_ids) == (256, (257, 259))


def test_export_writes_a_hugging_face_directory(exported):
    assert sorted(p.name for p in exported.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 384
    tc = json.loads((exported / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == ("<bos>", "<|im_end|>", "<pad>")
    assert "<|im_start|>" in tc["chat_template"]


def _prompts(tok) -> list[list[int]]:
    return [tok.apply_chat_template(CHAT), tok.apply_chat_template([{"role": "user", "content": "Plan it."}]),
            tok.encode("Once upon a time")]


def test_transformers_loads_it_with_our_tokens(exported):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    ref = ByteTokenizer(384)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
    want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(want) == ref.apply_chat_template(chat)
    assert tok.encode("héllo", add_special_tokens=False) == list("héllo".encode())
    assert tok.decode([256, 104, 105, 259], skip_special_tokens=True) == "hi"
    ours = build_tiny(0, torch.float32, "cpu")
    prompts = _prompts(ref)
    got = greedy_batch(ours, prompts)
    for p, mine in zip(prompts, got):
        with torch.inference_mode():
            full = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                  eos_token_id=[257, 259], pad_token_id=260)[0].tolist()
        assert mine == full[len(p):]
        assert len(mine) == 16


def test_serving_the_directory_gives_the_built_in_tokens(exported):
    loaded, tok = load_model(str(exported), "float32", "cpu")
    assert isinstance(tok, HFTokenizer)
    builtin = build_tiny(0, torch.float32, "cpu")
    prompts = _prompts(tok)
    assert prompts == _prompts(ByteTokenizer(384))
    assert greedy_batch(loaded, prompts) == greedy_batch(builtin, prompts)


def test_export_of_an_hf_checkpoint_round_trips(exported, tmp_path):
    model, tok = load_model(str(exported), "float32", "cpu")
    again = export_model(model, tok, tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (again / name).read_text() == (exported / name).read_text()


def test_export_model_cli_errors(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main(["export-model", str(f)]) == 2
    assert capsys.readouterr().err == f"pddgw: error: DIR: {f} exists and is not a directory\n"
    assert cli.main(["export-model", str(tmp_path / "out"), "--model", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith(f"pddgw: error: --model: {tmp_path / 'nope'}: no such directory")
