"""Responses API event decoding: every bad field is named, good events are typed."""

from dataclasses import replace

import orjson
import pytest

from pddgw.api.responses import ApiError, CancelResponse, CreateResponse, parse_client_event
from pddgw.api.responses_format import completed_event, delta_event, error_event, response_object
from pddgw.core.sampling import COUNT_LIMIT, SamplingParams


def unseeded(sp: SamplingParams) -> SamplingParams:
    """A drawn seed (in range) as 0, to compare with an expected value."""
    assert 0 <= sp.seed < 2**63
    return replace(sp, seed=0)


def ev(**d):
    return orjson.dumps({"type": "response.create", **d})


def test_create_with_text_input():
    e = parse_client_event(ev(input="hi", instructions="be brief", max_output_tokens=5, seed=7,
                              temperature=0.5, metadata={"k": "v"}, stream_id="s1"), 100)
    assert isinstance(e, CreateResponse)
    assert e.messages == (("system", "be brief"), ("user", "hi"))
    assert (e.max_output_tokens, e.sampling) == (5, SamplingParams(max_tokens=5, temperature=0.5, seed=7))
    assert e.metadata == {"k": "v"} and e.stream_id == "s1" and e.prompt_token_ids is None


def test_create_with_message_items_and_token_ids():
    items = [{"type": "message", "role": "developer", "content": "sys"},
             {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}]
    e = parse_client_event(ev(input=items), 100)
    assert e.messages == (("system", "sys"), ("user", "ab"), ("assistant", "c"))
    e = parse_client_event(ev(prompt_token_ids=[1, 2, 3]), 100)
    assert e.prompt_token_ids == (1, 2, 3) and e.messages == ()


@pytest.mark.parametrize("raw,param,msg", [
    (b"{not json", None, "not valid JSON"),
    (b"[1]", None, "JSON object"),
    (orjson.dumps({"type": "bogus"}), "type", "unknown event type 'bogus'"),
    (ev(input="x", frobnicate=1), "frobnicate", "unsupported field"),
    (ev(input=3), "input", "'input' must be"),
    (ev(input=[{"role": "robot", "content": "x"}]), "input[0]", "role must be"),
    (ev(prompt_token_ids=[1, -2]), "prompt_token_ids", "non-negative"),
    (ev(prompt_token_ids=list(range(11))), "prompt_token_ids", "context length is 10"),
    (ev(prompt_token_ids=[1], input="x"), "prompt_token_ids", "not both"),
    (ev(input="x", max_output_tokens=0), "max_output_tokens", "positive integer"),
    (ev(input="x", temperature=3), "temperature", "temperature must be a number in [0, 2], got 3"),
    (ev(input="x", repetition_penalty=-1), "repetition_penalty", "repetition_penalty must be a finite number > 0"),
    (ev(input="x", logit_bias={"3": "a"}), "logit_bias", "logit_bias must be biases in [-100, 100], got 'a'"),
    (ev(input="x", max_output_tokens=4, min_tokens=5), "min_tokens", "min_tokens must be <= max_tokens (4)"),
    (ev(input="x", seed=-1), "seed", "seed"),
    (ev(input="x", top_k=-2), "top_k", "top_k must be an integer in [-1, 2147483648) (-1 or 0: no filter), got -2"),
    (ev(input="x", top_k=True), "top_k", "top_k must be an integer in [-1, 2147483648)"),
    (ev(input="x", min_p=1.5), "min_p", "min_p must be a number in [0, 1], got 1.5"),
    (ev(input="x", min_p="x"), "min_p", "min_p must be a number in [0, 1], got 'x'"),
    (ev(input="x", metadata={"a": 1}), "metadata", "metadata"),
    (ev(input="x", stream=True), "stream", "implicit"),
    (orjson.dumps({"type": "response.cancel"}), "response_id", "response_id"),
])
def test_bad_events_name_the_problem(raw, param, msg):
    with pytest.raises(ApiError, match=None) as ei:
        parse_client_event(raw, 10)
    assert msg in str(ei.value)
    assert ei.value.param == param


@pytest.mark.parametrize("item,param,msg", [
    ({"role": "user", "content": 3}, "input[0].content", "input[0].content must be a string or a list of text parts"),
    ({"role": "user", "content": [{"type": "input_text", "text": "a"}, "b"]}, "input[0].content",
     "input[0].content[1] must be a text part (input_text or output_text)"),
    ({"role": "user", "content": [{"type": "image", "text": "a"}]}, "input[0].content",
     "input[0].content[0] must be a text part (input_text or output_text)"),
    ({"role": "user", "content": [{"type": "text", "text": 1}]}, "input[0].content",
     "input[0].content[0].text must be a string"),
    ({"type": "function_call_output", "call_id": "c1", "output": [{"type": "output_text"}]}, "input[0].output",
     "input[0].output[0].text must be a string"),
])
def test_bad_content_parts_are_named_exactly(item, param, msg):
    with pytest.raises(ApiError) as ei:
        parse_client_event(ev(input=[item]), 100)
    assert (str(ei.value), ei.value.param) == (msg, param)


