"""Tools and structured output on the Responses API (HTTP, SSE and WebSocket mode), on the random
tiny model (the built-in template: plain-JSON calls), through the openai client where it has them."""

from __future__ import annotations

import json

import orjson
import pytest

from tests.api.deployment import KEY
from tests.api.test_tools import WEATHER, valid_args

# The Responses API's flat tool shape.
TOOL = {"type": "function", "strict": True, **WEATHER["function"]}
NOOP = {"type": "function", "name": "noop", "parameters": {"type": "object", "properties": {}}}
MODEL = "pddgw-tiny"


def one_call(r) -> object:
    """The response's only output item, a function_call -> it (checked against OpenAI's shape)."""
    [item] = r.output
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    valid_args(item.arguments)
    return item


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
async def test_a_forced_call_is_a_function_call_item_and_its_stream_reassembles_it(deployment, choice):
    _, _, oai = await deployment()
    kw = dict(model=MODEL, input="weather in Paris?", tools=[TOOL] if choice == "required" else [TOOL, NOOP],
              tool_choice=choice, max_output_tokens=120, temperature=1.0, extra_body={"seed": 3})
    r = await oai.responses.create(**kw)
    assert r.status == "completed" and r.output_text == ""
    item = one_call(r)
    assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "get_weather"
    assert [t.name for t in r.tools] == [t["name"] for t in kw["tools"]]

    events = [e async for e in await oai.responses.create(stream=True, **kw)]
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    added, done, final = events[2].item, events[-2].item, events[-1].response
    assert added.type == "function_call" and added.status == "in_progress" and added.arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == done.arguments and events[-3].name == "get_weather"
    assert {e.item_id for e in events[3:-2]} == {added.id} and {e.output_index for e in events[2:-1]} == {0}
    # The same seed and prompt: the same call as the non-streamed one; the final response repeats the item.
    assert json.loads(args) == json.loads(item.arguments)
    assert one_call(final).call_id == done.call_id == added.call_id


async def test_parallel_calls_may_be_several_items(deployment):
    _, _, oai = await deployment()
    r = await oai.responses.create(model=MODEL, input="weather?", tools=[TOOL], tool_choice="required",
                                   parallel_tool_calls=True, max_output_tokens=200, temperature=1.0,
                                   extra_body={"seed": 5})
    assert r.parallel_tool_calls is True and r.output
    assert all(o.type == "function_call" and o.name == "get_weather" for o in r.output)
    assert len({o.call_id for o in r.output}) == len(r.output)
    for o in r.output:
        valid_args(o.arguments)


@pytest.mark.parametrize("stream", [False, True])
async def test_text_format_json_schema_and_json_object(deployment, stream):
    _, _, oai = await deployment()
    schema = WEATHER["function"]["parameters"]
    for fmt, check in (({"type": "json_schema", "name": "w", "schema": schema, "strict": True}, valid_args),
                       ({"type": "json_object"}, lambda t: isinstance(json.loads(t), dict))):
        kw = dict(model=MODEL, input="weather?", text={"format": fmt}, max_output_tokens=300, temperature=1.0,
                  extra_body={"seed": 11})
        if stream:
            events = [e async for e in await oai.responses.create(stream=True, **kw)]
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            final = events[-1].response
            assert final.output_text == text
        else:
            final = await oai.responses.create(**kw)
            text = final.output_text
        assert final.status == "completed" and final.text.format.type == fmt["type"]
        check(text)


async def test_tool_choice_none_and_auto_leave_the_text_free(deployment):
    side, _, oai = await deployment()
    base = dict(model=MODEL, input="hi", max_output_tokens=6, temperature=0)
    plain = await oai.responses.create(**base)
    none = await oai.responses.create(tools=[TOOL], tool_choice="none", **base)
    # "none": the template gets no tools (vLLM's behaviour), so the prompt and output are the plain ones.
    assert none.output_text == plain.output_text and none.usage.input_tokens == plain.usage.input_tokens
    auto = await oai.responses.create(tools=[TOOL], **base, extra_body={"return_token_ids": True})
    assert auto.usage.input_tokens > plain.usage.input_tokens       # the tools are in the prompt
    assert [o.type for o in auto.output] == ["message"]               # random text: no call in it
    assert auto.output_text == side.door.tok.decode(auto.pddgw["output_token_ids"])


