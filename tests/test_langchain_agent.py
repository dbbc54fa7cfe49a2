"""``create_agent(ChatPCD(...), tools=[two tools])`` on the embedded model runs its loop to the end.

The trace must hold at least one tool call whose choice was decided by PCD (its probabilities over
both tools and "answer directly" sum to one), the tool's result, and a final generated answer; with a
``response_format``, the final answer is a fill of it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from pydantic import BaseModel, Field

from pcd_core import Engine
from pcd_integrations.langchain import NO_TOOL, ChatPCD

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "langchain_agent.py"


def load_example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("langchain_agent_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_agent_loop_ends_with_an_answer_and_the_tool_calls_carry_their_probabilities(engine: Engine) -> None:
    example = load_example()
    trace = example.run(ChatPCD(engine=engine, max_tokens=32), "What is the weather in Paris?")
    calls = [m for m in trace if isinstance(m, AIMessage) and m.tool_calls]
    results = [m for m in trace if isinstance(m, ToolMessage)]
    assert calls and len(results) == sum(len(m.tool_calls) for m in calls)
    first = calls[0].response_metadata["pcd"]["tool_choice"]
    assert first["forced"] is False
    assert set(first["probabilities"]) == {"get_weather", "add", NO_TOOL}
    assert sum(first["probabilities"].values()) == pytest.approx(1.0, abs=1e-6)
    assert (
        first["choice"] == calls[0].tool_calls[0]["name"] == max(first["probabilities"], key=first["probabilities"].get)
    )
    last = trace[-1]
    assert isinstance(last, AIMessage) and not last.tool_calls and last.text
    assert last.response_metadata["pcd"]["generated"] is True


class Weather(BaseModel):
    """The weather, as the agent reports it."""

    sunny: bool = Field(description="Is it sunny?")


def test_agent_response_format_is_filled_after_the_tools(engine: Engine) -> None:
    # the profile claims structured output, so create_agent binds an OpenAI-style response_format
    example = load_example()
    agent: Any = create_agent(
        ChatPCD(engine=engine, max_tokens=32), tools=[example.get_weather], response_format=Weather
    )
    state = agent.invoke({"messages": [("user", "Is it sunny in Paris?")]}, {"recursion_limit": 8})
    assert isinstance(state["structured_response"], Weather)
    assert any(isinstance(m, ToolMessage) for m in state["messages"])
    assert "sunny" in state["messages"][-1].response_metadata["pcd"]
