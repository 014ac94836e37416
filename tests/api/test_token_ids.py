"""What an answer carries: lean by default, token ids with vLLM's `return_token_ids`, the state
timeline with `pddgw.states`, the output's role spans; and a grammar refused on a model without EOS.

Raw HTTP and WebSocket against the embedded deployment (the tiny model in float64: greedy
outputs equal one local engine's, `reference`), so the check sees exactly which fields are
there, in which chunk.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pddgw.engines.tokenizer import ByteTokenizer
from tests.api.deployment import ADMIN, KEY
from tests.pipeline.pdd_client import reference

MESSAGES = [{"role": "user", "content": "Name a colour."}]
PROMPT = [40 + (i * 7) % 80 for i in range(50)]
# The `pddgw` summary of the final chunk / event and the object: O(1) fields only.
SUMMARY = {"request_id", "pipeline", "planned_pipeline", "route_reason", "final_state", "handoff_mode",
           "handoff_positions", "handoff_position", "ttft_ms", "total_ms", "wan_kv_bytes", "handoff_stall_ms",
           "max_itl_ms", "max_itl_position", "output_tokens", "tokens_by_role", "fallback_reason", "redrives",
           "error", "seed", "finish_reason"}
ID_KEYS = {"token_ids", "prompt_token_ids", "output_token_ids"}


async def post(client, route: str, body: dict, key: str = KEY) -> tuple[int, Any]:
    """-> (status, the JSON object, or the SSE stream's data events; chat and completions end theirs
    with [DONE], left out)."""
    r = await client.post(f"/v1/{route}", json=body, headers={"Authorization": f"Bearer {key}"})
    if not body.get("stream") or r.status != 200:
        return r.status, await r.json()
    data = [line.removeprefix("data: ") for line in (await r.text()).split("\n") if line.startswith("data: ")]
    if route != "responses":
        assert data.pop() == "[DONE]"
    return r.status, [orjson.loads(d) for d in data]


def keys_in(obj: Any) -> set[str]:
    """Every key anywhere in a JSON value."""
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in keys_in(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in keys_in(v)}
    return set()


def check_spans(spans: list[dict], n: int) -> None:
    """Every output position once, in order: the spans tile [0, n), neighbours of different roles."""
    assert [s["start"] for s in spans] == [sum(x["count"] for x in spans[:i]) for i in range(len(spans))]
    assert sum(s["count"] for s in spans) == n and all(s["count"] > 0 for s in spans)
    assert all(a["role"] != b["role"] for a, b in zip(spans, spans[1:]))


# ---- return_token_ids ----------------------------------------------------------------------


async def test_chat_return_token_ids_streamed_and_not(deployment):
    side, client, _ = await deployment()
    tok = side.door.tok
    ids = tok.apply_chat_template([(m["role"], m["content"]) for m in MESSAGES])
    ref = reference(ids, 16)
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    status, obj = await post(client, "chat/completions", body)
    assert status == 200, obj
    [ch] = obj["choices"]
    assert obj["prompt_token_ids"] == ids and ch["token_ids"] == obj["pddgw"]["output_token_ids"] == ref
    assert ch["message"]["content"] == tok.decode(ch["token_ids"])
    assert set(obj["pddgw"]) == SUMMARY | {"output_token_ids", "spans"}

    status, chunks = await post(client, "chat/completions", {**body, "stream": True})
    assert status == 200, chunks
    role, *rest = chunks
    # vLLM's places: the prompt's ids in the role chunk only, each later chunk its own output ids.
    assert role["prompt_token_ids"] == ids and "token_ids" not in role["choices"][0]
    assert all("prompt_token_ids" not in c for c in rest)
    streamed = [t for c in rest for t in c["choices"][0]["token_ids"]]
    assert streamed == ch["token_ids"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in rest) == tok.decode(streamed)
    deltas = [c for c in rest if "position" in c.get("pddgw", {})]
    assert [c["pddgw"]["token_ids"] for c in deltas] == [c["choices"][0]["token_ids"] for c in deltas]
    assert [c["pddgw"]["position"] for c in deltas] == [
        sum(len(d["pddgw"]["token_ids"]) for d in deltas[:i]) for i in range(len(deltas))]
    final = rest[-1]
    assert final["choices"][0]["finish_reason"] is not None and final["choices"][0]["token_ids"] == []
    assert final["pddgw"]["output_token_ids"] == ref and set(final["pddgw"]) == SUMMARY | {"output_token_ids"}


async def test_chat_return_token_ids_with_n_choices(deployment):
    """Each choice's ids; streamed, each choice's role chunk carries the prompt's (vLLM's)."""
    side, client, _ = await deployment()
    ids = side.door.tok.apply_chat_template([(m["role"], m["content"]) for m in MESSAGES])
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0.9, "seed": 4, "ignore_eos": True,
            "return_token_ids": True}
    singles = [(await post(client, "chat/completions", {**body, "seed": 4 + i}))[1] for i in range(2)]
    _, obj = await post(client, "chat/completions", {**body, "n": 2})
    assert obj["prompt_token_ids"] == ids
    assert [c["token_ids"] for c in obj["choices"]] == [s["choices"][0]["token_ids"] for s in singles]
    assert [c["pddgw"]["output_token_ids"] for c in obj["choices"]] == [c["token_ids"] for c in obj["choices"]]
    _, chunks = await post(client, "chat/completions", {**body, "n": 2, "stream": True})
    for i in range(2):
        mine = [c for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine[1:] for t in c["choices"][0]["token_ids"]] == obj["choices"][i]["token_ids"]


async def test_chat_return_token_ids_with_a_tool_call(deployment):
    """The text is held back while a call may come; the tokens are not: each streamed chunk still
    carries its own, and together they are the non-streamed ones."""
    side, client, _ = await deployment()
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}}}
    body = {"messages": MESSAGES, "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 60, "temperature": 0, "return_token_ids": True}
    _, obj = await post(client, "chat/completions", body)
    [ch] = obj["choices"]
    assert ch["finish_reason"] == "tool_calls" and ch["token_ids"] == obj["pddgw"]["output_token_ids"]
    assert orjson.loads(side.door.tok.decode(ch["token_ids"]))["name"] == "get_weather"
    _, chunks = await post(client, "chat/completions", {**body, "stream": True})
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == ch["token_ids"]
    calls = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert calls and all(c["choices"][0]["token_ids"] == [] for c in calls)


async def test_completions_return_token_ids_streamed_and_not(deployment):
    side, client, _ = await deployment()
    tok = side.door.tok
    text = "Once upon a time"
    ids = tok.encode(text)
    ref = reference(ids, 12)
    body = {"prompt": text, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    _, obj = await post(client, "completions", body)
    [ch] = obj["choices"]
    assert ch["prompt_token_ids"] == ids and ch["token_ids"] == obj["pddgw"]["output_token_ids"] == ref
    assert ch["text"] == tok.decode(ref) and "prompt_token_ids" not in obj
    # Token-id prompts and n = 2 streamed: each choice's first chunk carries the prompt's ids.
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": 8, "ignore_eos": True,
            "return_token_ids": True}
    _, whole = await post(client, "completions", {**body, "n": 2})
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [PROMPT, PROMPT]
    _, chunks = await post(client, "completions", {**body, "n": 2, "stream": True})
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in c for c in mine[1:])
        streamed = [t for c in mine for t in c["token_ids"]]
        assert streamed == whole["choices"][i]["token_ids"]
        assert "".join(c["text"] for c in mine) == tok.decode(streamed) == whole["choices"][i]["text"]


async def test_completions_echo_with_return_token_ids(deployment):
    """Echo keeps its text (the prompt, then the output); the ids are vLLM's: the prompt's apart,
    `token_ids` the output's only.  Echo with max_tokens 0 scores the prompt: no output ids."""
    side, client, _ = await deployment()
    tok = side.door.tok
    text = "The quick brown fox"
    ids = tok.encode(text)
    ref = reference(ids, 6)
    body = {"prompt": text, "max_tokens": 6, "temperature": 0, "echo": True, "return_token_ids": True}
    _, obj = await post(client, "completions", body)
    [ch] = obj["choices"]
    assert (ch["text"], ch["prompt_token_ids"], ch["token_ids"]) == (text + tok.decode(ref), ids, ref)
    _, chunks = await post(client, "completions", {**body, "stream": True})
    first, *rest = [c["choices"][0] for c in chunks]
    assert (first["text"], first["prompt_token_ids"], first["token_ids"]) == (text, ids, [])
    assert [t for c in rest for t in c["token_ids"]] == ref
    _, obj = await post(client, "completions", {**body, "max_tokens": 0})
    [ch] = obj["choices"]
    assert (ch["text"], ch["prompt_token_ids"], ch["token_ids"]) == (text, ids, [])
    assert obj["pddgw"]["output_token_ids"] == [] and obj["pddgw"]["spans"] == []


