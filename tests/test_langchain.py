"""The LangChain adapter on the embedded model: plain chat (generated, streamed, with usage), structured
output in every schema form with open and closed fields, raw decisions,
batch and async, callbacks, clear errors, the install hint and the triage example. The decision model
(``PCDDecisionModel``) has its own module, ``tests/test_langchain_decisions.py``.

Fills are few and share one small schema, so that the head cache keeps them cheap.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

import pytest
from conftest import LoopTicks
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import LLMResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_json_schema
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from pcd_core import Engine, PromptError
from pcd_integrations.langchain import NO_TOOL, ChatPCD, render_chat_messages, render_messages

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "langchain_triage.py"

REFUND = "I was charged twice this month. Refund the duplicate payment today, please!"
CRASH = "The app crashes whenever I press save. Not urgent, I can use the website meanwhile."


class Ticket(BaseModel):
    """A customer support ticket, triaged."""

    urgent: bool = Field(description="Does the customer need an answer today?")
    category: Literal["billing", "bug", "other"] = Field(description="What the ticket is about")


class TicketDict(TypedDict):
    """A customer support ticket, triaged."""

    urgent: bool
    category: Literal["billing", "bug", "other"]


class FreeText(BaseModel):
    urgent: bool
    summary: str = Field(max_length=12, description="The ticket in a few words")


ALLOWED = {"urgent": {True, False}, "category": {"billing", "bug", "other"}}


@pytest.fixture
def llm(engine: Engine) -> ChatPCD:
    return ChatPCD(engine=engine)


def assert_allowed(value: dict[str, Any]) -> None:
    assert set(value) == set(ALLOWED)
    for name, allowed in ALLOWED.items():
        assert value[name] in allowed


class RunRecorder(BaseCallbackHandler):
    """Records the chat-model and chain runs LangChain reports."""

    def __init__(self) -> None:
        self.chat_starts: list[dict[str, Any]] = []
        self.llm_ends: list[LLMResult] = []
        self.chain_starts: list[dict[str, Any]] = []
        self.chain_ends: list[Any] = []

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.chat_starts.append(kwargs)

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.llm_ends.append(response)

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.chain_starts.append({"inputs": inputs, **kwargs})

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self.chain_ends.append(outputs)


# -- structured output ------------------------------------------------------------------------


def test_prompt_chain_returns_a_pydantic_instance(llm: ChatPCD) -> None:
    prompt = ChatPromptTemplate.from_messages([("human", "Support ticket:\n{ticket}")])
    ticket = (prompt | llm.with_structured_output(Ticket)).invoke({"ticket": REFUND})
    assert isinstance(ticket, Ticket)
    assert_allowed(ticket.model_dump())


def test_schema_form_does_not_change_the_decisions(llm: ChatPCD) -> None:
    # the same fields as a pydantic class, its JSON Schema and a TypedDict: a dict for the latter two
    from_pydantic = llm.with_structured_output(Ticket).invoke(REFUND).model_dump()
    from_json_schema = llm.with_structured_output(Ticket.model_json_schema()).invoke(REFUND)
    from_typeddict = llm.with_structured_output(TicketDict).invoke(REFUND)
    assert type(from_json_schema) is dict and type(from_typeddict) is dict
    assert from_json_schema == from_pydantic
    assert_allowed(from_typeddict)


def test_include_raw_carries_the_decisions(llm: ChatPCD, engine: Engine) -> None:
    result = llm.with_structured_output(Ticket, include_raw=True).invoke(REFUND)
    assert set(result) == {"raw", "parsed", "parsing_error"}
    assert result["parsing_error"] is None
    raw, parsed = result["raw"], result["parsed"]
    assert isinstance(raw, AIMessage) and isinstance(parsed, Ticket)
    assert json.loads(raw.content) == parsed.model_dump()
    decisions = raw.response_metadata["pcd"]
    assert list(decisions) == ["urgent", "category"]
    # the metadata is the engine's own fill of the same text, field by field
    expected = engine.fill(Ticket, REFUND).fields
    for name, decision in decisions.items():
        assert decision["value"] == getattr(parsed, name) == expected[name].value
        assert decision["probabilities"] == pytest.approx(expected[name].probabilities, abs=1e-6)
        assert sum(decision["probabilities"].values()) == pytest.approx(1.0, abs=1e-9)
        assert decision["probability"] == max(decision["probabilities"].values())
        assert decision["candidate_mass"] == pytest.approx(expected[name].candidate_mass, abs=1e-6)
        assert decision["confidence"] == pytest.approx(expected[name].confidence, abs=1e-6)
    assert raw.response_metadata["model_name"] == engine.model_name
    assert raw.response_metadata["forward_passes"] > 0
    assert raw.response_metadata["queue_ms"] == 0.0  # nothing else asked the model meanwhile
    assert isinstance(raw.response_metadata["pcd_warnings"], list)
    usage = raw.usage_metadata
    assert usage is not None and usage["output_tokens"] == 0
    assert usage["input_tokens"] == usage["total_tokens"] > 0


def test_every_method_and_strict_value_gives_the_same_fill(llm: ChatPCD) -> None:
    # every method is served by the one strict fill: a method routed elsewhere (a dict for json_mode,
    # a prompt with tool text for function_calling) returns another value and fails here
    expected = llm.with_structured_output(Ticket).invoke(REFUND)
    assert isinstance(expected, Ticket)
    for method in (None, "json_schema", "function_calling", "json_mode"):
        for strict in (None, False, True):
            assert llm.with_structured_output(Ticket, method=method, strict=strict).invoke(REFUND) == expected
    with pytest.raises(ValueError, match="method='xml'"):
        llm.with_structured_output(Ticket, method="xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unsupported arguments"):
        llm.with_structured_output(Ticket, tools=[])


def test_batch_stream_and_async_agree_with_invoke(llm: ChatPCD) -> None:
    structured = llm.with_structured_output(Ticket)
    refund = structured.invoke(REFUND)
    batch = structured.batch([REFUND, CRASH])
    assert batch[0] == refund and isinstance(batch[1], Ticket)
    assert list(structured.stream(REFUND)) == [refund]

    async def run_async() -> tuple[list[Any], list[Any]]:
        return await structured.abatch([REFUND, CRASH]), [c async for c in structured.astream(CRASH)]

    abatch, chunks = asyncio.run(run_async())
    assert abatch == batch
    assert chunks == batch[1:]


def test_async_fill_leaves_the_event_loop_free(llm: ChatPCD) -> None:
    structured = llm.with_structured_output(Ticket)

    async def run() -> int:
        ticks = 0
        task = asyncio.ensure_future(structured.ainvoke(CRASH))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.005)
        await task
        return ticks

    assert asyncio.run(run()) > 1


def test_callbacks_receive_the_chat_model_run(llm: ChatPCD) -> None:
    recorder = RunRecorder()
    structured = llm.with_structured_output(Ticket)
    structured.invoke(REFUND, config={"callbacks": [recorder], "tags": ["triage"]})
    assert len(recorder.chat_starts) == 1 and len(recorder.llm_ends) == 1
    start = recorder.chat_starts[0]
    assert "triage" in start["tags"]
    assert start["options"]["ls_structured_output_format"]["schema"] == convert_to_json_schema(Ticket)
    message = recorder.llm_ends[0].generations[0][0].message
    assert list(message.response_metadata["pcd"]) == ["urgent", "category"]


# -- tool calling -----------------------------------------------------------------------------


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


@tool
def refund_payment(urgent: bool) -> str:
    """Refund a duplicate payment to the customer."""
    return "refunded"


def test_auto_tool_choice_is_a_pcd_choice_with_probabilities(llm: ChatPCD, engine: Engine) -> None:
    message = llm.model_copy(update={"max_tokens": 8}).bind_tools([get_weather, refund_payment]).invoke(REFUND)
    choice = message.response_metadata["pcd"]["tool_choice"]
    assert set(choice["probabilities"]) == {"get_weather", "refund_payment", NO_TOOL}
    assert sum(choice["probabilities"].values()) == pytest.approx(1.0, abs=1e-6)
    assert choice["forced"] is False and choice["choice"] == max(
        choice["probabilities"], key=choice["probabilities"].get
    )
    if choice["choice"] == NO_TOOL:  # the choice made, then the answer generated
        assert not message.tool_calls and message.content and message.response_metadata["pcd"]["generated"]
    else:
        (call,) = message.tool_calls
        assert call["name"] == choice["choice"] and call["id"] and call["type"] == "tool_call"
        arguments = message.response_metadata["pcd"]["arguments"]
        assert set(call["args"]) == set(arguments) and message.response_metadata["finish_reason"] == "tool_calls"


def test_every_tool_choice_form_is_honoured(llm: ChatPCD) -> None:
    tools = [get_weather, refund_payment]
    for forced in ("get_weather", {"type": "function", "function": {"name": "get_weather"}}):
        message = llm.bind_tools(tools, tool_choice=forced).invoke("Weather in Oslo?")
        (call,) = message.tool_calls
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
        decision = message.response_metadata["pcd"]["tool_choice"]
        assert (decision["choice"], decision["forced"], decision["offered"]) == ("get_weather", True, ["get_weather"])
        assert "probabilities" not in decision  # nothing was asked
        assert message.response_metadata["pcd"]["arguments"]["city"]["method"] == "generated"
    for required in ("any", "required"):
        message = llm.bind_tools(tools, tool_choice=required).invoke(REFUND)
        assert len(message.tool_calls) == 1
        assert set(message.response_metadata["pcd"]["tool_choice"]["probabilities"]) == {
            "get_weather",
            "refund_payment",
        }
    none = llm.model_copy(update={"max_tokens": 8}).bind_tools(tools, tool_choice="none").invoke(REFUND)
    assert not none.tool_calls and none.response_metadata["pcd"] == {"generated": True}
    with pytest.raises(ValueError, match="tool_choice='send_email'"):
        llm.bind_tools(tools, tool_choice="send_email")


def test_closed_arguments_are_decided_and_streamed_as_one_tool_call_chunk(llm: ChatPCD) -> None:
    bound = llm.bind_tools([refund_payment], tool_choice="refund_payment")
    message = bound.invoke(REFUND)
    decided = message.response_metadata["pcd"]["arguments"]["urgent"]
    assert decided["method"] != "generated" and sum(decided["probabilities"].values()) == pytest.approx(1.0)
    assert message.usage_metadata["output_tokens"] == 0  # nothing generated: the argument was decided
    (chunk,) = list(bound.stream(REFUND))
    assert chunk.tool_call_chunks[0]["name"] == "refund_payment"
    assert json.loads(chunk.tool_call_chunks[0]["args"]) == message.tool_calls[0]["args"]


def test_after_a_tool_result_auto_does_not_offer_the_same_tool_again(llm: ChatPCD) -> None:
    call = {"name": "get_weather", "args": {"city": "Oslo"}, "id": "call_1"}
    history = [
        HumanMessage("What is the weather in Oslo?"),
        AIMessage("", tool_calls=[call]),
        ToolMessage("sunny in Oslo", tool_call_id="call_1"),
    ]
    answer = llm.model_copy(update={"max_tokens": 8}).bind_tools([get_weather]).invoke(history)
    assert not answer.tool_calls and answer.content and answer.response_metadata["pcd"] == {"generated": True}
    two = llm.model_copy(update={"max_tokens": 8}).bind_tools([get_weather, refund_payment]).invoke(history)
    assert set(two.response_metadata["pcd"]["tool_choice"]["probabilities"]) == {"refund_payment", NO_TOOL}


# -- errors -----------------------------------------------------------------------------------


def test_open_fields_are_generated_and_closed_ones_decided(llm: ChatPCD) -> None:
    result = llm.with_structured_output(FreeText, include_raw=True).invoke(REFUND)
    parsed, raw = result["parsed"], result["raw"]
    assert isinstance(parsed, FreeText) and 0 < len(parsed.summary) <= 12
    fields = raw.response_metadata["pcd"]
    assert fields["urgent"]["method"] != "generated" and 0 < fields["urgent"]["probability"] <= 1
    assert fields["summary"]["method"] == "generated" and fields["summary"]["value"] == parsed.summary
    assert fields["summary"]["logp_sum"] <= 0 < fields["summary"]["mean_probability"] <= 1
    # output tokens count exactly what was generated: the open field's tokens, none for the decision
    assert raw.usage_metadata["output_tokens"] == fields["summary"]["n_tokens"] > 0


def test_openai_tool_and_function_dicts_are_structured_output_schemas(llm: ChatPCD) -> None:
    function = {
        "name": "ticket",
        "description": "A support ticket, triaged.",
        "parameters": convert_to_json_schema(Ticket),
    }
    expected = llm.with_structured_output(Ticket).invoke(REFUND).model_dump()
    for schema in (function, {"type": "function", "function": function}):
        assert llm.with_structured_output(schema).invoke(REFUND) == expected


# -- plain chat -------------------------------------------------------------------------------


def test_plain_chat_is_generated_with_honest_usage(llm: ChatPCD, engine: Engine) -> None:
    chat = llm.model_copy(update={"max_tokens": 12})
    message = chat.invoke("Say hello.")
    reply = engine.generate([{"role": "user", "content": "Say hello."}], max_new_tokens=12)
    assert message.content == reply.text and message.content
    assert message.response_metadata["pcd"] == {"generated": True}
    assert message.response_metadata["finish_reason"] == reply.finish_reason
    assert message.response_metadata["model_name"] == engine.model_name
    usage = message.usage_metadata
    assert usage is not None and usage["output_tokens"] == reply.output_tokens > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens"] == reply.input_tokens


def test_stream_yields_token_deltas_that_add_up_to_invoke(llm: ChatPCD) -> None:
    chat = llm.model_copy(update={"max_tokens": 12})
    whole = chat.invoke("Count to five.")
    chunks = list(chat.stream("Count to five."))
    assert len(chunks) > 3  # token by token, then the last chunk with the usage
    assert "".join(c.content for c in chunks) == whole.content  # type: ignore[misc]
    assert (
        sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata)
        == whole.usage_metadata["output_tokens"]
    )

    async def run() -> tuple[list[str], int]:
        async with LoopTicks() as ticks:
            deltas = [c.content async for c in chat.astream("Count to five.")]
        return deltas, ticks.count  # type: ignore[return-value]

    deltas, ticks = asyncio.run(run())
    assert "".join(deltas) == whole.content and ticks > len(deltas)


def test_stop_and_max_tokens_end_the_reply(llm: ChatPCD) -> None:
    long = llm.model_copy(update={"max_tokens": 16}).invoke("Count from one to ten in words.")
    assert long.response_metadata["finish_reason"] == "length" and long.usage_metadata["output_tokens"] == 16
    word = long.content.split()[2]  # type: ignore[union-attr]
    stopped = llm.model_copy(update={"max_tokens": 16}).invoke("Count from one to ten in words.", stop=[word])
    assert word not in stopped.content and long.content.startswith(stopped.content)  # type: ignore[arg-type]
    assert stopped.response_metadata["finish_reason"] == "stop"


def test_chat_roles_reach_the_template_and_tool_calls_stay_as_text() -> None:
    call = {"name": "lookup", "args": {"id": 7}, "id": "call_1"}
    rendered = render_chat_messages(
        [
            SystemMessage("Be brief."),
            HumanMessage("Find order 7."),
            AIMessage("", tool_calls=[call]),
            ToolMessage("shipped", tool_call_id="call_1"),
        ]
    )
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    assert rendered[2]["content"] == 'lookup({"id": 7})' and rendered[3]["content"] == "shipped"


def test_non_text_content_is_a_prompt_error() -> None:
    image = {"type": "image", "url": "https://example.com/cat.png"}
    with pytest.raises(PromptError, match="'image'"):
        render_messages([HumanMessage(content=[{"type": "text", "text": "look"}, image])])


def test_a_lone_message_is_the_input_and_a_conversation_keeps_roles() -> None:
    assert render_messages([HumanMessage(REFUND)]) == REFUND
    conversation = render_messages([SystemMessage("Be brief."), HumanMessage(REFUND), AIMessage("On it.")])
    assert conversation == f"System: Be brief.\nHuman: {REFUND}\nAI: On it."


# -- construction -----------------------------------------------------------------------------


def test_weights_load_on_first_use_only() -> None:
    llm = ChatPCD(model="smollm2-135m")
    llm.with_structured_output(Ticket)
    assert llm.engine is None


def test_model_name_follows_a_shared_engine(engine: Engine) -> None:
    assert ChatPCD(engine=engine).model == engine.model_name
    with pytest.raises(ValueError, match="engine runs"):
        ChatPCD(model="some-other-model", engine=engine)
    llm = ChatPCD(engine=engine)
    with pytest.raises(ValueError, match="does not switch models"):
        llm.with_structured_output(Ticket).invoke(REFUND, model="some-other-model")


# -- the example ------------------------------------------------------------------------------


def test_triage_example_runs_and_prints_every_decision(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("langchain_triage", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    # pydantic resolves the example's annotations through sys.modules, as for an imported module
    monkeypatch.setitem(sys.modules, spec.name, example)
    spec.loader.exec_module(example)

    tickets = example.main(engine)

    assert len(tickets) == len(example.TICKETS) == 5
    assert all(isinstance(ticket, example.Ticket) for ticket in tickets)
    printed = capsys.readouterr().out
    assert all(text in printed for text in example.TICKETS)
    decision_lines = [line for line in printed.splitlines() if "confidence" in line]
    assert len(decision_lines) == 5 * 4
    assert all("candidate mass" in line for line in decision_lines)


def test_import_without_the_extra_names_the_pip_command() -> None:
    blocked = "import sys; sys.modules['langchain_core'] = None; import pcd_integrations.langchain"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "BackendUnavailableError" in result.stderr
    assert "pip install 'pcd-engine[langchain]'" in result.stderr