def test_create_with_top_k_and_min_p():
    base = SamplingParams(max_tokens=COUNT_LIMIT - 1, temperature=1.0)
    assert unseeded(parse_client_event(ev(input="x", top_k=40, min_p=0.05), 10).sampling) == replace(
        base, top_k=40, min_p=0.05)
    assert unseeded(parse_client_event(ev(input="x", top_k=-1), 10).sampling) == base       # vLLM's "no filter"
    got = parse_client_event(ev(input="x", repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5,
                                logit_bias={"9": 5}, min_tokens=3, ignore_eos=True, stop_token_ids=[4],
                                skip_special_tokens=False, include_stop_str_in_output=True, seed=1), 10).sampling
    assert got == replace(base, seed=1, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5,
                          logit_bias=((9, 5.0),), min_tokens=3, ignore_eos=True, stop_token_ids=(4,),
                          skip_special_tokens=False, include_stop_str_in_output=True)
    # Not OpenAI fields: the response object echoes temperature and top_p only.
    obj = response_object("resp_1", "in_progress", 1, "tiny", parse_client_event(ev(input="x", top_k=3), 10))
    assert (obj["temperature"], obj["top_p"]) == (1.0, 1.0) and "top_k" not in obj and "min_p" not in obj


def test_cancel():
    e = parse_client_event(orjson.dumps({"type": "response.cancel", "response_id": "resp_1"}), 10)
    assert e == CancelResponse("response.cancel", "resp_1")


def test_what_the_answer_carries_is_asked_for():
    e = parse_client_event(ev(input="x"), 10)
    assert (e.return_token_ids, e.states) == (False, False)
    e = parse_client_event(ev(input="x", return_token_ids=True, pddgw={"states": True, "pipeline": "P-MD"}), 10)
    assert (e.return_token_ids, e.states, e.pipeline) == (True, True, "P-MD")
    for bad, param in (({"return_token_ids": "true"}, "return_token_ids"), ({"pddgw": {"states": 1}}, "pddgw.states")):
        with pytest.raises(ApiError) as ei:
            parse_client_event(ev(input="x", **bad), 10)
        assert ei.value.param == param and str(ei.value) == f"'{param}' must be a boolean"


def test_server_events_shape():
    req = parse_client_event(ev(input="hi", metadata={"m": "1"}), 10)
    d = orjson.loads(delta_event(3, "s", "resp_1", "ab", 4, [97, 98], "rld"))
    assert d == {"type": "response.output_text.delta", "sequence_number": 3, "stream_id": "s",
                 "response_id": "resp_1", "item_id": "msg_resp_1", "output_index": 0,
                 "content_index": 0, "delta": "ab",
                 "pddgw": {"position": 4, "token_ids": [97, 98], "role": "rld"}}
    # Token ids not asked for: the delta says where its tokens sit and who made them.
    assert orjson.loads(delta_event(3, "s", "resp_1", "ab", 4, None, "rld"))["pddgw"] == {"position": 4, "role": "rld"}
    obj = response_object("resp_1", "completed", 1, "tiny", req, text="ab",
                          usage={"input_tokens": 2}, pddgw={"pipeline": "P-MD"})
    c = orjson.loads(completed_event(9, None, obj))
    assert c["type"] == "response.completed" and "stream_id" not in c
    assert c["response"]["output"][0]["content"][0]["text"] == "ab"
    assert c["response"]["metadata"] == {"m": "1"} and c["response"]["pddgw"] == {"pipeline": "P-MD"}
    e = orjson.loads(error_event(1, None, "bad", param="seed", response_id="r"))
    assert e["error"] == {"type": "invalid_request_error", "code": "invalid_request_error",
                          "message": "bad", "param": "seed"} and e["response_id"] == "r"


def test_incremental_detokenizer_matches_full_decode():
    from pddgw.api.door import Detokenizer
    from pddgw.engines.tokenizer import ByteTokenizer

    tok = ByteTokenizer(384)
    ids = tok.encode("héllo wörld — ✓ done") + [tok.EOS] + tok.encode(" ünïcode")
    d = Detokenizer(tok)
    pieces = [d.push((t,)) for t in ids]
    assert "".join(pieces) == tok.decode(ids)
    # A multi-byte character split across pushes is held back until complete.
    d2 = Detokenizer(tok)
    check = tok.encode("✓")
    assert [d2.push((t,)) for t in check] == ["", "", "✓"]


@pytest.mark.parametrize("field,value", [("metadata", 0), ("metadata", ""), ("metadata", []), ("metadata", False),
                                         ("pddgw", False), ("pddgw", 0), ("store", "yes"), ("store", 1)])
def test_falsy_and_wrong_typed_fields_are_not_taken_as_absent(field, value):
    with pytest.raises(ApiError) as ei:
        parse_client_event(ev(input="x", **{field: value}), 10)
    assert ei.value.param == field
    assert parse_client_event(ev(input="x", store=True, metadata=None, pddgw=None), 10).metadata == {}


def test_error_carries_the_events_own_valid_stream_id():
    def stream_of(raw):
        with pytest.raises(ApiError) as ei:
            parse_client_event(raw, 10)
        return ei.value.stream_id

    assert stream_of(ev(input="x", seed=-1, stream_id="s9")) == "s9"
    assert stream_of(orjson.dumps({"type": "nope", "stream_id": "s9"})) == "s9"
    assert stream_of(ev(input="x", stream_id="s" * 129)) is None
    assert stream_of(ev(input="x", seed=-1, stream_id=7)) is None
    assert stream_of(b"[]") is None


@pytest.mark.parametrize("raw,param", [
    (orjson.dumps({"type": "t" * 100_000}), "type"),
    (ev(input="x", temperature=list(range(100_000))), "temperature"),
    (ev(input="x", metadata={"k" * 100_000: "v"}), "metadata"),
    (ev(input="x", **{f"f{i}" + "x" * 1000: 1 for i in range(100)}), "f0" + "x" * 62),
])
def test_error_messages_quote_client_input_briefly(raw, param):
    with pytest.raises(ApiError) as ei:
        parse_client_event(raw, 10)
    assert len(str(ei.value)) < 400
    assert ei.value.param == param