async def test_responses_return_token_ids_is_a_pddgw_extension(deployment):
    """No vLLM field: the deltas' `pddgw.token_ids` and the summary's `output_token_ids`, over SSE
    and the WebSocket; not asked for, neither."""
    side, client, _ = await deployment()
    body = {"input": "Hello", "max_output_tokens": 10, "temperature": 0}
    ids = side.door.tok.apply_chat_template([("user", "Hello")])
    ref = reference(ids, 10)
    for ask in (True, False):
        _, events = await post(client, "responses", {**body, "stream": True, "return_token_ids": ask})
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        summary = events[-1]["response"]["pddgw"]
        if ask:
            assert [t for d in deltas for t in d["pddgw"]["token_ids"]] == summary["output_token_ids"] == ref
        else:
            assert all(set(d["pddgw"]) == {"position", "role"} for d in deltas) and set(summary) == SUMMARY
        _, obj = await post(client, "responses", {**body, "return_token_ids": ask})
        assert obj["pddgw"].get("output_token_ids") == (ref if ask else None)
        ws = await client.ws_connect("/v1/responses", headers={"Authorization": f"Bearer {KEY}"})
        await ws.send_str(orjson.dumps({"type": "response.create", **body, "return_token_ids": ask}).decode())
        got = []
        while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] != "response.completed":
            assert ev["type"] != "error", ev
            got.append(ev)
        await ws.close()
        ws_deltas = [e for e in got if e["type"] == "response.output_text.delta"]
        if ask:
            assert [t for d in ws_deltas for t in d["pddgw"]["token_ids"]] == ev["response"]["pddgw"][
                "output_token_ids"] == ref
        else:
            assert all(set(d["pddgw"]) == {"position", "role"} for d in ws_deltas)
            assert set(ev["response"]["pddgw"]) == SUMMARY


