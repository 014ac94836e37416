"""One SamplingParams on the wire: nested in Submit / Prefill, round trip exact, every bound refused by name."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from pddgw.core.sampling import SamplingParams
from pddgw.net import frames
from pddgw.net.errors import FrameError
from pddgw import messages as m

FULL = SamplingParams(max_tokens=9, temperature=0.7, top_k=5, top_p=0.9, seed=2**63 - 1, stop_token_ids=(3, 4),
                      ignore_eos=True, min_p=0.05, logprobs=2, repetition_penalty=1.25, presence_penalty=-0.5,
                      frequency_penalty=1.5, logit_bias={"7": -100, 2: 0.125}, min_tokens=4,
                      skip_special_tokens=False, include_stop_str_in_output=True, prompt_logprobs=3)
# A grammar excludes ignore_eos and min_tokens, so it crosses in a second message.
GRAMMAR = SamplingParams(max_tokens=9, seed=5, grammar=("json_schema", '{"type": "object"}'))


def submit(sp: SamplingParams = FULL) -> m.Submit:
    return m.Submit(request_id="r", kv="import", hold=False, prompt=(1, 2), sampling=sp)


def test_every_field_differs_from_its_default_and_crosses_the_wire_whole():
    default = SamplingParams()
    assert all(getattr(FULL, f.name) != getattr(default, f.name) for f in dataclasses.fields(SamplingParams)
               if f.name != "grammar")
    for sp in (FULL, GRAMMAR):
        for msg in (submit(sp), m.Prefill(request_id="r", targets=("md0",), starts=(0,), prompt=(1, 2),
                                           holds=(False,), sampling=sp)):
            got = frames.decode(frames.encode_bytes(msg)).msg
            assert got == msg and got.sampling == sp and type(got.sampling) is SamplingParams
    assert GRAMMAR.grammar != default.grammar
    assert FULL.logit_bias == ((2, 0.125), (7, -100.0))
    # Nested as one object, in field order (deterministic bytes).
    meta = _meta(frames.encode_bytes(submit()))
    assert list(meta["sampling"]) == [f.name for f in dataclasses.fields(SamplingParams)]
    assert meta["sampling"]["logit_bias"] == [[2, 0.125], [7, -100.0]]


def _meta(frame: bytes) -> dict:
    head = frames.parse_head(frame)
    return orjson.loads(frame[frames.HEADER_SIZE : frames.HEADER_SIZE + head.meta_len])


def _with_meta(frame: bytes, meta: dict) -> bytes:
    head = frames.parse_head(frame)
    raw = orjson.dumps(meta)
    payload = frame[frames.HEADER_SIZE + head.meta_len :]
    return frames.HEADER.pack(frames.MAGIC, frames.VERSION, head.kind, head.flags, 0, len(raw), head.corr, head.seq,
                              len(payload)) + raw + payload


def _decode_with(**sampling) -> str:
    frame = frames.encode_bytes(submit())
    meta = _meta(frame)
    meta["sampling"] = {**meta["sampling"], **sampling}
    with pytest.raises(FrameError) as ei:
        frames.decode(_with_meta(frame, meta))
    return str(ei.value)


@pytest.mark.parametrize("field,value,bound", [
    ("max_tokens", 0, "max_tokens must be an integer in [1, 2147483648)"),
    ("max_tokens", 1.0, "max_tokens must be an integer in [1, 2147483648)"),
    ("temperature", 2.5, "temperature must be a number in [0, 2]"),
    ("temperature", "hot", "temperature must be a number in [0, 2]"),
    ("top_k", -2, "top_k must be an integer in [-1, 2147483648)"),
    ("top_p", 0, "top_p must be a number in (0, 1]"),
    ("seed", 2**63, "seed must be an integer in [0, 9223372036854775808)"),
    ("stop_token_ids", [1, 2**31], "stop_token_ids must be token ids in [0, 2147483648)"),
    ("stop_token_ids", list(range(65)), "stop_token_ids must be a list of at most 64 token ids"),
    ("ignore_eos", 1, "ignore_eos must be a boolean"),
    ("min_p", 1.5, "min_p must be a number in [0, 1]"),
    ("logprobs", 21, "logprobs must be null or an integer in [0, 20]"),
    ("repetition_penalty", 0, "repetition_penalty must be a finite number > 0"),
    ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be a number in [-2, 2]"),
    ("logit_bias", [[1, 101]], "logit_bias must be biases in [-100, 100]"),
    ("logit_bias", [[-1, 1]], "logit_bias must be keyed by token ids in [0, 2147483648)"),
    ("logit_bias", [[1, 1], [1, 2]], "logit_bias must be keyed by distinct token ids"),
    ("logit_bias", [[1, 2, 3]], "logit_bias must be an object of token id -> bias (or [id, bias] pairs)"),
    ("min_tokens", 10, "min_tokens must be <= max_tokens (9)"),
    ("min_tokens", -1, "min_tokens must be an integer in [0, 2147483648)"),
    ("skip_special_tokens", None, "skip_special_tokens must be a boolean"),
    ("include_stop_str_in_output", "yes", "include_stop_str_in_output must be a boolean"),
    ("prompt_logprobs", 21, "prompt_logprobs must be null or an integer in [0, 20]"),
    ("grammar", "x", "grammar must be null or [kind, text] (two strings)"),
    ("grammar", ["json_schema", "{}"], "grammar must be absent with ignore_eos"),
])
def test_each_out_of_range_value_is_refused_naming_its_field_and_bound(field, value, bound):
    assert _decode_with(**{field: value}).startswith(f"Submit.sampling: {bound}")


def test_every_field_has_a_refusal_above():
    named = {p[0] for p in test_each_out_of_range_value_is_refused_naming_its_field_and_bound.pytestmark[0].args[1]}
    assert named == {f.name for f in dataclasses.fields(SamplingParams)}


def test_the_nested_object_must_have_exactly_its_fields():
    assert _decode_with(bogus=1) == "Submit.sampling: missing [], unknown ['bogus']"
    frame = frames.encode_bytes(submit())
    meta = _meta(frame)
    del meta["sampling"]["seed"]
    with pytest.raises(FrameError, match=r"Submit.sampling: missing \['seed'\], unknown \[\]"):
        frames.decode(_with_meta(frame, meta))
    for bad in ([1, 2], "x", None):
        meta["sampling"] = bad
        with pytest.raises(FrameError, match="Submit.sampling must be a JSON object"):
            frames.decode(_with_meta(frame, meta))
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        m.Submit(request_id="r", kv="import", hold=False, prompt=(1,), sampling={"max_tokens": 3})
