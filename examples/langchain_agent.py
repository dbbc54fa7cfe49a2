"""A LangChain agent on the embedded model: ``create_agent(ChatPCD(), tools=[...])`` runs to its end.

Each turn, which tool to call (or none) is a PCD choice over the tool names and descriptions; the
arguments are a fill of the tool's argument schema; the final answer is generated. The script prints
every tool call with the probabilities of the choice. Run: ``python examples/langchain_agent.py``.
"""

from __future__ import annotations

from typing import Any

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.tools import tool

from pcd_integrations.langchain import ChatPCD


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 21 degrees in {city}."


@tool
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


def run(llm: ChatPCD, question: str) -> list[BaseMessage]:
    """The agent's whole trace for ``question``: the question, every tool call and result, the answer."""
    agent: Any = create_agent(llm, tools=[get_weather, add])
    return list(agent.invoke({"messages": [("user", question)]}, {"recursion_limit": 12})["messages"])


def main() -> None:
    for message in run(ChatPCD(max_tokens=48), "What is the weather in Paris?"):
        if isinstance(message, AIMessage) and message.tool_calls:
            choice = message.response_metadata["pcd"]["tool_choice"]
            for call in message.tool_calls:
                print(f"tool call {call['name']}({call['args']}) probabilities={choice.get('probabilities')}")
        else:
            print(f"{message.type}: {message.text}")


if __name__ == "__main__":
    main()