# ---- lean by default -----------------------------------------------------------------------


@pytest.mark.parametrize("route,body", [
    ("chat/completions", {"messages": MESSAGES}),
    ("completions", {"prompt": PROMPT}),
    ("responses", {"input": "Name a colour."}),
])
async def test_without_asking_no_ids_no_states_no_runs(deployment, route, body):
    _, client, _ = await deployment()
    size = "max_output_tokens" if route == "responses" else "max_tokens"
    body = {**body, size: 40, "temperature": 0, "ignore_eos": True}
    _, obj = await post(client, route, body)
    assert not keys_in(obj) & (ID_KEYS | {"states", "runs"})
    assert set(obj["pddgw"]) == SUMMARY | {"spans"}
    check_spans(obj["pddgw"]["spans"], 40)
    _, events = await post(client, route, {**body, "stream": True})
    assert not keys_in(events) & (ID_KEYS | {"states", "runs", "spans"})
    deltas = [e["pddgw"] for e in events if "position" in e.get("pddgw", {})]
    assert all(set(d) == {"position", "role"} for d in deltas) and deltas[0]["position"] == 0
    last = events[-1]["response"]["pddgw"] if route == "responses" else next(
        e["pddgw"] for e in events if e["choices"] and e["choices"][0]["finish_reason"])
    assert set(last) == SUMMARY


async def test_spans_of_a_p_rld_md_request_are_rld_then_md(deployment):
    """Forced through RLD (an admin key): P's first token and RLD's make one rld span, MD's the
    md span after it; the counts are the timeline's, and streamed deltas tell the same roles."""
    side, client, _ = await deployment()
    # 300 tokens: MD holds the prompt's KV a few tens of tokens in on this WAN, long before the end.
    body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "pddgw": {"pipeline": "P-RLD-MD"}}
    status, obj = await post(client, "completions", body, key=ADMIN)
    assert status == 200, obj
    tl = obj["pddgw"]
    at = tl["handoff_position"]
    assert tl["pipeline"] == "P-RLD-MD" and 0 < at < 300
    assert tl["spans"] == [{"start": 0, "count": at, "role": "rld"}, {"start": at, "count": 300 - at, "role": "md"}]
    assert tl["tokens_by_role"] == {"rld": at, "md": 300 - at}
    _, chunks = await post(client, "completions", {**body, "stream": True, "return_token_ids": True}, key=ADMIN)
    deltas = [c["pddgw"] for c in chunks if "position" in c.get("pddgw", {})]
    at = chunks[-1]["pddgw"]["handoff_position"]
    assert [r for d in deltas for r in [d["role"]] * len(d["token_ids"])] == ["rld"] * at + ["md"] * (300 - at)
    assert [t for d in deltas for t in d["token_ids"]] == reference(PROMPT, 300)


