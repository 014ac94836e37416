"""ByteTokenizer and HFTokenizer: round trips, special tokens, the chat template."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pddgw.engines.tokenizer import IM_END, IM_START, ByteTokenizer, HFTokenizer

TEXTS = ["Hello, world!", "naïve café — 東京 🚀", "", "line one\nline two\t tab", "a" * 50]


# ---------------------------------------------------------------- ByteTokenizer

def test_byte_round_trip():
    tok = ByteTokenizer()
    for t in TEXTS:
        ids = tok.encode(t)
        assert ids == list(t.encode("utf-8"))
        assert tok.decode(ids) == t


def test_byte_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 384
    assert (tok.bos_token_id, tok.eos_token_ids) == (256, (257, 259))
    assert tok.decode([72, 256, 105, 257, 258, 259, 260, 383]) == "Hi"   # specials/reserved dropped
    # Special-token text typed by a user stays bytes.
    assert tok.encode(IM_END) == list(IM_END.encode())
    with pytest.raises(ValueError, match="vocab_size >= 261"):
        ByteTokenizer(260)


def test_byte_partial_utf8_is_replaced():
    tok = ByteTokenizer()
    euro = "€".encode()                      # 3 bytes
    assert tok.decode(list(euro[:2])) == "\ufffd"
    assert tok.decode([65, *euro[:1], 66]) == "A\ufffdB"
    assert tok.decode(list(euro)) == "€"


def test_byte_chat_template():
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([("system", "Be brief."), ("user", "Hi <|im_end|>")])
    b = ByteTokenizer
    expected = ([b.BOS]
                + [b.IM_START_ID] + list(b"system\nBe brief.") + [b.IM_END_ID] + list(b"\n")
                + [b.IM_START_ID] + list(b"user\nHi <|im_end|>") + [b.IM_END_ID] + list(b"\n")
                + [b.IM_START_ID] + list(b"assistant\n"))
    assert ids == expected
    assert ids.count(b.IM_END_ID) == 2       # the user's literal marker is text
    assert tok.apply_chat_template([]) == [b.BOS, b.IM_START_ID, *b"assistant\n"]


# ---------------------------------------------------------------- HFTokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer",
          "naïve café — 東京 🚀", "system user assistant"] * 20


def _write_tokenizer(path, with_bos: bool) -> RawTokenizer:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", IM_START, IM_END]
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if with_bos:
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))])
    raw.save(str(path / "tokenizer.json"))
    return raw


@pytest.fixture(params=[True, False], ids=["bos", "nobos"])
def hf_dir(tmp_path, request):
    raw = _write_tokenizer(tmp_path, with_bos=request.param)
    ids = {t: raw.token_to_id(t) for t in ("<s>", "</s>", IM_START, IM_END)}
    (tmp_path / "config.json").write_text(json.dumps(
        {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]}))
    return tmp_path, raw, ids, request.param


def test_hf_round_trip_and_ids(hf_dir):
    d, raw, ids, _ = hf_dir
    tok = HFTokenizer.from_dir(d, vocab_size=512)
    assert tok.vocab_size == 512
    assert tok.bos_token_id == ids["<s>"] and tok.eos_token_ids == (ids["</s>"],)
    for t in TEXTS:
        got = tok.encode(t)
        assert got == raw.encode(t, add_special_tokens=False).ids
        assert tok.decode(got) == t
    # Decoding drops specials; encoding never produces them from text.
    assert tok.decode([ids[IM_START], *tok.encode("hi"), ids["</s>"]]) == "hi"
    assert not set(tok.encode(f"{IM_START}x{IM_END}</s>")) & set(ids.values())
    assert HFTokenizer.from_dir(d).vocab_size == raw.get_vocab_size(with_added_tokens=True)


def test_hf_generation_config_eos_wins(hf_dir):
    d, _, ids, _ = hf_dir
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["</s>"], ids[IM_END]]}))
    tok = HFTokenizer.from_dir(d)
    assert tok.eos_token_ids == (ids["</s>"], ids[IM_END])
    assert tok.bos_token_id == ids["<s>"]


def test_hf_chat_template(hf_dir):
    d, raw, ids, with_bos = hf_dir
    tok = HFTokenizer.from_dir(d)
    got = tok.apply_chat_template([("user", "hello world")])

    def enc(s):
        return raw.encode(s, add_special_tokens=False).ids

    expected = ([ids["<s>"]] if with_bos else []) + (
        [ids[IM_START]] + enc("user\nhello world") + [ids[IM_END]] + enc("\n")
        + [ids[IM_START]] + enc("assistant\n"))
    assert got == expected


def test_hf_without_marker_tokens_uses_text(tmp_path):
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json", None, (raw.token_to_id("</s>"),))
    ids = tok.apply_chat_template([("user", "hi")])
    assert tok.decode(ids) == f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
