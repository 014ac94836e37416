"""Checkpoints as today's transformers saves them: EOS from wherever the model states it, or none.

transformers 5.x writes `"eos_token_id": null` in config.json (and none in
generation_config.json) unless told otherwise; a base model may state its EOS
only in the tokenizer's files.  Such a model loads, generates exactly what
transformers generates (float64 on both sides: no near-ties), and refuses
only what needs an EOS: a grammar.  A file that cannot be used is one line
naming it and the key, never a traceback.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer as RawTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from pddgw import cli  # noqa: E402
from pddgw.config import EngineConfig  # noqa: E402
from pddgw.engines.grammar import NO_EOS  # noqa: E402
from pddgw.engines.torch_engine import TorchEngine  # noqa: E402
from pddgw.engines.types import EngineRequest, RequestError, SamplingParams  # noqa: E402
from pddgw.engines.weights import WeightsError, load_model, load_spec  # noqa: E402

from .conftest import run_to_end  # noqa: E402

VOCAB = 512
PROMPT = [5, 17, 33, 101, 7, 250, 64, 3]
ENDOFTEXT = "<|endoftext|>"


def _save_qwen2(d) -> None:
    """A random Qwen2 saved by transformers with its defaults: no bos / eos anywhere."""
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    assert cfg.eos_token_id is None and cfg.bos_token_id is None
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(d)


def _save_tokenizer(d, eos_token: str | None) -> int:
    """A byte-level BPE saved by transformers' fast tokenizer (tokenizer.json, tokenizer_config.json),
    its eos_token as given; -> the id of <|endoftext|>."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["hello world, the quick brown fox"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[ENDOFTEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eos_token).save_pretrained(d)
    return raw.token_to_id(ENDOFTEXT)


@pytest.fixture(scope="module")
def null_eos(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2-null-eos")
    _save_qwen2(d)
    return d


def test_a_checkpoint_with_null_eos_loads_with_none(null_eos):
    assert json.loads((null_eos / "config.json").read_text())["eos_token_id"] is None
    spec, tok = load_spec(str(null_eos))
    assert spec.eos_token_ids == () == tok.eos_token_ids


def test_it_generates_what_transformers_generates(null_eos, capsys):
    ref = transformers.Qwen2ForCausalLM.from_pretrained(null_eos, dtype=torch.float64)
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
    assert cli.main(["generate", "--model", str(null_eos), "--dtype", "float64", "--max-tokens", "12",
                     "--prompt-ids", ",".join(map(str, PROMPT)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (out["model"], out["token_ids"]) == (null_eos.name, want)


def test_a_grammar_on_it_is_refused_and_the_engine_keeps_serving(null_eos):
    model, tok = load_model(str(null_eos), torch.float64, "cpu")
    engine = TorchEngine(model, model.spec, EngineConfig(num_blocks=16, block_size=16), torch.float64,
                         tokenizer=tok)
    with pytest.raises(RequestError) as e:
        engine.add_request(EngineRequest("g", tuple(PROMPT), SamplingParams(
            max_tokens=4, grammar=("json_schema", '{"type": "object"}'))))
    assert str(e.value) == NO_EOS
    engine.add_request(EngineRequest("plain", tuple(PROMPT), SamplingParams(max_tokens=4)))
    assert len(run_to_end(engine)["plain"]) == 4
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize(("tokenizer_eos", "generation_eos", "config_eos", "want"), [
    (ENDOFTEXT, None, None, "endoftext"),      # only the tokenizer states it
    (ENDOFTEXT, [7, 9], 3, (7, 9)),            # generation_config.json first
    (ENDOFTEXT, None, 3, (3,)),                # then config.json
    (None, None, None, ()),                    # nowhere: none
])
def test_eos_comes_from_the_first_file_that_states_it(tmp_path, tokenizer_eos, generation_eos, config_eos, want):
    _save_qwen2(tmp_path)
    endoftext = _save_tokenizer(tmp_path, tokenizer_eos)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": config_eos}))
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    spec, tok = load_spec(str(tmp_path))
    expected = (endoftext,) if want == "endoftext" else want
    assert spec.eos_token_ids == expected == tok.eos_token_ids


def _corrupt(d, name: str, edit) -> None:
    path = d / name
    if name.endswith(".json"):
        path.write_text(edit(path.read_text()))
    else:
        with open(path, "r+b") as f:
            f.truncate(1000)


def _set(key, value):
    return lambda text: json.dumps({**json.loads(text), key: value})


BROKEN = {
    "config_not_json": ("config.json", lambda t: "{not json", "config.json: not valid JSON (Expecting property name "
                        "enclosed in double quotes: line 1 column 2 (char 1))"),
    "generation_not_json": ("generation_config.json", lambda t: "[1,", "generation_config.json: not valid JSON "
                            "(Expecting value: line 1 column 4 (char 3))"),
    "no_hidden_size": ("config.json", lambda t: json.dumps({k: v for k, v in json.loads(t).items()
                                                             if k != "hidden_size"}),
                       "config.json: missing required key 'hidden_size'"),
    "layers_not_int": ("config.json", _set("num_hidden_layers", "two"),
                       "config.json: num_hidden_layers must be an integer, got 'two'"),
    "eos_outside_vocab": ("config.json", _set("eos_token_id", 9999),
                          "config.json: eos_token_id: token id 9999 is outside the vocabulary (vocab_size 512)"),
    "eos_not_an_id": ("generation_config.json", _set("eos_token_id", "x"),
                      "generation_config.json: eos_token_id must be a token id or a list of token ids, got 'x'"),
    "weights_truncated": ("model.safetensors", None, "model.safetensors: not a readable safetensors file "
                          "(Error while deserializing header: invalid header length)"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_checkpoint_that_cannot_load_is_one_line_naming_the_file_and_key(tmp_path, capsys, case):
    name, edit, message = BROKEN[case]
    _save_qwen2(tmp_path)
    _corrupt(tmp_path, name, edit)
    capsys.readouterr()                   # transformers' own progress output
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--max-tokens", "1"]) == 2
    assert capsys.readouterr().err == f"pddgw: error: --model: {tmp_path}/{message}\n"


def test_an_unreadable_tokenizer_json_is_named(tmp_path):
    _save_qwen2(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    with pytest.raises(WeightsError, match=rf"^{tmp_path}/tokenizer.json: not a tokenizer.json the tokenizers "
                                           r"library reads \(data did not match"):
        load_spec(str(tmp_path))