async def test_states_on_request_for_any_key(deployment):
    _, client, _ = await deployment()
    ask = {"pddgw": {"states": True}}
    _, obj = await post(client, "chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, **ask})
    states = obj["pddgw"]["states"]
    assert [s["state"] for s in states][0] == "RECEIVED" and states[-1]["state"] == "FINISHED"
    assert all(set(s) == {"state", "t_ms", "reason"} for s in states)
    assert set(obj["pddgw"]) == SUMMARY | {"spans", "states"}
    _, chunks = await post(client, "completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True, **ask})
    final = next(c for c in chunks if c["choices"][0]["finish_reason"])
    assert final["pddgw"]["states"][-1]["state"] == "FINISHED"
    ws = await client.ws_connect("/v1/responses", headers={"Authorization": f"Bearer {KEY}"})
    await ws.send_str(orjson.dumps({"type": "response.create", "input": "x", "max_output_tokens": 2, **ask}).decode())
    while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] not in ("response.completed", "error"):
        pass
    await ws.close()
    assert ev["type"] == "response.completed" and ev["response"]["pddgw"]["states"][-1]["state"] == "FINISHED"


# ---- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("route,body", [
    ("chat/completions", {"messages": MESSAGES}),
    ("completions", {"prompt": "x"}),
    ("responses", {"input": "x"}),
])
@pytest.mark.parametrize("field,value,param,message", [
    ("return_token_ids", "yes", "return_token_ids", "'return_token_ids' must be a boolean"),
    ("return_token_ids", 1, "return_token_ids", "'return_token_ids' must be a boolean"),
    ("pddgw", {"states": "yes"}, "pddgw.states", "'pddgw.states' must be a boolean"),
    ("pddgw", {"runs": True}, "pddgw", "'pddgw' may only set 'pipeline', 'handoff_mode' and 'states'"),
])
async def test_bad_values_are_400_naming_the_field(deployment, route, body, field, value, param, message):
    _, client, _ = await deployment()
    status, obj = await post(client, route, {**body, field: value})
    assert status == 400 and obj["error"]["param"] == param and obj["error"]["message"] == message, obj


class NoEos(ByteTokenizer):
    """The tiny model's tokenizer, but stating no EOS (or only ids the model cannot sample)."""

    def __init__(self, eos: tuple[int, ...] = ()) -> None:
        super().__init__()
        self._eos = eos


@pytest.mark.parametrize("eos", [(), (100_000,)])
async def test_a_grammar_without_an_eos_token_is_refused(deployment, eos):
    side, client, _ = await deployment()
    side.door.tok = NoEos(eos)
    why = "the model states no EOS token, so a constrained output could never end"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        ("chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format"),
        ("chat/completions", {"messages": MESSAGES, "tools": [tool], "tool_choice": "required"}, "tool_choice"),
        ("responses", {"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ]
    for route, body, param in cases:
        status, obj = await post(client, route, {**body, "max_tokens" if route != "responses" else
                                                 "max_output_tokens": 8})
        assert status == 400, obj
        assert obj["error"] == {"message": f"'{param}' cannot be enforced: {why}", "type": "invalid_request_error",
                                "param": param, "code": "invalid_request_error"}
    ws = await client.ws_connect("/v1/responses", headers={"Authorization": f"Bearer {KEY}"})
    await ws.send_str(orjson.dumps({"type": "response.create", "input": "x",
                                    "text": {"format": {"type": "json_object"}}}).decode())
    while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] != "error":
        pass
    await ws.close()
    assert (ev["error"]["param"], ev["error"]["message"]) == ("text.format", f"'text.format' cannot be enforced: {why}")
    # Unconstrained requests still run.
    status, obj = await post(client, "chat/completions", {"messages": MESSAGES, "max_tokens": 3, "temperature": 0,
                                                          "ignore_eos": True})
    assert status == 200 and obj["usage"]["completion_tokens"] == 3