async def test_a_second_turn_with_the_function_call_and_its_output(deployment):
    side, _, oai = await deployment()
    first = await oai.responses.create(model=MODEL, input="weather in Paris?", tools=[TOOL], tool_choice="required",
                                       max_output_tokens=120, temperature=1.0, extra_body={"seed": 3})
    call = one_call(first)
    history = [{"role": "user", "content": "weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
    second = await oai.responses.create(model=MODEL, input=history, tools=[TOOL], max_output_tokens=4,
                                        temperature=0)
    tok = side.door.tok
    want = tok.apply_chat_template(
        [{"role": "user", "content": "weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": call.call_id, "type": "function",
              "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}]},
         {"role": "tool", "content": "21 C", "tool_call_id": call.call_id}],
        tools=[WEATHER])
    assert second.status == "completed" and second.usage.input_tokens == len(want)
    assert "21 C" in tok.decode(want) and call.arguments.replace(" ", "") in tok.decode(want).replace(" ", "")


async def ws_events(client, **fields) -> list[dict]:
    ws = await client.ws_connect("/v1/responses", headers={"Authorization": f"Bearer {KEY}"})
    await ws.send_str(orjson.dumps({"type": "response.create", **fields}).decode())
    events = []
    while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] not in ("response.completed", "error"):
        events.append(ev)
    await ws.close()
    return [*events, ev]


async def test_websocket_mode_streams_the_call_items_before_completed(deployment):
    _, client, oai = await deployment()
    fields = dict(model=MODEL, input="weather in Paris?", tools=[TOOL], tool_choice="required",
                  max_output_tokens=120, temperature=1.0, seed=3)
    events = await ws_events(client, **fields, return_token_ids=True)
    http = await oai.responses.create(**{k: v for k, v in fields.items() if k != "seed"}, extra_body={"seed": 3})
    final = events[-1]
    assert final["type"] == "response.completed", final
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    # The text is held back (the deltas carry their tokens only), then the call's items.
    assert {d["delta"] for d in deltas} == {""}
    assert [t for d in deltas for t in d["pddgw"]["token_ids"]] == final["response"]["pddgw"]["output_token_ids"]
    items = [e["type"] for e in events[len(deltas) + 1:-1]]
    assert items[0] == "response.output_item.added" and items[-2:] == ["response.function_call_arguments.done",
                                                                       "response.output_item.done"]
    [item] = final["response"]["output"]
    assert item["type"] == "function_call" and item == events[-2]["item"]
    assert json.loads(item["arguments"]) == json.loads(one_call(http).arguments)   # same seed, same call


async def test_bad_tools_and_formats_name_the_field(deployment):
    _, client, _ = await deployment()
    h = {"Authorization": f"Bearer {KEY}"}
    for body, param in (({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
                        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
                        ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nonsense"}}}},
                         "text.format"),
                        ({"tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
                         "text.format"),
                        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
                         "input[0].arguments"),
                        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id")):
        resp = await client.post("/v1/responses", json={"input": "hi", **body}, headers=h)
        assert resp.status == 400, await resp.text()
        assert (await resp.json())["error"]["param"] == param, body
    # The node keeps serving.
    resp = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}, headers=h)
    assert resp.status == 200


def test_function_call_items_join_the_assistant_message_before_them():
    from pddgw.api.responses import parse_create_body

    req, _ = parse_create_body({"instructions": "sys", "input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "noop", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]}],
        "tools": [TOOL, NOOP], "tool_choice": {"type": "function", "name": "noop"},
        "parallel_tool_calls": False}, 1000)
    assert req.chat == (
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": {}}}]},
        {"role": "tool", "content": "3 C", "tool_call_id": "c1"},
        {"role": "tool", "content": "ok", "tool_call_id": "c2"})
    assert (req.tools.choice, req.tools.parallel, [t.name for t in req.tools.tools]) == ("noop", False,
                                                                                         ["get_weather", "noop"])
    assert req.sampling.grammar is None         # the forced call's grammar is the door's (the template's format)
    plain, _ = parse_create_body({"input": "hi", "text": {"format": {"type": "json_object"}}}, 1000)
    assert (plain.chat, plain.tools, plain.sampling.grammar) == (None, None, ("json_schema", '{"type": "object"}'))
