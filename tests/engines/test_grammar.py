"""Grammar masks (engines/grammar.py) over the tiny model's byte vocabulary, exactly."""

from __future__ import annotations

import json

import pytest
import torch

from pddgw.config import EngineConfig
from pddgw.core.errors import FieldError
from pddgw.core.sampling import MAX_GRAMMAR_CHARS, SamplingParams
from pddgw.engines.grammar import Grammars, check_spec, mask_rows
from pddgw.engines.penalties import TokenHistory, adjust_logits
from pddgw.engines.tokenizer import ByteTokenizer
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest, RequestError
from pddgw.engines.weights import build_tiny

V = 384
EOS = (ByteTokenizer.EOS, ByteTokenizer.IM_END_ID)
TINY = ("ebnf", 'root ::= "ab" | "ac" | [0-9]')


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(ByteTokenizer(V), V, EOS)


def admitted(g: Grammars, spec, output: list[int], dtype=torch.float32) -> set[int]:
    x = torch.zeros(1, V, dtype=dtype)
    mask_rows(x, [g.constraint(spec)], [output])
    return set(torch.isfinite(x[0]).nonzero().flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_mask_admits_exactly_the_valid_next_tokens(grammars, dtype):
    digits = set(range(ord("0"), ord("9") + 1))
    assert admitted(grammars, TINY, [], dtype) == {ord("a")} | digits
    assert admitted(grammars, TINY, [ord("a")], dtype) == {ord("b"), ord("c")}
    # Complete: only EOS (either of the model's) ends it.
    assert admitted(grammars, TINY, [ord("a"), ord("c")], dtype) == set(EOS)
    assert admitted(grammars, TINY, [ord("7")], dtype) == set(EOS)


def test_a_refused_token_admits_only_eos(grammars):
    assert admitted(grammars, TINY, [ord("z")]) == set(EOS)


def test_compiled_once_per_spec_and_fed_lazily(grammars):
    before = grammars.compiled
    c1, c2 = grammars.constraint(("regex", "x[yz]+")), grammars.constraint(("regex", "x[yz]+"))
    assert grammars.compiled == before + 1 and c1.matcher is not c2.matcher
    c1.sync([ord("x")])
    c1.sync([ord("x"), ord("y")])
    assert c1.fed == 2 and not c1.broken and not c1.finished
    with pytest.raises(RequestError, match="shorter"):
        c1.sync([ord("x")])


def test_adjust_logits_masks_only_the_rows_with_a_grammar(grammars):
    x = torch.randn(3, V)
    sp = SamplingParams(grammar=TINY)
    plain = SamplingParams()
    hist = [TokenHistory([1, 2, ord("a")], 2), TokenHistory([1, 2], 2), TokenHistory([1, 2], 2)]
    out = adjust_logits(x, [sp, plain, sp], [1, 0, 0], hist, EOS,
                        [grammars.constraint(TINY), None, grammars.constraint(TINY)])
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == {ord("b"), ord("c")}
    assert torch.equal(out[1], x[1])
    assert torch.equal(out[2] == x[2], torch.isfinite(out[2]))
    assert adjust_logits(x, [plain] * 3, [0] * 3, hist, EOS, [None] * 3) is x


def test_sampling_params_bound_the_grammar():
    assert SamplingParams(grammar=["regex", "a+"]).grammar == ("regex", "a+")
    for bad, what in ((("lark", "x"), "kind"), (("regex", ""), "1 to"),
                      (("regex", "a" * (MAX_GRAMMAR_CHARS + 1)), "1 to"),
                      (("regex",), "two strings")):
        with pytest.raises(FieldError, match=what) as e:
            SamplingParams(grammar=bad)
        assert e.value.field == "grammar"
    with pytest.raises(FieldError, match="ignore_eos"):
        SamplingParams(grammar=TINY, ignore_eos=True)
    with pytest.raises(FieldError, match="min_tokens"):
        SamplingParams(grammar=TINY, min_tokens=1, max_tokens=4)


def test_check_spec_says_why():
    check_spec("json_schema", json.dumps({"type": "object"}))
    with pytest.raises(ValueError):
        check_spec("json_schema", "{not json")
    with pytest.raises(ValueError):
        check_spec("ebnf", "root ::= (")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "n", "ok"], "additionalProperties": False}


def test_the_random_tiny_model_ends_with_valid_json_and_max_tokens_still_caps():
    m = build_tiny(0, "float32", "cpu")
    eng = TorchEngine(m, m.spec, EngineConfig(num_blocks=256, max_num_batched_tokens=512), m.dtype,
                      tokenizer=ByteTokenizer(m.spec.vocab_size))
    spec = ("json_schema", json.dumps(SCHEMA))
    for seed in range(4):
        eng.add_request(EngineRequest(f"r{seed}", tuple(b"hello"), SamplingParams(max_tokens=200, temperature=1.0,
                                                                                 seed=seed, grammar=spec)))
    eng.add_request(EngineRequest("short", tuple(b"hello"), SamplingParams(max_tokens=5, temperature=1.0,
                                                                           grammar=spec)))
    outs: dict[str, list[int]] = {}
    reasons = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.ids)
            if o.done:
                reasons[o.request_id] = o.reason
    for seed in range(4):
        toks = outs[f"r{seed}"]
        assert reasons[f"r{seed}"] == "stop" and toks[-1] in EOS
        obj = json.loads(bytes(toks[:-1]))
        assert set(obj) == {"city", "n", "ok"} and len(obj["city"]) <= 8 and 0 <= obj["n"] <= 99
        assert isinstance(obj["ok"], bool)
    assert reasons["short"] == "length" and len(outs["short"]) == 5 and bytes(outs["short"]).startswith(b'{"')
    no_vocab = TorchEngine(m, m.spec, EngineConfig(num_blocks=64), m.dtype)
    with pytest.raises(RequestError, match="no vocabulary"):
        no_vocab.add_request(EngineRequest("x", (1, 2), SamplingParams(grammar=spec)))
