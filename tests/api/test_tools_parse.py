"""Tool-call parsing per format, the format chosen from the template, and the forced grammars."""

from __future__ import annotations

import json

import pytest

from pddgw.api.errors import ApiError
from pddgw.api.toolcalls import format_for, grammar_for, parse_calls, parse_tools
from pddgw.engines.grammar import check_spec

TOOLS = {"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
                   {"type": "function", "function": {"name": "b"}}]}


def named(text, fmt):
    content, calls = parse_calls(text, fmt)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes():
    assert named('ok <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                 '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
                 "hermes") == ("ok", [("a", {"x": 1}), ("b", {})])
    assert named("<tool_call>{broken</tool_call>", "hermes") == ("<tool_call>{broken</tool_call>", [])


def test_mistral():
    assert named('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]', "mistral") == (None, [("a", {"x": 1})])
    assert named("plain", "mistral") == ("plain", [])


def test_llama3_json():
    assert named('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
                 "llama3_json") == (None, [("a", {"x": 1}), ("b", {})])
    assert named('{"nope": 1}', "llama3_json") == ('{"nope": 1}', [])


def test_builtin_json():
    assert named('{"name": "a", "arguments": "{\\"x\\": 2}"}', "json") == (None, [("a", {"x": 2})])
    assert named('[{"name": "a", "arguments": {}}]', "json") == (None, [("a", {})])
    assert named("hello", "json") == ("hello", [])


def test_format_from_template():
    assert format_for("{{ '<tool_call>' }}") == "hermes"
    assert format_for("[TOOL_CALLS]") == "mistral"
    assert format_for("<|python_tag|>") == "llama3_json"
    assert format_for(None) == "json"


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json", "json"])
def test_forced_grammars_compile(fmt):
    for choice in ("required", {"type": "function", "function": {"name": "b"}}):
        g = grammar_for(parse_tools({**TOOLS, "tool_choice": choice}), fmt)
        assert g is not None
        check_spec(*g)
    assert grammar_for(parse_tools(TOOLS), fmt) is None


def test_parse_tools_refusals_name_the_field():
    assert parse_tools({}) is None
    for d, param in (({"tool_choice": "required"}, "tool_choice"),
                     ({**TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
                     ({"tools": TOOLS["tools"] * 2}, "tools"),
                     ({**TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
                     ({"tools": [{"type": "web"}]}, "tools[0]")):
        with pytest.raises(ApiError) as e:
            parse_tools(d)
        assert e.value.param == param
