"""Tools and structured output at the OpenAI door, on the random tiny model (the built-in
template: plain-JSON calls), streamed and not, through the openai client."""

from __future__ import annotations

import json

import pytest


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def valid_args(args: str) -> dict:
    obj = json.loads(args)
    assert set(obj) == {"city", "unit"} and isinstance(obj["city"], str) and len(obj["city"]) <= 6
    assert obj["unit"] in ("c", "f")
    return obj


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_a_forced_call_is_valid_and_streamed_deltas_reassemble_it(deployment, choice):
    _, _, oai = await deployment()
    kw = dict(model="pddgw-tiny", messages=MESSAGES, tools=[WEATHER, OTHER] if choice != "required" else [WEATHER],
              tool_choice=choice, max_tokens=120, seed=3, temperature=1.0)
    r = await oai.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    [call] = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    want = valid_args(call.function.arguments)
    names, args, ids, finish = {}, {}, {}, None
    async for chunk in await oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                if d.id:
                    ids[d.index] = d.id
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                if d.function and d.function.arguments:
                    args[d.index] = args.get(d.index, "") + d.function.arguments
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and names == {0: "get_weather"} and json.loads(args[0]) == want
    assert ids[0].startswith("call_")


async def test_tool_messages_in_the_history_are_rendered(deployment):
    side, _, oai = await deployment()
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = await oai.chat.completions.create(model="pddgw-tiny", messages=history, tools=[WEATHER], max_tokens=4, seed=1)
    text = side.door.tok.decode(side.door.tok.apply_chat_template(
        [{"role": m["role"], "content": m.get("content") or "", **{k: m[k] for k in ("tool_calls", "tool_call_id")
                                                                   if k in m}} for m in history[:1]],
        tools=[WEATHER]))
    assert '"name": "get_weather"' in text and r.usage.prompt_tokens > len(text)


@pytest.mark.parametrize("stream", [False, True])
async def test_response_format_json_schema_and_json_object(deployment, stream):
    _, _, oai = await deployment()
    schema = WEATHER["function"]["parameters"]
    for fmt, check in (({"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}},
                        lambda t: valid_args(t)),
                       ({"type": "json_object"}, lambda t: isinstance(json.loads(t), dict))):
        kw = dict(model="pddgw-tiny", messages=MESSAGES, response_format=fmt, max_tokens=300, seed=11, temperature=1.0)
        if stream:
            text, finish = "", None
            async for chunk in await oai.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
        else:
            r = await oai.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop"
        assert check(text)


async def test_bad_tools_name_the_field(deployment):
    _, client, _ = await deployment()
    from tests.api.deployment import KEY
    h = {"Authorization": f"Bearer {KEY}"}
    for body, param in (({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"response_format": {"type": "xml"}}, "response_format.type"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
                         "response_format")):
        resp = await client.post("/v1/chat/completions", json={"messages": MESSAGES, **body}, headers=h)
        assert resp.status == 400, await resp.text()
        assert (await resp.json())["error"]["param"] == param
