"""The core tool choice (``pcd_core/tools.py``) on the embedded model: what is offered, what is asked,
and what costs nothing.

The adapters' tests (``tests/test_langchain.py``, ``tests/test_llama_index_llm.py``) and the route's
(``tests/test_chat_completions.py``) check the same rules through each framework.
"""

from __future__ import annotations

import pytest

from pcd_core import Engine
from pcd_core.tools import (
    NO_TOOL,
    ToolChoice,
    ToolChoiceError,
    ToolSpec,
    choose_tool,
    normalise_tool_choice,
    tool_arguments,
)

WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather\n    in a city.",
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]},
)
REFUND = ToolSpec(
    "refund_payment",
    "Refund a duplicate payment to the customer.",
    {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"]},
)
PING = ToolSpec("ping", "Check that the service is up.")
TOOLS = [WEATHER, REFUND]
ASK = "My card was charged twice for order 1182. Refund the duplicate today."


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, ToolChoice("auto")),
        ("auto", ToolChoice("auto")),
        ("any", ToolChoice("required")),
        ("required", ToolChoice("required")),
        (True, ToolChoice("required")),
        ("none", ToolChoice("none")),
        ("get_weather", ToolChoice("named", "get_weather")),
        ({"type": "function", "function": {"name": "get_weather"}}, ToolChoice("named", "get_weather")),
        ({"name": "refund_payment"}, ToolChoice("named", "refund_payment")),
    ],
)
def test_every_tool_choice_form_has_one_normal_form(raw: object, expected: ToolChoice) -> None:
    assert normalise_tool_choice(raw, ["get_weather", "refund_payment"]) == expected


@pytest.mark.parametrize("raw", ["send_email", {"type": "function", "function": {}}, 3])
def test_a_choice_that_names_no_offered_tool_is_a_value_error(raw: object) -> None:
    with pytest.raises(ToolChoiceError) as caught:
        normalise_tool_choice(raw, ["get_weather"])
    assert isinstance(caught.value, ValueError)


def test_the_no_tool_option_and_empty_names_cannot_be_tools() -> None:
    with pytest.raises(ToolChoiceError, match=NO_TOOL):
        ToolSpec(NO_TOOL)
    with pytest.raises(ToolChoiceError, match="non-empty"):
        ToolSpec(" ")
    assert WEATHER.description == "Get the current weather in a city."  # one line: one criterion


def test_auto_is_a_pcd_choice_over_the_tools_and_answering_directly(engine: Engine) -> None:
    decision = choose_tool(engine, ASK, TOOLS, ToolChoice("auto"))
    assert decision.answer is not None and not decision.forced
    record = decision.to_dict()
    assert list(record["probabilities"]) == ["get_weather", "refund_payment", NO_TOOL] == record["offered"]
    assert sum(record["probabilities"].values()) == pytest.approx(1.0, abs=1e-6)
    assert record["choice"] == max(record["probabilities"], key=record["probabilities"].get)
    assert decision.choice == (decision.tool.name if decision.tool else NO_TOOL)
    assert record["input_tokens"] == decision.stats.input_tokens > 0


def test_required_leaves_out_answering_directly(engine: Engine) -> None:
    decision = choose_tool(engine, ASK, TOOLS, ToolChoice("required"), called={"refund_payment"})
    assert decision.tool is not None and decision.offered == ("get_weather", "refund_payment")
    assert decision.answer is not None and set(decision.answer.probabilities) == {"get_weather", "refund_payment"}


@pytest.mark.parametrize(
    ("choice", "called", "tool", "offered"),
    [
        (ToolChoice("named", "refund_payment"), set(), REFUND, ("refund_payment",)),
        (ToolChoice("none"), set(), None, (NO_TOOL,)),
        (ToolChoice("auto"), {"get_weather", "refund_payment"}, None, (NO_TOOL,)),
    ],
)
def test_one_option_left_is_taken_without_a_forward_pass(
    engine: Engine, choice: ToolChoice, called: set[str], tool: ToolSpec | None, offered: tuple[str, ...]
) -> None:
    passes = engine.backend.forward_passes
    decision = choose_tool(engine, ASK, TOOLS, choice, called)
    assert engine.backend.forward_passes == passes
    assert (decision.tool, decision.offered, decision.forced, decision.stats.input_tokens) == (tool, offered, True, 0)
    assert "probabilities" not in decision.to_dict()


def test_auto_does_not_offer_a_tool_called_this_turn_again(engine: Engine) -> None:
    decision = choose_tool(engine, ASK, TOOLS, ToolChoice("auto"), called={"get_weather"})
    assert decision.offered == ("refund_payment", NO_TOOL) and decision.called_this_turn == ("get_weather",)
    assert decision.answer is not None and set(decision.answer.probabilities) == {"refund_payment", NO_TOOL}


def test_arguments_are_a_fill_of_the_parameters_and_none_without_parameters(engine: Engine) -> None:
    filled = tool_arguments(engine, ASK, REFUND)
    assert filled is not None and set(filled.values) == {"urgent"} and isinstance(filled.values["urgent"], bool)
    assert filled.fields["urgent"].method != "generated"  # a closed argument is decided
    passes = engine.backend.forward_passes
    assert tool_arguments(engine, ASK, PING) is None and engine.backend.forward_passes == passes


def test_repeated_tool_names_and_required_without_tools_are_refused(engine: Engine) -> None:
    with pytest.raises(ToolChoiceError, match="distinct"):
        choose_tool(engine, ASK, [WEATHER, WEATHER], ToolChoice("auto"))
    with pytest.raises(ToolChoiceError, match="at least one tool"):
        choose_tool(engine, ASK, [], ToolChoice("required"))
