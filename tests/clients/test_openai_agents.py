"""The openai-agents SDK, unmodified, running one tool-using agent turn against `pddgw serve --model tiny`.

An Agent on `OpenAIChatCompletionsModel` (an AsyncOpenAI pointed at the server) with one
function tool and `ModelSettings(tool_choice="required", parallel_tool_calls=False)`: the
first model call must come back as one call of that tool (the server forces it with a
grammar) whose arguments the SDK accepts for the tool's own schema (a string of at most 6
characters and an enum, so a greedy random model ends well inside max_tokens), so the SDK
runs the tool; the SDK then resets tool_choice (`reset_tool_choice`, its default) and sends
the tool's output back for a second call, whose text (gibberish: random weights, greedy)
ends the run as its final output.
Tracing is off: nothing leaves 127.0.0.1.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from openai import AsyncOpenAI
from pydantic import Field

from tests.clients.served import serve_tiny

agents = pytest.importorskip("agents", reason="the openai-agents SDK is not installed (the test extra)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("agents")) as s:
        yield s


async def test_one_tool_using_agent_turn(server):
    agents.set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=6)], unit: Literal["c", "f"]) -> str:
        """The weather in a city.

        Args:
            city: the city's name
            unit: degrees Celsius or Fahrenheit
        """
        calls.append((city, unit))
        return f"sunny, 21 degrees {unit}"

    schema = get_weather.params_json_schema
    assert schema["required"] == ["city", "unit"] and schema["additionalProperties"] is False
    oai = AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        agent = agents.Agent(
            name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
            model=agents.OpenAIChatCompletionsModel(model=server.model, openai_client=oai),
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                max_tokens=200))
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    finally:
        await oai.close()

    # The tool ran once, on arguments its schema admits (pydantic checked them before the call).
    [(city, unit)] = calls
    assert isinstance(city, str) and len(city) <= 6 and unit in ("c", "f")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    call, output, message = result.new_items
    assert call.raw_item.name == "get_weather"
    assert output.output == f"sunny, 21 degrees {unit}"
    assert output.raw_item["call_id"] == call.raw_item.call_id
    # Two model calls: the forced one, then the answer after the tool's output.
    assert len(result.raw_responses) == 2
    assert result.final_output == agents.ItemHelpers.text_message_output(message)
    assert isinstance(result.final_output, str)
    assert "request_refused" not in server.log()
