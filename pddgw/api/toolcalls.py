"""Tools at the front door: the request's `tools` / `tool_choice`, their grammar, the output's calls.

Contract:

  * `parse_tools(d)` decodes `tools` (function tools only: `{"type": "function", "function":
    {"name", "description"?, "parameters"?, "strict"?}}`, at most MAX_TOOLS, names
    [a-zA-Z0-9_-]{1,64}, distinct), `tool_choice` ("none", "auto", "required", or
    `{"type": "function", "function": {"name": N}}` naming a given tool) and
    `parallel_tool_calls` -> `ToolRequest`, or None when no tools are given.  ApiError names
    the field.  The Responses API's flat tool shape (`{"type": "function", "name", ...}`) and
    its `{"type": "function", "name": N}` choice are accepted too (`flat=True`).
  * `format_for(template_text)`: which call format the checkpoint's chat template teaches
    (vLLM's tool parsers pick by model the same way): "hermes" (`<tool_call>{json}</tool_call>`,
    Hermes / Qwen), "mistral" (`[TOOL_CALLS][{...}]`), "llama3_json" (`{"name", "parameters"}`),
    else "json" (the built-in template's `{"name", "arguments"}`).
  * `grammar_for(req, fmt)`: "required" / a named function -> a grammar (SamplingParams.grammar)
    that forces valid call(s) in that format, arguments valid against each tool's parameters
    schema (one call; "required" with parallel_tool_calls: one or more where the format has a
    list, "json" and "mistral"); "auto" / "none" -> None (free text, parsed after).
  * `parse_calls(text, fmt)` -> (content or None, [ToolCall]): the calls in an output, as the
    format spells them; text that holds none (or malformed ones) is content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pddgw.api.errors import ApiError, brief, optional

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
ToolFormat = Literal["hermes", "mistral", "llama3_json", "json"]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: str            # the JSON schema of the arguments, as JSON text

    def as_template(self) -> dict[str, Any]:
        """The OpenAI shape that chat templates iterate over (transformers passes it as given)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": json.loads(self.parameters)}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: Literal["none", "auto", "required"] | str     # a str other than those: the forced function
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def may_call(self) -> bool:
        """Whether the output may hold tool calls (tool_choice not "none"): its text is then held
        back and parsed at the end."""
        return self.choice != "none"

    def templated(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template gets them (none with tool_choice "none": vLLM's behaviour)."""
        return None if self.choice == "none" else [t.as_template() for t in self.tools]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str             # JSON text

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _tool(t: Any, i: int, flat: bool) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function":
        raise ApiError(f"{where} must be a function tool {{'type': 'function', ...}}", where)
    fn = t if flat else t.get("function")
    if not isinstance(fn, dict):
        raise ApiError(f"{where}.function must be an object", f"{where}.function")
    at = where if flat else f"{where}.function"
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ApiError(f"{at}.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -", f"{at}.name")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ApiError(f"{at}.description must be a string", f"{at}.description")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ApiError(f"{at}.parameters must be a JSON schema object", f"{at}.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(f"{at}.strict must be a boolean", f"{at}.strict")
    return Tool(name, desc, json.dumps(params, sort_keys=True))


def parse_tools(d: dict[str, Any], flat: bool = False) -> ToolRequest | None:
    tools, choice = d.get("tools"), d.get("tool_choice")
    parallel = optional(d, "parallel_tool_calls", bool)
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ApiError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    parsed = tuple(_tool(t, i, flat) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ApiError("'tools' must have distinct names", "tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice if flat else choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError("'tool_choice' must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in names:
            raise ApiError(f"'tool_choice' names {brief(name)}, which is not in 'tools'", "tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ApiError("'tool_choice' must be 'none', 'auto', 'required' or a function", "tool_choice")
    return ToolRequest(parsed, choice, True if parallel is None else parallel)


def format_for(template_text: str | None) -> ToolFormat:
    t = template_text or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "json"


def _call_schema(tool: Tool, args_key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: json.loads(tool.parameters)},
            "required": ["name", args_key], "additionalProperties": False}


def grammar_for(req: ToolRequest, fmt: ToolFormat) -> tuple[str, str] | None:
    """The grammar of a forced call (SamplingParams.grammar), None unless forced."""
    if not req.forced:
        return None
    chosen = [t for t in req.tools if req.choice in ("required", t.name)]
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    one = ({"anyOf": [_call_schema(t, args_key) for t in chosen]} if len(chosen) > 1
           else _call_schema(chosen[0], args_key))
    many = req.parallel and req.choice == "required"
    if fmt == "hermes":
        tag = {"type": "tag", "begin": "<tool_call>\n", "content": {"type": "json_schema", "json_schema": one},
               "end": "\n</tool_call>"}
        return "structural_tag", json.dumps({"type": "structural_tag", "format": tag})
    if fmt == "mistral":
        arr = {"type": "array", "items": one, "minItems": 1, **({} if many else {"maxItems": 1})}
        tag = {"type": "tag", "begin": "[TOOL_CALLS]", "content": {"type": "json_schema", "json_schema": arr},
               "end": ""}
        return "structural_tag", json.dumps({"type": "structural_tag", "format": tag})
    if many and fmt == "json":
        return "json_schema", json.dumps({"type": "array", "items": one, "minItems": 1})
    return "json_schema", json.dumps(one)


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(obj: Any) -> list[ToolCall] | None:
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call(o) for o in objs]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _calls_of(bodies: list[str]) -> list[ToolCall] | None:
    """The calls of every JSON body in turn; None when one is not JSON or not a call (or a list of
    calls): then the output is text, not calls."""
    calls: list[ToolCall] = []
    for body in bodies:
        try:
            got = _calls(json.loads(body))
        except ValueError:
            return None
        if got is None:
            return None
        calls += got
    return calls


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an output; content None when the output is only calls."""
    if fmt == "hermes":
        if "<tool_call>" not in text:
            return text, []
        calls = _calls_of(_HERMES.findall(text))
        if calls is None:
            return text, []
        content = text[: text.index("<tool_call>")].strip()
        return content or None, calls
    if fmt == "mistral":
        if "[TOOL_CALLS]" not in text:
            return text, []
        head, _, rest = text.partition("[TOOL_CALLS]")
        calls = _calls_of([rest.strip()])
        return (head.strip() or None, calls) if calls else (text, [])
    body = text.strip()
    if fmt == "llama3_json":
        body = body.removeprefix("<|python_tag|>").strip()
        pieces = [p.strip() for p in body.split(";")] if body.startswith("{") else [body]
    else:
        pieces = [body]
    if not pieces[0].startswith(("{", "[")):
        return text, []
    calls = _calls_of(pieces)
    return (None, calls) if calls is not None else (text, [])
